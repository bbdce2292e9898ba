"""What the parent hands the workers: the settings once (`WorkerConfig`), then one `Task` per prompt.

Any executor (the process pool, the Ray actors) moves only these, the messages of
trajgen/messages.py and the `PromptOutcome`s of trajgen/outcome.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from trajgen.sandbox.backends import SandboxConfig
from trajgen.token_ids import Dialect
from trajgen.tools import ToolSettings, ToolSpec


@dataclass(frozen=True)
class ModelSettings:
    model: str
    base_url: str
    api_key: str
    max_turns: int = 10
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_retries: int = 10
    retry_budget: float = 300.0  # seconds one request may spend retrying
    request_timeout: float = 1800.0  # the whole request, a long generation that keeps streaming included
    stream: bool = True  # chat calls as server-sent events
    stall_timeout: float = 120.0  # seconds without a byte after which a streamed call is asked again
    max_reply_bytes: int = 32 << 20
    price_per_mtok: tuple[float, float] | None = None  # $ per million input, output tokens, for replies without a cost
    prompt_timeout: float | None = None
    extra_body: dict = field(default_factory=dict)  # provider routing and reasoning controls
    reasoning_effort: str | None = None  # the standard parameter, for endpoints other than OpenRouter
    system_prompt: str = ""
    ephemeral_system_prompt: str = ""  # sent, never written into trajectories
    prefill_messages: list = field(default_factory=list)  # sent before the prompt, not written
    token_ids: Dialect | None = None  # --token_ids: how the server is asked for them, as the probe found it
    tokenizer: str | None = None  # --tokenizer: retokenize each request and reply with it (trajgen/tokenizer.py)
    context_budget: int | None = None  # --context_budget: tokens a request may hold (trajgen/context_budget.py)


@dataclass(frozen=True)
class SimulatedUser:
    """--user_model: the simulated user that answers each final answer of the agent (trajgen/simulated_user.py)."""

    settings: ModelSettings  # its model and endpoint (trajgen/roles.py)
    max_turns: int = 5  # simulated human turns per episode (--max_user_turns)
    for_all: bool = False  # rows without a `user` field get one too (--user_for_all)


@dataclass(frozen=True)
class JudgeConfig:
    """The judge of every sample (trajgen/judge.py): its model's settings (the JSON-schema response
    format in their extra body), the run's rubric (a row's own overrides it) and which signal is the reward."""

    settings: ModelSettings
    rubric: str
    reward_from: str = "verify"
    mode: str = "sample"  # or "group": every sample of a prompt at once, after they all finished


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    model: ModelSettings
    sandbox: SandboxConfig
    tools: ToolSettings
    unavailable_tools: dict[str, str]  # decided once by the parent, so every worker offers the same
    concurrency: int  # conversations this worker may hold at once
    verbose: bool = False
    cache_dir: str | None = None  # the cross-run cache of replies (trajgen/journal.py), off when None
    verify_timeout: float = 300.0  # seconds a row's verify command may run (trajgen/verify.py)
    cache_max_mb: float = 1024.0  # a reply larger than the whole cache is not stored
    mcp_tools: tuple[ToolSpec, ...] = ()  # the MCP servers' tools, as the probe read them (trajgen/tools/mcp.py)
    user: SimulatedUser | None = None  # the simulated user, when --user_model is set
    judge: JudgeConfig | None = None  # each sample judged after its check (--judge_mode=sample)
    reward_from: str = "verify"  # which signal is a row's `reward` (trajgen/rewards.py)
    summary: ModelSettings | None = None  # --context_budget's summary model (trajgen/roles.py)


@dataclass(frozen=True, kw_only=True)
class Task:
    key: str  # the sample's identity: the prompt's key for sample 0, `<prompt key>~<i>` for sample i
    prompt_index: int
    batch_num: int
    prompt: str
    image: str | None
    cwd: str | None
    extra: dict
    toolsets_sampled: list[str]
    toolsets_offered: list[str]
    dataset_fingerprint: str = ""  # of the whole dataset file (manifest.json), so a row names its source
    replay: tuple[dict, ...] = ()  # on --resume, this prompt's journaled replies (trajgen/journal.py)
    verify: str | None = None  # the row's check, run in its sandbox when the conversation ends
    sample_index: int = 0  # which of --samples_per_prompt rollouts of the prompt this is
    group_id: str = ""  # the prompt's key, shared by its samples (empty: the task's own key)
    user: dict | None = None  # the row's simulated user: persona, goal, instructions (trajgen/dataset.py)
