"""The scheduler, the store and the merge in process, over an executor that answers at once."""
from __future__ import annotations

import json
import signal
from typing import Callable

from trajgen import merge, resume_scan, scheduler, store
from trajgen.errors import EndpointUnreachable, FatalAPIError, WorkerCrashed
from trajgen.messages import Event, Fatal, Finished, Replied, Rerun, Retrying
from trajgen.model import Reply
from trajgen.outcome import decide
from trajgen.plan import Plan
from trajgen.task import Task


def task(i: int, batch_size: int = 2) -> Task:
    return Task(key=f"k{i}", prompt_index=i, batch_num=i // batch_size, prompt=f"prompt {i}", image=None, cwd=None,
                extra={}, toolsets_sampled=[], toolsets_offered=[])


def row(t: Task, reasoning: int = 1, cost: float = 0.0) -> dict:
    return {"prompt_index": t.prompt_index, "conversations": [], "api_calls": 1, "tool_stats": {},
            "metadata": {"prompt_key": t.key, "turns_with_reasoning": reasoning, "assistant_turns": 1,
                         "hallucinated_tools": [],
                         "usage": {"prompt_tokens": 10, "completion_tokens": 5, "reasoning_tokens": 0, "cost": cost}}}


class AnsweringExecutor:
    """Answers each prompt on the next poll with `answer(task)`; `hold` keeps prompts in flight."""

    def __init__(self, answer: Callable[[Task], list[Event]], hold: Callable[[Task], bool] = lambda t: False):
        self.answer, self.hold = answer, hold
        self.pending: list[Task] = []
        self.submitted: list[str] = []
        self.cancelled: list[str] = []

    @property
    def inflight(self) -> int:
        return len(self.pending)

    def start(self) -> None: ...
    def kill(self) -> None: ...
    def close(self) -> None: ...

    def submit(self, t: Task) -> None:
        self.pending.append(t)
        self.submitted.append(t.key)

    def poll(self, timeout: float) -> list[Event]:
        ready = [t for t in self.pending if not self.hold(t)]
        self.pending = [t for t in self.pending if self.hold(t)]
        return [event for t in ready for event in self.answer(t)]

    def cancel(self) -> list[Event]:
        self.cancelled, self.pending = [t.key for t in self.pending], []
        return []


def run(tmp_path, count: int, executor: AnsweringExecutor, **limits) -> scheduler.RunEnd:
    limits = scheduler.Limits(run_name="run", batch_size=2, concurrency=limits.pop("concurrency", 4), **limits)
    plan = Plan(remaining=count)
    return scheduler.Scheduler(plan, executor, limits, tmp_path, {}, 0.0, 0.0).execute(
        iter([task(i) for i in range(count)]), on_exit=lambda: None)


def test_each_outcome_goes_to_its_file_and_the_merge_counts_them(tmp_path):
    def answer(t: Task) -> list[Event]:
        if t.prompt_index == 1:
            return [Finished(decide(t, row={**row(t), "truncated": True}))]
        if t.prompt_index == 3:  # a row: --require_reasoning acts at the merge
            return [Finished(decide(t, row=row(t, reasoning=0)))]
        if t.prompt_index == 2:
            try:
                raise ValueError("bad")
            except ValueError as e:
                return [Finished(decide(t, error=e))]
        return [Finished(decide(t, row=row(t)))]

    end = run(tmp_path, 5, AnsweringExecutor(answer))
    assert (end.failed, end.not_run, end.fatal, end.budget) == (1, 0, None, None)
    assert [n for n, _ in store.batch_files(tmp_path)] == [0, 1, 2]
    failure = json.loads((tmp_path / store.FAILURES).read_text())
    assert failure["error_class"] == "InternalError" and 'raise ValueError("bad")' in failure["traceback"]
    checkpoint = store.read_json(tmp_path / "checkpoint.json")
    assert checkpoint["next_batch"] == 3 and checkpoint["batches_open"] == []
    assert checkpoint["batch_files"] == [0, 1, 2]  # all fsynced before the final checkpoint: resume reads their keys only
    assert checkpoint["counts_this_invocation"] == {"ok": 3, "discarded": 1, "failed": 1}
    stats = merge.statistics(merge.merge(tmp_path, merge.Filtering(require_reasoning=True)), {})
    assert (stats["kept"], stats["filtered_no_reasoning"]) == (2, 1)
    assert (stats["discarded"]["by_reason"], stats["failed"]["by_class"]) == ({"truncated": 1}, {"InternalError": 1})
    assert resume_scan.scan(tmp_path).done == {"k0", "k1", "k3", "k4"}  # the failed prompt runs again on resume


