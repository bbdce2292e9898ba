"""Errors that decide a prompt's final state or stop the run.

A failed prompt records the class name of its error; resume retries it. Anything not listed
here that escapes a conversation also makes the prompt failed, with its traceback kept.
"""


class UsageError(Exception):
    """Bad flags or bad input: one line to the user, exit status 2, nothing written."""


class FatalAPIError(Exception):
    """The endpoint refuses us for every prompt (401, 402, 403): stop the run instead of burning the dataset."""


class RunStopped(Exception):
    """The run stopped on a fatal error (the endpoint refused it, the local model server died) with the prompt in flight."""


class PromptTimeout(Exception):
    """The prompt ran past --prompt_timeout."""


class ImageUnavailable(Exception):
    """The prompt's container image could not be found or pulled."""


class WorkerCrashed(Exception):
    """The worker process running the prompt died."""
