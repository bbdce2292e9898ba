"""The Ray executor: workers are Ray actors, on this machine or spread over a cluster.

It has the process pool's interface (`start`, `submit`, `poll`, `cancel`, `kill`, `close`,
`inflight`) and moves the same Task, PromptOutcome and events, so the parent stays the single writer of the
run directory and files, resume and statistics are those of a process-pool run. Each actor is an
asyncio actor running `Worker.run_one` (trajgen/worker.py) for many conversations at
once, with its sandboxes on the node it landed on. As on the process pool's pipes, traffic goes in
batches: the prompts for an actor in one `submit` call per poll, everything it has to say (outcomes
included) in the reply to one long-polled `events` call, which gathers what happens within 10 ms of
its first urgent event (a reply paid for is one: it reaches the driver's journal before it can be
lost with its actor). An actor runs asyncio's own event loop, as a pool worker does (not uvloop).
The driver keeps each actor's prompts in flight, with the replies they were paid; when an actor or
its node dies, Ray restarts the actor where it can, and its prompts run again, replaying those
replies, up to `crash_retries` times, before they come back failed as WorkerCrashed.

Each actor checks its own node when it starts (bubblewrap, the tools' programs, the images its
prompts name) and reports what is missing; the driver names it once per node and sends a prompt
only to an actor whose node has everything the prompt's tools need. Under `--num_workers=auto`
the pool follows the cluster: one actor per `worker_cpus` of its CPUs, re-evaluated as it runs.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from typing import Any

from trajgen import journal, registry
from trajgen.errors import NoNodeCanServe, UsageError, WorkerCrashed
from trajgen.messages import Cancelled, Event, Fatal, Finished, Log, Replied, Rerun, Throttled, without_landed_replies
from trajgen.outcome import decide
from trajgen.plan import needs_sandbox
from trajgen.sandbox import BackendUnreachable
from trajgen.sandbox.backends import bwrap_problem, check_images, cleanup
from trajgen.task import Task, WorkerConfig
from trajgen.worker import Worker

try:
    import ray
    from ray.exceptions import RayError

    from trajgen.ray_session import ACTOR_ENV, RaySession
except ImportError:  # Ray is an optional extra
    ray = None

EXECUTORS = ("processes", "ray")
STOP_TIMEOUT = 30.0  # seconds for the actors to cancel their conversations and clean up at close
SANDBOX = "sandbox"  # what a node lacks when its local sandboxes cannot run
CALLS = 8  # an actor's concurrent calls: the `events` long-poll, `submit`s, control calls (prompts are its own tasks)
# what happens within this many seconds of an actor's first new event travels in the same `events` reply: each Ray
# call costs CPU on both ends, and a busy actor's sandboxes finish a few ms apart
EVENTS_WINDOW = 0.01
# a log line or a notice does not start an `events` reply of its own: it waits up to this long for an urgent
# event to travel with; a reply paid for (Replied, for the journal) is urgent, or it could die with its actor
NOT_URGENT_DELAY = 0.1
URGENT = (Finished, Replied, Fatal, Throttled, Cancelled)
RESIZE_SECONDS = 2.0  # under --num_workers=auto, how often the pool is matched to the cluster's CPUs


@dataclass(frozen=True)
class NodeReport:
    """What an actor found on its node: requirement (a tool's name, `sandbox`, `image NAME`) -> why it is missing."""

    node: str
    missing: dict[str, str]


def _image(name: str) -> str:
    return f"image {name}"


def needs(task: Task, config: WorkerConfig) -> set[str]:
    """What a node must have for this prompt's tools to work there."""
    wanted = {t.name for t in registry.offered_tools(task.toolsets_offered, config.unavailable_tools)}
    if needs_sandbox(task):
        wanted.add(SANDBOX if config.sandbox.backend == "local" else _image(task.image or config.sandbox.docker_image))
    return wanted


async def check_node(config: WorkerConfig, images: list[str]) -> NodeReport:
    """This node's answer to `needs`: the tools the driver offers that cannot run here, the sandbox, the images."""
    missing = {name: reason for name, reason in registry.unavailable_tools(config.tools).items()
               if name not in config.unavailable_tools}
    if config.sandbox.backend == "local":
        if not config.sandbox.unsafe_local and (problem := await asyncio.to_thread(bwrap_problem)):
            missing[SANDBOX] = f"bubblewrap cannot run here ({problem})"
    elif images:
        try:
            found = await check_images(images, config.sandbox)
        except BackendUnreachable as e:  # this node's engine: its prompts go to other nodes
            found = dict.fromkeys(images, str(e))
        missing |= {_image(i): why for i, why in found.items() if why}
    return NodeReport(f"{ray.util.get_node_ip_address()} ({ray.get_runtime_context().get_node_id()[:8]})", missing)


class _RayWorker:
    """One actor: a worker's conversations. Every event, outcomes included, waits in an outbox that the
    driver long-polls (`events`); the prompts admitted since its last answer come with the next `events`
    call (about one Ray call per prompt in all), or in a `submit` of their own while one is pending.
    `epoch` numbers the driver's view of this actor's life: a call meant for a predecessor that died (Ray
    restarts an actor in place) is refused, so no prompt runs twice or is lost."""

    def __init__(self, config: WorkerConfig, images: list[str]):
        self.config, self.images = config, images
        self.report: NodeReport | None = None
        self.epoch: int | None = None  # set by the driver's `ready`
        self.outbox: list[Event] = []
        self.news = asyncio.Event()
        self.later: asyncio.TimerHandle | None = None  # wakes `events` for what is not urgent
        self.worker = Worker(config, self._send)

    def _send(self, message: Event) -> None:
        self.outbox.append(message)
        if isinstance(message, URGENT):
            self.news.set()
        elif self.later is None:
            self.later = asyncio.get_running_loop().call_later(NOT_URGENT_DELAY, self.news.set)

    async def ready(self, epoch: int) -> NodeReport:
        """Answers once this actor (or its restarted self, perhaps on another node) is up: what its node lacks.
        A new epoch for a live actor means the driver gave its prompts up (it ran them again elsewhere)."""
        if self.epoch is not None and epoch != self.epoch:
            await self.worker.cancel_all()
            self.outbox.clear()
            self.news.set()  # ends the `events` call of the life given up
        self.epoch = epoch
        if self.report is None:
            self.report = await check_node(self.config, self.images)
        return self.report

    def _check(self, epoch: int) -> None:
        if epoch != self.epoch:
            raise WorkerCrashed("a call for an earlier life of this Ray worker (restarted, or given up by the driver)")

    async def submit(self, epoch: int, tasks: list[Task]) -> None:
        self._check(epoch)
        self._start(tasks)

    def _start(self, tasks: list[Task]) -> None:
        for task in tasks:
            self.worker.running[task.key] = asyncio.create_task(self.worker.run_one(task))

    async def events(self, epoch: int, tasks: list[Task]) -> list[Event]:
        """Start `tasks` (the prompts the driver had for this actor when it asked again), then return what
        happened since the last call, once something has; a Finished event is a prompt's outcome."""
        self._check(epoch)
        self._start(tasks)
        await self.news.wait()
        await asyncio.sleep(EVENTS_WINDOW)  # the events of the next few ms come in the same reply
        self._check(epoch)
        self.news.clear()
        if self.later:
            self.later.cancel()
            self.later = None
        messages, self.outbox = self.outbox, []
        return without_landed_replies(messages)

    async def cancel(self) -> None:
        """Cancel every conversation (their sandboxes are closed); `events` then says Cancelled."""
        await self.worker.cancel_all()
        self._send(Cancelled())

    async def stop(self) -> None:
        await self.worker.cancel_all()
        await self.worker.endpoint.close()

    async def cleanup(self) -> None:
        """Remove what this run left on this node (a crashed predecessor's work dirs and containers)."""
        await asyncio.to_thread(cleanup, self.config.sandbox)


@dataclass
class _Slot:
    """The driver's view of one actor: new prompts go to it only while it is up."""

    number: int
    actor: Any
    watch: Any = None  # the pending `ready` call while down, the pending `events` call while up (None between two)
    up: bool = False
    epoch: int = 0  # which life of the actor the driver talks to: one more at each `ready`
    inflight: dict[str, Task] = field(default_factory=dict)  # its prompts, by key, until their Finished
    report: NodeReport | None = None  # what its node lacks, from its latest `ready`


class _NodeNotes:
    """What each node lacks, said once per node."""

    def __init__(self) -> None:
        self.named: set[str] = set()  # nodes whose report has been said

    def said(self, report: NodeReport) -> list[Event]:
        if report.node in self.named or not report.missing:
            return []
        self.named.add(report.node)
        lacks = "; ".join(f"{need} ({why})" for need, why in report.missing.items())
        return [Log(f"Ray node {report.node} lacks {lacks}: prompts that need it run on other nodes")]


def _unservable(task: Task, wanted: set[str], reports: list[NodeReport], require_toolsets: bool) -> Event:
    """A prompt no node can serve: failed (resume retries it), or the run's end under --require_toolsets."""
    lacks = sorted({f"{r.node} lacks {need} ({r.missing[need]})" for r in reports for need in wanted & r.missing.keys()})
    if require_toolsets:
        return Fatal(f"--require_toolsets: no Ray node can serve prompt {task.prompt_index}: {'; '.join(lacks)}")
    return Finished(decide(task, error=NoNodeCanServe(f"no Ray node can serve it: {'; '.join(lacks)}")))


class RayPool:
    """`num_workers` Ray actors (None: as many as the cluster's CPUs hold, as it grows and shrinks);
    each holds up to its share of the run's concurrency. `images`: the container images the prompts name,
    checked on each node; `require_toolsets`: a prompt no node can serve stops the run instead of failing."""

    def __init__(self, num_workers: int | None, config: WorkerConfig, address: str | None = None,
                 worker_cpus: float = 1.0, worker_memory: float | None = None, crash_retries: int = 2,
                 images: tuple[str, ...] = (), require_toolsets: bool = False):
        self.num_workers, self.config, self.address = num_workers, config, address
        self.worker_cpus, self.worker_memory, self.crash_retries = worker_cpus, worker_memory, crash_retries
        self.images, self.require_toolsets = list(images), require_toolsets
        self.actor_class: Any = None
        self.slots: list[_Slot] = []
        self.created = 0  # actors made so far: numbers them
        self.next_resize = 0.0
        self.nodes = _NodeNotes()
        self.queue: deque[Task] = deque()  # submitted, waiting for an actor that is up and has room
        self.crashes: Counter[str] = Counter()  # per prompt key: runs lost to a dead actor
        self.session = RaySession()
        self.paid: dict[str, list[dict]] = {}  # per prompt in flight: the journal entries of its replies

    def start(self) -> None:
        try:
            self.session.connect(self.address, (self.num_workers or 0) * self.worker_cpus)
            self.actor_class = ray.remote(_RayWorker).options(
                num_cpus=self.worker_cpus, memory=int(self.worker_memory * 2**20) if self.worker_memory else None,
                max_restarts=-1, max_concurrency=CALLS,
                runtime_env={"env_vars": ACTOR_ENV} if self.address else None,
                scheduling_strategy="SPREAD",  # over the nodes: each brings its own cores for the sandboxes
            )
            self._grow(self.num_workers or self._fits())
        except BaseException:
            self.close()
            raise

    def _fits(self) -> int:
        """How many actors the cluster's CPUs hold now."""
        return max(1, int(ray.cluster_resources().get("CPU", 0) // self.worker_cpus))

    def _grow(self, count: int) -> None:
        for _ in range(count):
            self.slots.append(self._watch(_Slot(self.created, self.actor_class.remote(self.config, self.images))))
            self.created += 1

    def _resize(self) -> list[Event]:
        """Under auto: actors for the CPUs of nodes that joined; the restarting actors of nodes that left
        are dropped (their prompts run again elsewhere, as after any lost actor)."""
        if self.num_workers or time.monotonic() < self.next_resize:
            return []
        self.next_resize = time.monotonic() + RESIZE_SECONDS
        fits = self._fits()
        if fits > len(self.slots):
            self._grow(fits - len(self.slots))
            return [Log(f"the Ray cluster grew: {len(self.slots)} workers")]
        surplus = [s for s in self.slots if not s.up][:len(self.slots) - fits]
        for slot in surplus:
            ray.kill(slot.actor, no_restart=True)
            self.slots.remove(slot)
        return [Log(f"the Ray cluster shrank: {len(self.slots)} workers")] if surplus else []

    @property
    def inflight(self) -> int:
        return len(self.queue) + sum(len(s.inflight) for s in self.slots)

    def submit(self, task: Task) -> None:
        self.queue.append(task)

    def _dispatch(self) -> list[Event]:
        """Hand queued prompts to actors that are up, have room, and whose node has what the prompt needs,
        in one `submit` per actor. A prompt that no node can serve, once every actor has reported, comes back
        failed (resume retries it), or stops the run under --require_toolsets."""
        messages: list[Event] = []
        batches: dict[int, list[Task]] = {}
        everyone_reported = bool(self.slots) and all(s.up for s in self.slots)  # none left: poll says so
        for task in list(self.queue):
            wanted = needs(task, self.config)
            able = [s for s in self.slots if s.up and not wanted & s.report.missing.keys()]
            room = [s for s in able if len(s.inflight) < self.config.concurrency]
            if room:
                slot = min(room, key=lambda s: len(s.inflight))
                self.queue.remove(task)
                slot.inflight[task.key] = task
                batches.setdefault(slot.number, []).append(task)
            elif not able and everyone_reported:
                self.queue.remove(task)
                messages.append(_unservable(task, wanted, [s.report for s in self.slots], self.require_toolsets))
        for slot in self.slots:
            batch = batches.get(slot.number, [])
            if slot.up and slot.watch is None:  # its last `events` call has answered
                self._ask(slot, batch)
            elif batch:
                # no reply: if the actor died, its `events` call fails and the driver runs the prompts again
                slot.actor.submit.options(num_returns=0).remote(slot.epoch, batch)
        return messages

    def _ask(self, slot: _Slot, tasks: list[Task]) -> None:
        slot.watch = slot.actor.events.remote(slot.epoch, tasks)

    def poll(self, timeout: float) -> list[Event]:
        """Messages from the actors; prompts of a dead actor run again elsewhere or come back failed."""
        messages: list[Event] = self._resize()
        if not self.slots:
            raise WorkerCrashed("every Ray worker is gone for good; see the messages above")
        messages += self._dispatch()
        watched = {s.watch: s for s in self.slots}
        ready, _ = ray.wait(list(watched), num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(list(watched), num_returns=len(watched), timeout=0)
        for ref in ready:
            messages += self._watched(watched[ref], ref)
        return messages

    def _watched(self, slot: _Slot, ref: Any) -> list[Event]:
        try:
            messages = ray.get(ref)
        except RayError as e:
            if slot.up:
                return self._down(slot, e)
            self.slots.remove(slot)  # Ray retries `ready` across restarts: it failed, so the actor is gone for good
            return [Log(f"Ray worker {slot.number} is gone for good: {_why(e)}")]
        if not slot.up:
            slot.up, slot.report, messages = True, messages, self.nodes.said(messages)
        for message in messages:
            if isinstance(message, Finished):
                slot.inflight.pop(message.outcome.key, None)
                self.paid.pop(message.outcome.key, None)
            elif isinstance(message, Replied):
                self.paid.setdefault(message.key, []).append(journal.entry(message))
        slot.watch = None  # asked again at the next dispatch, with the prompts admitted meanwhile
        return messages

    def _down(self, slot: _Slot, error: Exception) -> list[Event]:
        """Stop sending it prompts until Ray has restarted it; its prompts run again elsewhere, each up to
        `crash_retries` times, then come back failed."""
        lost, slot.inflight = list(slot.inflight.values()), {}
        self._watch(slot)
        messages: list[Event] = [Log(f"Ray worker {slot.number} died ({type(error).__name__}); its prompts run "
                                     f"again (up to {self.crash_retries} times each) while Ray restarts it")]
        for task in reversed(lost):
            if self.crashes[task.key] < self.crash_retries:
                self.crashes[task.key] += 1
                paid = tuple(self.paid.pop(task.key, ()))  # replayed, not paid again
                self.queue.appendleft(replace(task, replay=task.replay + paid))  # first in line for an actor with room
                messages.append(Rerun(task.key))
            else:
                self.paid.pop(task.key, None)  # journaled: a resume replays them
                messages.append(Finished(decide(task, error=WorkerCrashed(f"Ray worker died: {_why(error)}"))))
        return messages

    def _watch(self, slot: _Slot) -> _Slot:
        slot.up = False
        slot.epoch += 1
        slot.watch = slot.actor.ready.options(max_task_retries=-1).remote(slot.epoch)
        return slot

    def cancel(self, timeout: float = 10.0) -> list[Event]:
        """Cancel every conversation in flight (their sandboxes are closed); results that were
        already on their way are returned so that no finished prompt is lost."""
        self.queue.clear()
        waiting = [s for s in self.slots if s.up]
        for slot in waiting:
            slot.actor.cancel.options(num_returns=0).remote()  # answered through `events`
        arrived: list[Event] = []
        deadline = time.monotonic() + timeout
        while waiting and (left := deadline - time.monotonic()) > 0:
            for slot in waiting:
                if slot.watch is None:
                    self._ask(slot, [])
            ready, _ = ray.wait([s.watch for s in waiting], num_returns=1, timeout=left)
            for slot in [s for s in waiting if s.watch in ready]:
                slot.inflight.clear()  # what has not arrived by its Cancelled is not recorded: resume runs it
                messages = self._watched(slot, slot.watch)
                arrived += [m for m in messages if not isinstance(m, Cancelled)]
                if not slot.up or any(isinstance(m, Cancelled) for m in messages):
                    waiting.remove(slot)
        for slot in self.slots:
            slot.inflight.clear()
        self.paid.clear()
        return arrived

    def kill(self) -> None:
        """Leave at once: the actors die, and with them (die-with-parent) their sandboxes' processes."""
        try:
            if ray.is_initialized():
                for slot in self.slots:
                    ray.kill(slot.actor, no_restart=True)
        finally:
            self.session.disconnect()

    def close(self) -> None:
        """Stop the actors, let each clean its node, and disconnect (stopping Ray if we started it)."""
        try:
            if ray.is_initialized():
                up = [s.actor for s in self.slots if s.up]  # one that is restarting may never answer
                _wait_all([actor.stop.remote() for actor in up], STOP_TIMEOUT)
                _wait_all([actor.cleanup.remote() for actor in up], STOP_TIMEOUT)
                for slot in self.slots:
                    ray.kill(slot.actor, no_restart=True)
        finally:
            self.session.disconnect()


def _wait_all(refs: list, timeout: float) -> list:
    """The refs that are done within `timeout`."""
    return ray.wait(refs, num_returns=len(refs), timeout=timeout)[0] if refs else []


def _why(error: Exception) -> str:
    """A Ray error in one line: its first line, and its last (the cause) when they differ."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def check_executor(executor: str, ray_address: str | None, worker_cpus: float, worker_memory: float | None) -> None:
    """The executor flags, checked before anything is written."""
    if executor not in EXECUTORS:
        raise UsageError(f"--executor must be processes or ray, got {executor!r}")
    if executor == "processes":
        return
    if ray is None:
        raise UsageError("--executor=ray needs Ray: pip install -e '.[ray]'")
    if ray_address is not None and (not isinstance(ray_address, str) or not ray_address.strip()):
        raise UsageError(f"--ray_address must be auto or a cluster address (host:port), got {ray_address!r}")
    if not _positive(worker_cpus):
        raise UsageError(f"--worker_cpus must be a number > 0, got {worker_cpus!r}")
    if worker_memory is not None and not _positive(worker_memory):
        raise UsageError(f"--worker_memory must be a number of MB > 0, got {worker_memory!r}")


def _positive(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0


def make_executor(executor: str, num_workers: int | None, config: WorkerConfig, ray_address: str | None = None,
                  worker_cpus: float = 1.0, worker_memory: float | None = None, images: tuple[str, ...] = (),
                  require_toolsets: bool = False) -> RayPool:
    """Ray actors for the parent to drive (a private local instance, or a cluster); num_workers None is auto."""
    check_executor(executor, ray_address, worker_cpus, worker_memory)
    return RayPool(num_workers, config, ray_address, float(worker_cpus), worker_memory, images=images,
                   require_toolsets=require_toolsets)