def test_a_failed_health_check_stops_admitting_and_fails_what_is_in_flight(tmp_path):
    executor = AnsweringExecutor(lambda t: [Finished(decide(t, row=row(t)))], hold=lambda t: t.prompt_index >= 2)
    end = run(tmp_path, 8, executor, concurrency=2,
              health_check=lambda: "the local model server died" if len(executor.submitted) >= 4 else None)
    assert end.fatal == "the local model server died" and (end.failed, end.not_run) == (2, 4)
    assert executor.cancelled == ["k2", "k3"] and executor.submitted == ["k0", "k1", "k2", "k3"]
    failures = [json.loads(line) for line in (tmp_path / "failures.jsonl").read_text().splitlines()]
    assert [(f["prompt_key"], f["error_class"]) for f in failures] == [("k2", "RunStopped"), ("k3", "RunStopped")]
    assert resume_scan.scan(tmp_path).done == {"k0", "k1"}  # the failed prompts run again on resume


def test_a_fatal_endpoint_error_stops_the_run(tmp_path):
    def answer(t: Task) -> list[Event]:
        refused = decide(t, error=FatalAPIError("authentication failed (HTTP 401)"))
        return [Fatal(refused.message), Finished(refused)]

    end = run(tmp_path, 6, AnsweringExecutor(answer), concurrency=1)
    assert end.fatal == "authentication failed (HTTP 401)" and end.failed == 1 and end.not_run == 5


def test_an_endpoint_out_of_reach_stops_the_run_with_nothing_recorded_failed(tmp_path):
    def answer(t: Task) -> list[Event]:
        refused = decide(t, error=EndpointUnreachable("connection refused"))
        return [Fatal(refused.message, unreachable=True), Finished(refused)]

    executor = AnsweringExecutor(answer, hold=lambda t: t.prompt_index > 0)
    end = run(tmp_path, 6, executor, concurrency=3)
    assert (end.fatal, end.unreachable, end.failed, end.not_run) == ("connection refused", True, 0, 6)
    assert executor.cancelled == ["k1", "k2"]  # cut short, and not recorded failed either
    assert not (tmp_path / store.FAILURES).read_text() and resume_scan.scan(tmp_path).done == set()


def test_an_endpoint_out_of_reach_after_answering_another_worker_is_an_ordinary_fatal_stop(tmp_path):
    def answer(t: Task) -> list[Event]:
        if t.prompt_index == 0:
            return [Finished(decide(t, row=row(t)))]
        refused = decide(t, error=EndpointUnreachable("connection refused"))
        return [Fatal(refused.message, unreachable=True), Finished(refused)]

    end = run(tmp_path, 4, AnsweringExecutor(answer), concurrency=1)
    assert (end.fatal, end.unreachable, end.failed, end.not_run) == ("connection refused", False, 1, 2)
    failures = [json.loads(line) for line in (tmp_path / store.FAILURES).read_text().splitlines()]
    assert [(f["prompt_key"], f["error_class"]) for f in failures] == [("k1", "EndpointUnreachable")]


