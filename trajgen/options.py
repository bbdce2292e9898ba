"""The run's options: one frozen dataclass, the single source of the CLI's flags, their defaults,
their help, the flag table of docs/flags.md, what resume compares and what exports record.

`batch_runner.main` takes exactly these fields as keyword arguments (its signature is built
from them), and the argument parser in `trajgen/command_line.py` reads their types from here.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import os
import sys
import typing
import urllib.parse
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from trajgen import roles
from trajgen.errors import UsageError
from trajgen.local_model import NAME as LOCAL_MODEL
from trajgen.sandbox.backends import BACKENDS, SandboxConfig, new_root_dir
from trajgen.tools import ToolSettings
from trajgen.task import JudgeConfig, ModelSettings, SimulatedUser

DEFAULT_BASE_URL = "https://openrouter.ai/api/v1"
DEFAULT_SYSTEM_PROMPT = (
    "You are a capable assistant with access to tools. Think step by step, use the tools when they "
    "help, check your work, and end with a clear final answer."
)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
ListFlag = typing.Union[str, tuple, list, None]  # Fire-era callers pass `a,b` as a tuple; the CLI passes "a,b"


# What a user is doing when they reach for a flag: --help shows the flags in these groups, in this order.
GROUPS: dict[str, str] = {
    "endpoint": "Endpoint and model",
    "run": "Dataset and run",
    "tools": "Tools and sandboxes",
    "limits": "Limits and spend",
    "resume": "Resume and the journal",
    "output": "Output, exports and the viewer",
    "scale": "Scale",
    "sampling": "Verification and sampling",
    "rewards": "Rewards and the judge",
}


def flag(default, help: str, *, group: str | None = None, first_run: bool = False, minimum: float | None = None,
         resume: bool = False, provenance: bool = False):
    """A field that is a CLI flag. `group`: its section of --help (a key of GROUPS; tests/test_help.py
    fails on a flag without one). `first_run`: shown first, as what a first run needs.
    `resume`: a changed value refuses --resume without --force. `provenance`: exported with every
    row. `minimum`: the smallest value accepted."""
    return field(default=default, metadata={"help": help, "group": group, "first_run": first_run, "minimum": minimum,
                                            "resume": resume, "provenance": provenance})


@dataclass(frozen=True)
class RunOptions:
    dataset_file: str | None = flag(None, 'JSONL file, one object per line with a string "prompt" (optional "image"/"docker_image", "cwd", "verify").', group="run", first_run=True)
    run_name: str | None = flag(None, "Name of the run; output goes to <output_dir>/<run_name>/.", group="run", first_run=True)
    batch_size: int = flag(10, "Consecutive prompts per batch_<N>.jsonl file.", minimum=1, group="output")
    model: str = flag("anthropic/claude-sonnet-4.6", 'Model name sent to the endpoint; "local" serves a small packaged model on 127.0.0.1 (needs .[local]).', resume=True, group="endpoint", first_run=True)
    base_url: str = flag(DEFAULT_BASE_URL, "OpenAI-compatible endpoint (default OpenRouter).", resume=True, provenance=True, group="endpoint", first_run=True)
    api_key: str | None = flag(None, "API key (default env OPENROUTER_API_KEY, else OPENAI_API_KEY; any dummy for local servers). Visible to every user in ps: prefer the variable.", group="endpoint", first_run=True)
    num_workers: int | str = flag(4, "Worker processes; with --executor=ray, auto: one per --worker_cpus of the cluster's CPUs, following nodes that join and leave.", minimum=1, group="scale")
    concurrency: int = flag(32, "Conversations in flight across all workers.", minimum=1, group="scale")
    executor: str = flag("processes", "Where the workers run: processes (this machine) or ray (Ray actors; see --ray_address).", group="scale")
    ray_address: str | None = flag(None, "With --executor=ray: unset starts a private local Ray instance; auto or host:port joins a running cluster.", group="scale")
    worker_cpus: float = flag(1.0, "With --executor=ray: CPUs each worker reserves (so, how many workers fit on a node).", group="scale")
    worker_memory: float | None = flag(None, "With --executor=ray: MB of memory each worker reserves (default: none).", group="scale")
    distribution: str = flag("default", "Toolset distribution sampled per prompt: a name (see --list_distributions) or a JSON file of {toolset: percent chance}.", resume=True, provenance=True, group="tools")
    toolsets: ListFlag = flag(None, "Offer exactly these toolsets (comma list, MCP servers' included) to every prompt instead of sampling --distribution.", resume=True, provenance=True, group="tools")
    mcp_config: str | None = flag(None, 'MCP servers as toolsets named after their keys: a JSON file {"mcpServers": {name: {"command", "args", "env"} or {"url", "headers"}}} (see docs/mcp.md).', resume=True, provenance=True, group="tools")
    tool_timeout: float = flag(60.0, "Seconds an MCP tool call may take (its server's start included); past it the call fails and the server restarts at the next call.", minimum=0.001, group="tools")
    max_turns: int = flag(10, "API calls with tools per prompt before one last call asks for a final answer.", minimum=1, resume=True, provenance=True, group="limits")
    resume: bool = flag(False, "Continue an existing run: run only prompts without a final record.", group="resume")
    overwrite: bool = flag(False, "Delete an existing run directory of that name and start again.", group="resume")
    force: bool = flag(False, "With --resume, accept a changed model, distribution or sampling settings.", group="resume")
    list_distributions: bool = flag(False, "Print the toolset distributions and exit.", group="tools")
    list_tools: bool = flag(False, "Print every toolset's tools and whether each can run here (under --terminal_backend; why not and what to do), and exit.", group="tools")
    export: str | None = flag(None, "Export a finished run (--run_name) for a trainer, and exit: hf (TRL, axolotl), sharegpt (LLaMA-Factory), openai (OpenAI fine-tuning), hermes (the seed's Hermes text), parquet (hf records), or with token ids skyrl, atropos, verifiers (prime-rl); see docs/exports.md and docs/rl.md.", group="output")
    export_partial: bool = flag(False, "With --export: include partial rows (ended by the forced final-answer call), left out by default.", group="output")
    export_outcome: ListFlag = flag(None, "With --export: only rows whose verify status is one of these (comma list of passed, failed, error, timeout, unverified).", group="output")
    view: bool = flag(False, "Serve a browser viewer of a run (--run_name) on 127.0.0.1 until Ctrl-C.", group="output")
    report: bool = flag(False, "Write a self-contained report.html of a run (--run_name) into its directory, and exit.", group="output")
    compare: ListFlag = flag(None, "Compare finished runs prompt by prompt (comma list of run directories, or the directory of a --models run; see docs/compare.md), write comparison.json and comparison.html, and exit; with --view, serve the comparison.", group="output")
    compare_out: str | None = flag(None, "With --compare: where comparison.json and comparison.html go (default: the current directory).", group="output")
    models: ListFlag = flag(None, "Run the dataset against each of these models (comma list), one run directory each under <output_dir>/<run_name>/, then compare them.", group="endpoint")
    compress: bool = flag(False, "Compress a finished run (--run_name) into <output_dir>/<run_name>_compressed/, and exit: each row over --compress_tokens has the fewest middle turns replaced by one summary by --summary_model (see docs/compress.md).", group="output")
    compress_tokens: int = flag(15250, "With --compress: the tokens each row is brought to (at least 512).", group="output")
    view_port: int = flag(8765, "Port of --view on 127.0.0.1 (0: any free port).", minimum=0, group="output")
    dry_run: bool = flag(False, "Validate everything, send one tiny request, print the plan and a cost estimate; run nothing.", group="run", first_run=True)
    max_cost: float | None = flag(None, "Stop once this invocation has spent this many dollars (the cost the endpoint reports, else --price_per_mtok); refused before any prompt when the endpoint reports no cost.", minimum=0, group="limits")
    max_total_tokens: int | None = flag(None, "Stop once this invocation has used this many tokens; refused before any prompt when the endpoint reports no token counts.", minimum=1, group="limits")
    price_per_mtok: ListFlag = flag(None, "Dollars per million input,output tokens (e.g. 0.15,0.60; one number for both): the cost of every reply whose endpoint reports none (vLLM, OpenAI), so that --max_cost applies.", group="limits")
    cache_dir: str | None = flag(None, "Cache of replies shared between runs (off by default): a request sent before, byte for byte (same model, sampling settings, system prompt, tools, history), gets its reply again without a call.", group="resume")
    cache_max_mb: float = flag(1024.0, "Size bound of --cache_dir in MB; the least recently used replies are deleted at the end of each run.", minimum=1, group="resume")
    token_ids: bool = flag(False, "Keep in every gpt turn the token ids and logprobs the server sampled (vLLM, SGLang, llama.cpp's llama-server, --model=local; see docs/token_ids.md); an endpoint that sends none is refused before any prompt.", resume=True, group="output")
    tokenizer: str | None = flag(None, "Hugging Face tokenizer (a local path or the local cache; nothing is downloaded). Its chat template retokenizes each request and reply: the ids of an endpoint that sends none, marked retokenized, or beside the server's to count the drift (docs/token_ids.md). It also counts tokens exactly for --compress and --context_budget (without it: 4 characters a token).", resume=True, group="output")
    verbose: bool = flag(False, "Print worker logs (tracebacks of failed prompts).", group="output")
    output_dir: str = flag("data", "Parent directory of run directories.", group="run")
    max_samples: int | None = flag(None, "Run only the first N valid prompts.", minimum=1, group="run")
    skip_invalid: bool = flag(False, "Run without the dataset's bad lines (they are counted) instead of refusing.", group="run")
    temperature: float | None = flag(None, "Sampling temperature.", resume=True, provenance=True, group="sampling")
    top_p: float | None = flag(None, "Nucleus sampling.", resume=True, provenance=True, group="sampling")
    max_tokens: int | None = flag(None, "Max tokens per completion.", minimum=1, resume=True, provenance=True, group="sampling")
    seed: int = flag(0, "Seed of the per-prompt toolset sampling.", resume=True, provenance=True, group="sampling")
    context_budget: int | None = flag(None, "Tokens a request may hold: before one would exceed it, the middle of the conversation is replaced by one summary by --summary_model, and the row records it (see docs/compress.md).", minimum=512, resume=True, provenance=True, group="limits")
    max_retries: int = flag(10, "Retries per API call (429, 5xx, timeouts, connection errors; Retry-After is honoured).", minimum=0, group="limits")
    retry_budget: float = flag(300.0, "Seconds an API call may spend retrying before it fails its prompt.", minimum=0, group="limits")
    request_timeout: float = flag(1800.0, "Seconds an API request may take in all, a long generation that keeps streaming included.", minimum=0.001, group="limits")
    stream: bool = flag(True, "Stream chat replies (server-sent events); --stream=False for an endpoint that cannot stream.", group="endpoint")
    stall_timeout: float = flag(120.0, "With --stream: seconds without a byte (a chunk or a keep-alive comment) after which the call is abandoned and retried.", minimum=0.001, group="limits")
    max_reply_mb: float = flag(32.0, "A reply larger than this many MB fails its prompt; no more than this is ever held.", minimum=0.001, group="limits")
    prompt_timeout: float | None = flag(None, "Wall-clock seconds per prompt; past it the prompt fails (resume retries it).", minimum=1, group="limits")
    require_reasoning: bool = flag(True, "Keep only rows in which an assistant turn has reasoning in trajectories.jsonl (the rest stay in the batch files).", group="sampling")
    samples_per_prompt: int = flag(1, "Independent rollouts of each prompt, each its own sample (raising it on --resume runs only the new samples).", minimum=1, group="sampling")
    toolsets_per_sample: bool = flag(False, "Sample the toolsets for every sample instead of once per prompt (a group then differs in its tools).", resume=True, provenance=True, group="sampling")
    verify_timeout: float = flag(300.0, "Seconds a row's verify command may run in its sandbox; past it the check is a timeout.", minimum=1, group="sampling")
    require_verified: bool = flag(False, "Keep only rows whose verify command passed in trajectories.jsonl (the rest stay in the batch files).", group="sampling")
    keep_hallucinated: bool = flag(False, "Keep rows that call a tool that was not offered in trajectories.jsonl.", group="sampling")
    require_toolsets: bool = flag(False, "Refuse to run when a sampled toolset or tool is unavailable here.", group="tools")
    providers_allowed: ListFlag = flag(None, "OpenRouter: only these providers (comma list).", group="endpoint")
    providers_ignored: ListFlag = flag(None, "OpenRouter: never these providers (comma list).", group="endpoint")
    providers_order: ListFlag = flag(None, "OpenRouter: try providers in this order (comma list).", group="endpoint")
    provider_sort: str | None = flag(None, "OpenRouter: sort providers by price, throughput or latency.", group="endpoint")
    reasoning_effort: str | None = flag(None, "none, minimal, low, medium, high or xhigh.", group="endpoint")
    reasoning_disabled: bool = flag(False, "OpenRouter: ask for no reasoning.", group="endpoint")
    user_model: str | None = flag(None, "A simulated user (this model) answers each final answer of the agent, for rows with a \"user\" field (persona, goal, instructions), until it says ###STOP### or --max_user_turns; see docs/simulated-user.md.", resume=True, provenance=True, group="run")
    user_base_url: str | None = flag(None, "OpenAI-compatible endpoint of --user_model (default: --base_url).", group="run")
    user_api_key: str | None = flag(None, "Key for --user_base_url (default: the run's key, sent only when it is the run's own endpoint).", group="run")
    max_user_turns: int = flag(5, "With --user_model: simulated human turns per episode at most.", minimum=1, group="run")
    user_for_all: bool = flag(False, "With --user_model: rows without a \"user\" field get a simulated user too (its goal: the prompt).", group="run")
    ephemeral_system_prompt: str = flag("", "Appended to the system prompt at run time, never written to trajectories.", group="run")
    prefill_messages_file: str | None = flag(None, "JSON list of {role, content} messages sent before the prompt, not written.", group="run")
    summary_model: str | None = flag(None, "Model that writes the summaries of --compress and --context_budget (default: the run's --model).", group="endpoint")
    summary_base_url: str | None = flag(None, "OpenAI-compatible endpoint of --summary_model (default: the run's --base_url).", group="endpoint")
    summary_api_key: str | None = flag(None, "Key for the summary endpoint (default: the run's key, sent only when the summary endpoint is the run's own).", group="endpoint")
    vision_model: str | None = flag(None, "Model for vision_analyze (default: --model).", group="tools")
    vision_base_url: str | None = flag(None, "OpenAI-compatible endpoint for vision_analyze (default: --base_url).", group="tools")
    vision_api_key: str | None = flag(None, "Key for the vision endpoint (default: the run's key, sent only when the vision endpoint is the run's own).", group="tools")
    image_model: str | None = flag(None, "image_generate through the endpoint's OpenAI images API with this model (default: FAL when FAL_KEY is set).", group="tools")
    browser_executable: str | None = flag(None, "Chromium binary for the browser tools (default: $CHROMIUM_PATH, else chromium on PATH).", group="tools")
    allow_private_urls: bool = flag(False, "Let web_extract and the browser reach loopback, private and link-local addresses.", group="tools")
    terminal_backend: str | None = flag(None, "Sandbox backend: local (bubblewrap), docker, apptainer (alias singularity) or modal (default env TERMINAL_ENV, else local).", group="tools")
    command_timeout: float = flag(180.0, "Default seconds per terminal command; the command's whole process tree is killed then.", minimum=1, group="tools")
    docker_image: str = flag("python:3.11-slim", "Image for prompts that name none (container backends: docker, apptainer, modal).", group="tools")
    sandbox_network: bool = flag(False, "Give sandboxes network access (off by default).", group="tools")
    keep_sandboxes: bool = flag(False, "Keep per-prompt sandboxes after the run, for debugging.", group="tools")
    unsafe_local: bool = flag(False, "Where bubblewrap cannot run, use plain per-prompt directories (weaker isolation).", group="tools")
    sandbox_memory: int = flag(4096, "MB of memory per sandbox, its /tmp and work dir included (a cgroup; per process where none), and of each worker's browser (a cgroup, as root).", minimum=16, group="tools")
    sandbox_disk: int = flag(1024, "MB of /tmp and of the work dir per sandbox (each a sized tmpfs).", minimum=1, group="tools")
    docker_root: bool = flag(False, "Run docker sandbox commands as root (for images that need it) instead of a uid of their own per prompt.", group="tools")
    apptainer_cache_dir: str | None = flag(None, "Where the apptainer backend builds each image into a SIF file, once (default ~/.cache/trajgen/sif).", group="tools")
    modal_app: str = flag("trajgen", "Modal app the modal backend's sandboxes run under (created if missing).", group="tools")
    judge_model: str | None = flag(None, "Score every sample with this model as a judge, against --rubric (or a dataset row's rubric field); see docs/rewards.md.", resume=True, group="rewards")
    judge_base_url: str | None = flag(None, "OpenAI-compatible endpoint of the judge (default: --base_url).", group="rewards")
    judge_api_key: str | None = flag(None, "Key for the judge's endpoint (default: the run's key).", group="rewards")
    rubric: str | None = flag(None, "What the judge scores against: the text, or @FILE for a file's; a dataset row's rubric field overrides it.", resume=True, group="rewards")
    judge_mode: str = flag("sample", "sample: the judge scores each sample after its check; group: all the samples of a prompt at once, compared, once they have all finished (ART's RULER).", group="rewards")
    reward_from: str = flag("verify", "Which signal is a row's reward: verify (the check's; the judge's where a row has no check), judge, min or mean (of both; null unless both exist).", group="rewards")
    rescore: bool = flag(False, "Score every row of a finished run (--run_name) again with the judge and rubric flags, sending no rollout request, and exit; resumable.", group="rewards")
    modal_timeout: int = flag(3600, "Seconds a modal sandbox may live; Modal ends it then, whatever its prompt is doing.", minimum=1, group="tools")

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
            stream=self.stream, stall_timeout=float(self.stall_timeout), max_reply_bytes=int(self.max_reply_mb * (1 << 20)),
            price_per_mtok=self.prices(), reasoning_effort=effort, system_prompt=DEFAULT_SYSTEM_PROMPT,
            ephemeral_system_prompt=self.ephemeral_system_prompt, prefill_messages=prefill, tokenizer=self.tokenizer,
            context_budget=self.context_budget)

    def prices(self) -> tuple[float, float] | None:
        """--price_per_mtok as (input, output) dollars per million tokens: one number prices both."""
        parts = as_list(self.price_per_mtok)
        try:
            prices = [float(p) for p in parts]
        except ValueError:
            prices = []
        if parts and not (len(prices) in (1, 2) and all(0 <= p < float("inf") for p in prices)):
            raise UsageError(f"--price_per_mtok must be dollars per million input,output tokens (e.g. 0.15,0.60) or "
                             f"one number for both, got {self.price_per_mtok!r}")
        return (prices[0], prices[-1]) if prices else None

    def simulated_user(self, run: ModelSettings) -> SimulatedUser | None:
        if not self.user_model:
            return None
        settings = roles.settings_for(run, self.user_model, self.user_base_url, self.user_api_key)
        return SimulatedUser(settings=settings, max_turns=self.max_user_turns, for_all=self.user_for_all)

    def judge_config(self, run: ModelSettings) -> JudgeConfig:
        """The judge's settings from its flags, on the run's client settings (`run`), asked for its JSON format."""
        from trajgen import judge  # the judge's modules only for these flags
        settings = roles.settings_for(run, self.judge_model, self.judge_base_url, self.judge_api_key)
        response_format = judge.GROUP_FORMAT if self.judge_mode == "group" else judge.RESPONSE_FORMAT
        return JudgeConfig(dataclasses.replace(settings, extra_body={"response_format": response_format}),
                           judge.load_rubric(self.rubric), self.reward_from, self.judge_mode)

    def tool_settings(self, api_key: str) -> ToolSettings:
        return ToolSettings(
            base_url=self.base_url, api_key=api_key, model=self.model,
            vision_model=self.vision_model or "", vision_base_url=self.vision_base_url or "",
            vision_api_key=self.vision_api_key or "", image_model=self.image_model or "",
            browser_executable=self.browser_executable or "", allow_private_urls=self.allow_private_urls,
            tool_timeout=self.tool_timeout, browser_memory_mb=self.sandbox_memory, run_id=self.run_id)

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
            root_dir=new_root_dir(), run_dir=str(Path(self.output_dir, self.run_name).absolute()), label=uuid.uuid4().hex[:12], run_id=self.run_id, memory_mb=self.sandbox_memory,
            disk_mb=self.sandbox_disk, docker_root=self.docker_root, sif_cache=self.apptainer_cache_dir or "",
            modal_app=self.modal_app, modal_timeout=self.modal_timeout, slots=self.concurrency)

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
        before = {k: manifest.get(k, DEFAULTS.get(k)) for k in now}  # a setting newer than the manifest: its default
        return [f"{k}: {before[k]!r} -> {v!r}" for k, v in now.items() if before[k] != v]


FIELDS: tuple[dataclasses.Field, ...] = dataclasses.fields(RunOptions)
TYPES: dict[str, object] = typing.get_type_hints(RunOptions)
DEFAULTS: dict[str, object] = {f.name: f.default for f in FIELDS}
PROVENANCE_SETTINGS: tuple[str, ...] = tuple(f.name for f in FIELDS if f.metadata["provenance"])


def as_list(value) -> list[str]:
    """A list flag given as `a,b`, as a tuple, or as a list."""
    if value is None or value is False:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    return [part.strip() for item in items for part in str(item).split(",") if part.strip()]


def check_judge(opts: RunOptions) -> None:
    """The judge's and the reward's flags, on their own (the rubric file is read here)."""
    from trajgen import judge, rewards  # the judge's modules only for these flags
    if opts.reward_from not in rewards.REWARD_FROM:
        raise UsageError(f"--reward_from must be one of {', '.join(rewards.REWARD_FROM)}, got {opts.reward_from!r}")
    if opts.judge_mode not in ("sample", "group"):
        raise UsageError(f"--judge_mode must be sample or group, got {opts.judge_mode!r}")
    if not opts.judge_model:
        for name in ("judge_base_url", "judge_api_key", "rubric"):
            if getattr(opts, name):
                raise UsageError(f"--{name} goes with --judge_model (the judge's model); pass it too")
        if opts.reward_from != "verify" or opts.judge_mode != "sample":
            raise UsageError(f"--reward_from={opts.reward_from} --judge_mode={opts.judge_mode} need a judge: "
                             "pass --judge_model and --rubric")
    check_urls(opts, ("judge_base_url",))
    judge.load_rubric(opts.rubric)


def run_api_key(opts: RunOptions) -> str:
    """The run's key: the flag, else the environment; a local server takes any key."""
    api_key = opts.api_key or os.environ.get("OPENROUTER_API_KEY") or os.environ.get("OPENAI_API_KEY")
    if api_key:
        return api_key
    if opts.base_url == DEFAULT_BASE_URL:
        raise UsageError("no API key: set OPENROUTER_API_KEY (or OPENAI_API_KEY) or pass --api_key")
    return "none"  # local servers take any key


