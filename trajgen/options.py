"""The run's options: one frozen dataclass, the single source of the CLI's flags, their defaults,
their help, the README's flag table, what resume compares and what exports record.

`batch_runner.main` takes exactly these fields as keyword arguments (its signature is built
from them), and the argument parser in `trajgen/flags.py` reads their types from here.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import os
import typing
import urllib.parse
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from trajgen.distributions import get_distribution
from trajgen.errors import UsageError
from trajgen.local_model import NAME as LOCAL_MODEL
from trajgen.sandbox.config import BACKENDS, SandboxConfig, new_root_dir
from trajgen.tools import ToolSettings
from trajgen.work import ModelSettings

DEFAULT_BASE_URL = "https://openrouter.ai/api/v1"
DEFAULT_SYSTEM_PROMPT = (
    "You are a capable assistant with access to tools. Think step by step, use the tools when they "
    "help, check your work, and end with a clear final answer."
)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
ListFlag = typing.Union[str, tuple, list, None]  # Fire-era callers pass `a,b` as a tuple; the CLI passes "a,b"


def flag(default, help: str, *, minimum: float | None = None, resume: bool = False, provenance: bool = False):
    """A field that is a CLI flag. `resume`: a changed value refuses --resume without --force.
    `provenance`: exported with every row. `minimum`: the smallest value accepted."""
    return field(default=default, metadata={"help": help, "minimum": minimum, "resume": resume,
                                            "provenance": provenance})


@dataclass(frozen=True)
class RunOptions:
    dataset_file: str | None = flag(None, 'JSONL file, one object per line with a string "prompt" (optional "image"/"docker_image", "cwd", "verify").')
    run_name: str | None = flag(None, "Name of the run; output goes to <output_dir>/<run_name>/.")
    batch_size: int = flag(10, "Consecutive prompts per batch_<N>.jsonl file.", minimum=1)
    model: str = flag("anthropic/claude-sonnet-4.6", 'Model name sent to the endpoint; "local" serves a small packaged model on 127.0.0.1 (needs .[local]).', resume=True)
    base_url: str = flag(DEFAULT_BASE_URL, "OpenAI-compatible endpoint (default OpenRouter).", resume=True, provenance=True)
    api_key: str | None = flag(None, "API key (default env OPENROUTER_API_KEY, else OPENAI_API_KEY; any dummy for local servers). Visible to every user in ps: prefer the variable.")
    num_workers: int | str = flag(4, "Worker processes; with --executor=ray, auto: one per --worker_cpus of the cluster's CPUs, following nodes that join and leave.", minimum=1)
    concurrency: int = flag(32, "Conversations in flight across all workers.", minimum=1)
    executor: str = flag("processes", "Where the workers run: processes (this machine) or ray (Ray actors; see --ray_address).")
    ray_address: str | None = flag(None, "With --executor=ray: unset starts a private local Ray instance; auto or host:port joins a running cluster.")
    worker_cpus: float = flag(1.0, "With --executor=ray: CPUs each worker reserves (so, how many workers fit on a node).")
    worker_memory: float | None = flag(None, "With --executor=ray: MB of memory each worker reserves (default: none).")
    distribution: str = flag("default", "Toolset distribution sampled per prompt (see --list_distributions).", resume=True, provenance=True)
    max_turns: int = flag(10, "API calls with tools per prompt before one last call asks for a final answer.", minimum=1, resume=True, provenance=True)
    resume: bool = flag(False, "Continue an existing run: run only prompts without a final record.")
    overwrite: bool = flag(False, "Delete an existing run directory of that name and start again.")
    force: bool = flag(False, "With --resume, accept a changed model, distribution or sampling settings.")
    list_distributions: bool = flag(False, "Print the toolset distributions and exit.")
    export: str | None = flag(None, "Export a finished run (--run_name) for a trainer, and exit: hf (TRL, axolotl), sharegpt (LLaMA-Factory), openai (OpenAI fine-tuning), hermes (the seed's Hermes text) or parquet (hf records); see docs/exports.md.")
    export_outcome: ListFlag = flag(None, "With --export: only rows whose verify status is one of these (comma list of passed, failed, error, timeout, unverified).")
    export_partial: bool = flag(False, "With --export: include partial rows (ended by the forced final-answer call), left out by default.")
    view: bool = flag(False, "Serve a browser viewer of a run (--run_name) on 127.0.0.1 until Ctrl-C.")
    report: bool = flag(False, "Write a self-contained report.html of a run (--run_name) into its directory, and exit.")
    view_port: int = flag(8765, "Port of --view on 127.0.0.1 (0: any free port).", minimum=0)
    dry_run: bool = flag(False, "Validate everything, send one tiny request, print the plan and a cost estimate; run nothing.")
    max_cost: float | None = flag(None, "Stop admitting prompts once this invocation has spent this many dollars (endpoint-reported cost).", minimum=0)
    max_total_tokens: int | None = flag(None, "Stop admitting prompts once this invocation has used this many tokens.", minimum=1)
    cache_dir: str | None = flag(None, "Cache of replies shared between runs (off by default): a request sent before, byte for byte (same model, sampling settings, system prompt, tools, history), gets its reply again without a call.")
    cache_max_mb: float = flag(1024.0, "Size bound of --cache_dir in MB; the least recently used replies are deleted at the end of each run.", minimum=1)
    verbose: bool = flag(False, "Print worker logs (tracebacks of failed prompts).")
    output_dir: str = flag("data", "Parent directory of run directories.")
    max_samples: int | None = flag(None, "Run only the first N valid prompts.", minimum=1)
    skip_invalid: bool = flag(False, "Run without the dataset's bad lines (they are counted) instead of refusing.")
    temperature: float | None = flag(None, "Sampling temperature.", resume=True, provenance=True)
    top_p: float | None = flag(None, "Nucleus sampling.", resume=True, provenance=True)
    max_tokens: int | None = flag(None, "Max tokens per completion.", minimum=1, resume=True, provenance=True)
    seed: int = flag(0, "Seed of the per-prompt toolset sampling.", resume=True, provenance=True)
    max_retries: int = flag(10, "Retries per API call (429, 5xx, timeouts, connection errors; Retry-After is honoured).", minimum=0)
    retry_budget: float = flag(300.0, "Seconds an API call may spend retrying before it fails its prompt.", minimum=0)
    request_timeout: float = flag(600.0, "Seconds per API request.", minimum=0.001)
    prompt_timeout: float | None = flag(None, "Wall-clock seconds per prompt; past it the prompt fails (resume retries it).", minimum=1)
    require_reasoning: bool = flag(True, "Discard samples in which no assistant turn has reasoning.", resume=True)
    samples_per_prompt: int = flag(1, "Independent rollouts of each prompt, each its own sample (raising it on --resume runs only the new samples).", minimum=1)
    toolsets_per_sample: bool = flag(False, "Sample the toolsets for every sample instead of once per prompt (a group then differs in its tools).", resume=True, provenance=True)
    verify_timeout: float = flag(300.0, "Seconds a row's verify command may run in its sandbox; past it the check is a timeout.", minimum=1)
    require_verified: bool = flag(False, "Keep only rows whose verify command passed in trajectories.jsonl (the rest stay in the batch files).")
    keep_hallucinated: bool = flag(False, "Keep rows that call a tool that was not offered in trajectories.jsonl.")
    require_toolsets: bool = flag(False, "Refuse to run when a sampled toolset or tool is unavailable here.")
    providers_allowed: ListFlag = flag(None, "OpenRouter: only these providers (comma list).")
    providers_ignored: ListFlag = flag(None, "OpenRouter: never these providers (comma list).")
    providers_order: ListFlag = flag(None, "OpenRouter: try providers in this order (comma list).")
    provider_sort: str | None = flag(None, "OpenRouter: sort providers by price, throughput or latency.")
    reasoning_effort: str | None = flag(None, "none, minimal, low, medium, high or xhigh.")
    reasoning_disabled: bool = flag(False, "OpenRouter: ask for no reasoning.")
    ephemeral_system_prompt: str = flag("", "Appended to the system prompt at run time, never written to trajectories.")
    prefill_messages_file: str | None = flag(None, "JSON list of {role, content} messages sent before the prompt, not written.")
    vision_model: str | None = flag(None, "Model for vision_analyze (default: --model).")
    vision_base_url: str | None = flag(None, "OpenAI-compatible endpoint for vision_analyze (default: --base_url).")
    vision_api_key: str | None = flag(None, "Key for the vision endpoint (default: the run's key, sent only when the vision endpoint is the run's own).")
    image_model: str | None = flag(None, "image_generate through the endpoint's OpenAI images API with this model (default: FAL when FAL_KEY is set).")
    browser_executable: str | None = flag(None, "Chromium binary for the browser tools (default: $CHROMIUM_PATH, else chromium on PATH).")
    allow_private_urls: bool = flag(False, "Let web_extract and the browser reach loopback, private and link-local addresses.")
    terminal_backend: str | None = flag(None, "Sandbox backend: local (bubblewrap), docker, apptainer (alias singularity) or modal (default env TERMINAL_ENV, else local).")
    command_timeout: float = flag(180.0, "Default seconds per terminal command; the command's whole process tree is killed then.", minimum=1)
    docker_image: str = flag("python:3.11-slim", "Image for prompts that name none (container backends: docker, apptainer, modal).")
    sandbox_network: bool = flag(False, "Give sandboxes network access (off by default).")
    keep_sandboxes: bool = flag(False, "Keep per-prompt sandboxes after the run, for debugging.")
    unsafe_local: bool = flag(False, "Where bubblewrap cannot run, use plain per-prompt directories (weaker isolation).")
    sandbox_memory: int = flag(4096, "MB of memory per sandbox, its /tmp and work dir included (a cgroup; per process where none).", minimum=16)
    sandbox_disk: int = flag(1024, "MB of /tmp and of the work dir per sandbox (each a sized tmpfs).", minimum=1)
    docker_root: bool = flag(False, "Run docker sandbox commands as root (for images that need it) instead of uid 65534.")
    apptainer_cache_dir: str | None = flag(None, "Where the apptainer backend builds each image into a SIF file, once (default ~/.cache/trajgen/sif).")
    modal_app: str = flag("trajgen", "Modal app the modal backend's sandboxes run under (created if missing).")
    modal_timeout: int = flag(3600, "Seconds a modal sandbox may live; Modal ends it then, whatever its prompt is doing.", minimum=1)

    @property
    def forks_workers(self) -> bool:
        """Whether this invocation runs prompts in the process pool, whose workers fork from trajgen/fork_server.py."""
        return self.executor == "processes" and not (self.dry_run or self.list_distributions or self.export
                                                     or self.view or self.report)

    @property
    def backend(self) -> str:
        backend = self.terminal_backend or os.environ.get("TERMINAL_ENV") or "local"
        return "apptainer" if backend == "singularity" else backend  # Apptainer's former name

    def model_settings(self, api_key: str, prefill: list[dict]) -> ModelSettings:
        body, effort, _ = self.request_extras()
        return ModelSettings(
            model=self.model, base_url=self.base_url, api_key=api_key, max_turns=self.max_turns,
            temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens, max_retries=self.max_retries,
            retry_budget=float(self.retry_budget), request_timeout=float(self.request_timeout), prompt_timeout=self.prompt_timeout, extra_body=body,
            reasoning_effort=effort, system_prompt=DEFAULT_SYSTEM_PROMPT,
            ephemeral_system_prompt=self.ephemeral_system_prompt, prefill_messages=prefill)

    def tool_settings(self, api_key: str) -> ToolSettings:
        return ToolSettings(
            base_url=self.base_url, api_key=api_key, model=self.model,
            vision_model=self.vision_model or "", vision_base_url=self.vision_base_url or "",
            vision_api_key=self.vision_api_key or "", image_model=self.image_model or "",
            browser_executable=self.browser_executable or "", allow_private_urls=self.allow_private_urls)

    @property
    def run_id(self) -> str:
        """The run directory's identity, the same for every invocation that continues it."""
        run_dir = Path(self.output_dir, self.run_name or "").resolve()
        return hashlib.sha256(str(run_dir).encode()).hexdigest()[:12]

    def sandbox_config(self) -> SandboxConfig:
        """Creates the run's sandbox root (and sweeps stale ones): call once, then `cleanup` it."""
        return SandboxConfig(
            backend=self.backend, command_timeout=float(self.command_timeout), docker_image=self.docker_image,
            network=self.sandbox_network, keep=self.keep_sandboxes, unsafe_local=self.unsafe_local,
            root_dir=new_root_dir(), label=uuid.uuid4().hex[:12], run_id=self.run_id, memory_mb=self.sandbox_memory,
            disk_mb=self.sandbox_disk, docker_root=self.docker_root, sif_cache=self.apptainer_cache_dir or "",
            modal_app=self.modal_app, modal_timeout=self.modal_timeout)

    def request_extras(self) -> tuple[dict, str | None, list[str]]:
        """Provider routing and reasoning controls: (extra_body, reasoning_effort parameter, what will be sent)."""
        body: dict = {}
        said: list[str] = []
        openrouter = "openrouter.ai" in self.base_url
        provider = {k: v for k, v in {
            "only": as_list(self.providers_allowed), "ignore": as_list(self.providers_ignored),
            "order": as_list(self.providers_order), "sort": self.provider_sort}.items() if v}
        effort = self.reasoning_effort
        if provider:
            body["provider"] = provider
            said.append(f"provider routing {provider}" + ("" if openrouter else " (an OpenRouter field; this endpoint may ignore it)"))
        if openrouter and (effort or self.reasoning_disabled):
            body["reasoning"] = {"enabled": False} if self.reasoning_disabled else {"effort": effort}
            said.append(f"OpenRouter reasoning {body['reasoning']}")
            effort = None
        elif self.reasoning_disabled:
            effort = "none"
        if effort:
            said.append(f"reasoning_effort={effort}")
        return body, effort, said

    def manifest(self, dataset_info: dict) -> dict:
        """manifest.json: what this run is, for resume and for exports."""
        return {"format_version": 1, "run_name": self.run_name, **self.settings_that_matter(),
                "terminal_backend": self.backend, "batch_size": self.batch_size, "dataset": dataset_info}

    def settings_that_matter(self) -> dict:
        """What --resume compares with the run's manifest (the system prompt is part of the data too)."""
        return {f.name: getattr(self, f.name) for f in FIELDS if f.metadata["resume"]} | {
            "system_prompt": DEFAULT_SYSTEM_PROMPT}

    def changed_since(self, manifest: dict) -> list[str]:
        """The settings that differ from an earlier invocation's manifest, as `name: old -> new`."""
        now = self.settings_that_matter()
        if self.model == LOCAL_MODEL:  # it serves on a new port each time: its address is not a setting
            now.pop("base_url", None)
        return [f"{k}: {manifest.get(k)!r} -> {v!r}" for k, v in now.items() if manifest.get(k) != v]