def test_what_a_stop_finds_on_its_way_is_recorded_and_paid(tmp_path):
    """An outcome and a paid reply already on their way when the stop cancelled their prompts: the
    row is written, the reply journaled (resume does not pay for it again), both are paid."""
    class Cancelling(AnsweringExecutor):
        def cancel(self) -> list[Event]:
            super().cancel()
            landed, cut = task(0), task(1)
            reply = Reply({"content": "paid"}, {"prompt_tokens": 3, "completion_tokens": 2, "cost": 0.5})
            return [Finished(decide(landed, row=row(landed, cost=1.0))), Replied(cut.key, 0, "h", reply)]

    executor = Cancelling(lambda t: [], hold=lambda t: True)
    end = run(tmp_path, 4, executor, concurrency=2,
              health_check=lambda: "stopped" if len(executor.submitted) == 2 else None)
    assert executor.cancelled == ["k0", "k1"]
    assert (end.fatal, end.failed, end.not_run) == ("stopped", 1, 2)
    assert (end.paid_cost, end.paid_tokens) == (1.5, 20)
    assert resume_scan.scan(tmp_path).done == {"k0"}
    failures = [json.loads(line) for line in (tmp_path / store.FAILURES).read_text().splitlines()]
    assert [(f["prompt_key"], f["error_class"]) for f in failures] == [("k1", "RunStopped")]
    assert [(e["key"], e["message"]) for e in store.read_records(tmp_path / store.JOURNAL, [])] == [
        ("k1", {"content": "paid"})]


def test_the_status_line_names_the_prompts_retrying_until_they_are_answered(tmp_path):
    executor = AnsweringExecutor(lambda t: [], hold=lambda t: True)
    limits = scheduler.Limits(run_name="run", batch_size=2, concurrency=3)
    sched = scheduler.Scheduler(Plan(remaining=3), executor, limits, tmp_path, {}, 0.0, 0.0)
    sched.admit(iter([task(i) for i in range(3)]))
    assert sched.status() == "3 in flight"
    sched.handle(Retrying("k0", "HTTP 500", 1, 10, 2.0))
    sched.handle(Retrying("k1", "HTTP 503", 4, 10, 6.4))
    line = sched.status()
    assert line.startswith("2 retrying: HTTP 503, attempt 4/10, next in ") and line.endswith(" s; 3 in flight")
    assert 0 <= int(line.split("next in ")[1].split(" s")[0]) <= 6
    sched.handle(Replied("k1", 0, "h", Reply({"content": "ok"})))
    assert sched.status().startswith("1 retrying: HTTP 500, attempt 1/10")
    sched.handle(Finished(decide(task(0), row=row(task(0)))))
    assert sched.status() == "3 in flight"
    sched.writer.close(sched.checkpoint())


def test_the_spend_limit_stops_admitting_but_lets_prompts_in_flight_finish(tmp_path):
    executor = AnsweringExecutor(lambda t: [Finished(decide(t, row=row(t, cost=1.0)))])
    end = run(tmp_path, 10, executor, concurrency=3, max_cost=2.5)
    assert end.budget == "--max_cost=2.5" and (end.paid_cost, end.paid_tokens) == (3.0, 45) and end.failed == 0
    assert len(executor.submitted) == 3 and end.not_run == 7


def test_spend_is_counted_as_each_reply_arrives_and_a_limit_cancels_at_once(tmp_path):
    """Replies count as they arrive, long before their prompts land: the limit cancels the prompts in flight
    at the reply that reaches it."""
    class Replying(AnsweringExecutor):
        def poll(self, timeout: float) -> list[Event]:  # one reply per prompt in flight per poll
            return [Replied(t.key, 0, "h", Reply({"content": "r"}, {"prompt_tokens": 3, "completion_tokens": 2,
                                                                    "cost": 0.25})) for t in self.pending]

    executor = Replying(lambda t: [], hold=lambda t: True)
    end = run(tmp_path, 8, executor, concurrency=4, max_cost=1.5)
    assert end.budget == "--max_cost=1.5" and executor.cancelled == ["k0", "k1", "k2", "k3"]
    assert (end.paid_cost, end.paid_tokens) == (2.0, 40)  # two replies each: the limit at the second poll
    assert len(executor.submitted) == 4 and end.not_run == 8