def check_urls(opts: RunOptions, names: tuple[str, ...]) -> None:
    for name in names:
        url = getattr(opts, name)
        if url is not None and (urllib.parse.urlsplit(url).scheme not in ("http", "https")
                                or not urllib.parse.urlsplit(url).hostname):
            raise UsageError(f"--{name} must be an http:// or https:// URL, got {url!r}")


def check(opts: RunOptions) -> None:
    """Every check of the flags on their own, before a file is read or a request sent."""
    check_judge(opts)
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
    check_urls(opts, ("base_url", "vision_base_url", "user_base_url", "summary_base_url"))
    if opts.compare_out:
        raise UsageError("--compare_out goes with --compare (--models writes its comparison into <output_dir>/<run_name>/)")
    if opts.export_outcome and not opts.export:
        raise UsageError("--export_outcome selects rows for --export; pass --export too")
    if opts.export_partial and not opts.export:
        raise UsageError("--export_partial selects rows for --export; pass --export too")
    for name in ("user_base_url", "user_api_key", "user_for_all"):
        if getattr(opts, name) and not opts.user_model:
            raise UsageError(f"--{name} goes with --user_model (the simulated user's model); pass --user_model too")
    if opts.backend not in BACKENDS:
        raise UsageError(f"--terminal_backend must be one of {', '.join(BACKENDS)}, got {opts.backend!r}")
    if opts.provider_sort not in (None, "price", "throughput", "latency"):
        raise UsageError("--provider_sort must be price, throughput or latency")
    opts.prices()
    if opts.reasoning_effort not in (None, *REASONING_EFFORTS):
        raise UsageError(f"--reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}")
    if opts.executor != "processes":  # Ray is imported only when asked for: its import costs every worker CPU and memory
        from trajgen.ray_executor import check_executor
        check_executor(opts.executor, opts.ray_address, opts.worker_cpus, opts.worker_memory)
    if not os.path.isfile(opts.dataset_file):
        raise UsageError(f"--dataset_file {opts.dataset_file}: no such file")
    if opts.tokenizer:  # loaded here, so that one that cannot be stops the run before any request
        from trajgen import tokenizer
        if tokenizer.load(opts.tokenizer).chat_template_sha256 is None:
            raise UsageError(f"--tokenizer={opts.tokenizer} cannot be used for a run: it has no chat template to "
                             "render requests with")