FIELDS: tuple[dataclasses.Field, ...] = dataclasses.fields(RunOptions)
TYPES: dict[str, object] = typing.get_type_hints(RunOptions)
PROVENANCE_SETTINGS: tuple[str, ...] = tuple(f.name for f in FIELDS if f.metadata["provenance"])


def as_list(value) -> list[str]:
    """A list flag given as `a,b`, as a tuple, or as a list."""
    if value is None or value is False:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    return [part.strip() for item in items for part in str(item).split(",") if part.strip()]


def check(opts: RunOptions) -> None:
    """Every check of the flags on their own, before a file is read or a request sent."""
    if not opts.dataset_file:
        raise UsageError("--dataset_file is required")
    if opts.run_name is None or opts.run_name.strip() in ("", ".", ".."):
        raise UsageError("--run_name is required")
    if "/" in opts.run_name:
        raise UsageError("--run_name must not contain '/'")
    if isinstance(opts.num_workers, str) and (opts.num_workers != "auto" or opts.executor != "ray"):
        raise UsageError(f"--num_workers must be an integer >= 1, or auto with --executor=ray; got {opts.num_workers!r}")
    for f in FIELDS:
        value = getattr(opts, f.name)
        if f.metadata["minimum"] is not None and isinstance(value, (int, float)) and value < f.metadata["minimum"]:
            raise UsageError(f"--{f.name} must be a number >= {f.metadata['minimum']}, got {value!r}")
    for name in ("base_url", "vision_base_url"):
        url = getattr(opts, name)
        if url is not None and (urllib.parse.urlsplit(url).scheme not in ("http", "https")
                                or not urllib.parse.urlsplit(url).hostname):
            raise UsageError(f"--{name} must be an http:// or https:// URL, got {url!r}")
    if opts.export_outcome and not opts.export:
        raise UsageError("--export_outcome selects rows for --export; pass --export too")
    if opts.export_partial and not opts.export:
        raise UsageError("--export_partial selects rows for --export; pass --export too")
    if opts.backend not in BACKENDS:
        raise UsageError(f"--terminal_backend must be one of {', '.join(BACKENDS)}, got {opts.backend!r}")
    if opts.provider_sort not in (None, "price", "throughput", "latency"):
        raise UsageError("--provider_sort must be price, throughput or latency")
    if opts.reasoning_effort not in (None, *REASONING_EFFORTS):
        raise UsageError(f"--reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}")
    try:
        get_distribution(opts.distribution)
    except KeyError as e:
        raise UsageError(e.args[0])
    if opts.executor != "processes":  # Ray is imported only when asked for: it costs every worker 0.3 s and 35 MB
        from trajgen.ray_executor import check_executor
        check_executor(opts.executor, opts.ray_address, opts.worker_cpus, opts.worker_memory)
    if not os.path.isfile(opts.dataset_file):
        raise UsageError(f"--dataset_file {opts.dataset_file}: no such file")


def signature() -> inspect.Signature:
    """The signature `batch_runner.main` shows to Fire, --help and the README test."""
    return inspect.Signature([inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                                annotation=TYPES[f.name]) for f in FIELDS])


def docstring(summary: str) -> str:
    """`summary` followed by an Args section Fire turns into --help."""
    lines = [f"        {f.name}: {f.metadata['help']}" for f in FIELDS]
    return f"{summary}\n\n    Args:\n" + "\n".join(lines) + "\n"


def flag_table() -> str:
    """The README's flag reference (`python -m trajgen.options` prints it)."""
    shown = lambda f: f.default if f.name == "base_url" else repr(f.default)  # noqa: E731
    rows = [f"| `--{f.name}` | `{shown(f)}` | {f.metadata['help'].replace('|', '/')} |" for f in FIELDS]
    return "\n".join(["| flag | default | meaning |", "|---|---|---|", *rows])


if __name__ == "__main__":
    print(flag_table())
