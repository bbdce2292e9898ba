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


class NoNodeCanServe(Exception):
    """No node of the Ray cluster has what the prompt's tools need (a sandbox, a browser, an image)."""


class ProviderError(Exception):
    """The endpoint answered 200 with an `{"error": {...}}` object (OpenRouter does this for an upstream failure)."""

    def __init__(self, message: str, status: int | None):
        super().__init__(f"{message} (status {status})" if status else message)
        self.status = status


class MalformedResponse(Exception):
    """The endpoint answered 200 with a body that is not a chat completion (not JSON, no `choices`, `choices: []`)."""


class DiskFull(Exception):
    """No space left on the device of the run directory: the run stops with every row already written kept."""

    def __init__(self, path):
        super().__init__(f"no space left on the device writing {path}")
        self.path = path