def test_an_outcome_adds_only_the_replies_the_parent_has_not_counted(tmp_path):
    """The replies that travelled with a landed outcome (not sent apart), one that failed its checks (never
    sent); an outcome that does not carry its replies (a dead worker's) adds nothing."""
    limits = scheduler.Limits(run_name="run", batch_size=2, concurrency=3)
    sched = scheduler.Scheduler(Plan(remaining=3), AnsweringExecutor(lambda t: []), limits, tmp_path, {}, 0.0, 0.0)
    sched.admit(iter([task(i) for i in range(3)]))
    reply = Reply({"content": "r"}, {"prompt_tokens": 10, "completion_tokens": 5, "cost": 0.5})
    for key in ("k0", "k1", "k2"):
        sched.handle(Replied(key, 0, "h", reply))
    assert (sched.spend.cost, sched.spend.tokens) == (1.5, 45)
    two = row(task(0), cost=1.0)
    two["metadata"]["usage"] |= {"prompt_tokens": 20, "completion_tokens": 10}
    sched.handle(Finished(decide(task(0), row=two)))  # its second reply travelled with it
    failed = decide(task(1), error=ValueError("a malformed second reply"),
                    usage={"prompt_tokens": 20, "completion_tokens": 10, "reasoning_tokens": 0, "cost": 1.0})
    sched.handle(Finished(failed))
    sched.handle(Finished(decide(task(2), error=WorkerCrashed("worker process died"))))  # carries no usage
    assert (sched.spend.cost, sched.spend.tokens) == (2.5, 75) and sched.spend.seen == {}
    sched.writer.close(sched.checkpoint())


def test_a_prompt_run_again_after_its_ray_actor_died_pays_only_what_it_did_not_replay(tmp_path):
    limits = scheduler.Limits(run_name="run", batch_size=2, concurrency=1)
    sched = scheduler.Scheduler(Plan(remaining=1), AnsweringExecutor(lambda t: []), limits, tmp_path, {}, 0.0, 0.0)
    sched.admit(iter([task(0)]))
    reply = Reply({"content": "r"}, {"prompt_tokens": 10, "completion_tokens": 5, "cost": 0.5})
    sched.handle(Replied("k0", 0, "h", reply))
    sched.handle(Replied("k0", 1, "h", reply))
    sched.handle(Rerun("k0"))  # its first two replies are replayed, then it pays two more, the last with its row
    sched.handle(Replied("k0", 2, "h", reply))
    landed = row(task(0), cost=2.0)
    landed["metadata"]["usage"] = {"prompt_tokens": 40, "completion_tokens": 20, "reasoning_tokens": 0, "cost": 2.0,
                                   "replayed": {"turns": 2, "prompt_tokens": 20, "completion_tokens": 10,
                                                "reasoning_tokens": 0, "cost": 1.0}}
    sched.handle(Finished(decide(task(0), row=landed)))
    assert (sched.spend.cost, sched.spend.tokens) == (2.0, 60)
    sched.writer.close(sched.checkpoint())


def test_an_executor_left_without_workers_stops_the_run_like_a_fatal_error(tmp_path):
    class Gone(AnsweringExecutor):
        def poll(self, timeout: float) -> list[Event]:
            raise WorkerCrashed("every Ray worker is gone for good; see the messages above")

    end = run(tmp_path, 4, Gone(lambda t: []), concurrency=2)
    assert end.fatal == "every Ray worker is gone for good; see the messages above"
    assert end.failed == 2 and end.not_run == 2  # the prompts it held are recorded, the rest wait for a resume


def test_a_run_under_nohup_keeps_ignoring_sighup():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        handlers = scheduler._Signals(lambda first: None)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) is handlers
        handlers.restore()
    finally:
        signal.signal(signal.SIGHUP, previous)