def signature() -> inspect.Signature:
    """The signature `batch_runner.main` shows to Fire, --help and tests/test_readme.py."""
    return inspect.Signature([inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                                annotation=TYPES[f.name]) for f in FIELDS])


def docstring(summary: str) -> str:
    """`summary` followed by an Args section Fire turns into --help."""
    lines = [f"        {f.name}: {f.metadata['help']}" for f in FIELDS]
    return f"{summary}\n\n    Args:\n" + "\n".join(lines) + "\n"


FLAGS_DOC = Path(__file__).resolve().parent.parent / "docs" / "flags.md"


def flag_table() -> str:
    """The flag reference of docs/flags.md (`python -m trajgen.options` prints it, `--write` puts it there)."""
    shown = lambda f: f.default if f.name == "base_url" else repr(f.default)  # noqa: E731
    rows = [f"| `--{f.name}` | `{shown(f)}` | {f.metadata['help'].replace('|', '/')} |" for f in FIELDS]
    return "\n".join(["| flag | default | meaning |", "|---|---|---|", *rows])


def write_flag_table() -> None:
    """Replace the table in docs/flags.md (from its header row to the end of the table) with today's."""
    text = FLAGS_DOC.read_text()
    start = text.index("| flag | default | meaning |")
    end = text.find("\n\n", start)
    FLAGS_DOC.write_text(text[:start] + flag_table() + ("\n" if end < 0 else text[end:]))


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_flag_table()
    else:
        print(flag_table())
