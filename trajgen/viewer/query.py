"""Search, filter and page the index's entries, in dataset order."""
from __future__ import annotations

from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Callable

from trajgen.merge import Filtering
from trajgen.verify import Verdict
from trajgen.viewer.index import DISCARDED, FAILED, ROW, Entry, RunIndex

STATUSES = ("ok", "filtered", "discarded", "failed")
PAGE_LIMIT = 500


FILTERED_BECAUSE = {"hallucinated": "called a tool that was not offered",
                    "no_reasoning": "no assistant turn has reasoning (--require_reasoning)"}
NOT_PASSED_BECAUSE = {  # a check that could not run says nothing about the model: not said as a failure
    Verdict.FAILED: "its verify command failed (--require_verified)",
    Verdict.TIMEOUT: "its verify command timed out (--require_verified)",
    Verdict.ERROR: "its verify check could not run (--require_verified)",
    Verdict.UNVERIFIED: "it has no verify command (--require_verified)",
}


def status(entry: Entry, filtering: Filtering) -> str:
    if entry.kind == FAILED:
        return "failed"
    if entry.kind == DISCARDED:
        return "discarded"
    return "ok" if _group(entry, filtering) == "kept" else "filtered"


def reason(entry: Entry, filtering: Filtering) -> str | None:
    """The discard reason, the failure's class, or why the merge filtered the row."""
    if entry.kind != ROW:
        return entry.reason
    group = _group(entry, filtering)
    return NOT_PASSED_BECAUSE[entry.verdict] if group == "not_passed" else FILTERED_BECAUSE.get(group)


def _group(entry: Entry, filtering: Filtering) -> str:
    """Where the merge put the entry's row (the run's filters read back from its statistics.json)."""
    return filtering.group(entry.hallucinated, entry.reasoned, entry.passed)


@dataclass(frozen=True)
class Filters:
    """What the list shows; an empty field does not filter. yes/no for the two flags. `q` finds
    prompts containing it, and the prompt whose dataset id, prompt_key or index it is."""

    q: str = ""
    status: str = ""
    tool: str = ""
    toolset: str = ""
    hallucinated: str = ""
    partial: str = ""
    failed_class: str = ""

    @classmethod
    def from_params(cls, params: dict[str, str]) -> "Filters":
        return cls(**{f.name: params.get(f.name, "").strip() for f in fields(cls)})

    def predicate(self, filtering: Filtering) -> Callable[[Entry], bool]:
        """One test per filter that is set, so an unfiltered page costs nothing per entry."""
        tests: list[Callable[[Entry], bool]] = []
        if q := self.q.lower():
            number = int(q) if q.isdigit() else None
            tests.append(lambda e: q in e.search or e.prompt_index == number or q == e.key
                         or q == (e.dataset_id or "").lower())
        if self.status:
            tests.append(lambda e: status(e, filtering) == self.status)
        if self.tool:
            tests.append(lambda e: self.tool in e.tools)
        if self.toolset:
            tests.append(lambda e: self.toolset in e.toolsets_offered)
        if self.hallucinated:
            tests.append(lambda e: e.hallucinated == (self.hallucinated == "yes"))
        if self.partial:
            tests.append(lambda e: e.partial == (self.partial == "yes"))
        if self.failed_class:
            tests.append(lambda e: e.kind == FAILED and e.reason == self.failed_class)
        if len(tests) == 1:  # the usual case, without a generator per entry
            return tests[0]
        return lambda e: all(test(e) for test in tests)


class Pager:
    """Pages of the matching entries. The match of the last filters is kept until the index changes,
    so turning pages costs only the page."""

    def __init__(self, index: RunIndex):
        self.index = index
        self._sorted: tuple[int, list[Entry]] = (-1, [])
        self._matched: tuple[tuple, list[Entry]] = ((), [])

    def ordered(self) -> list[Entry]:
        if self._sorted[0] != self.index.version:
            entries = sorted(self.index.entries, key=attrgetter("order"))
            self._sorted = (self.index.version, entries)
        return self._sorted[1]

    def matching(self, filters: Filters, filtering: Filtering) -> list[Entry]:
        stamp = (self.index.version, filters, filtering)
        if self._matched[0] != stamp:
            entries = self.ordered()
            self._matched = (stamp, list(filter(filters.predicate(filtering), entries))
                             if filters != Filters() else entries)
        return self._matched[1]

    def page(self, filters: Filters, filtering: Filtering, start: int, limit: int) -> tuple[int, list[Entry]]:
        """(how many match, the entries from `start`)."""
        matched = self.matching(filters, filtering)
        limit = max(1, min(limit, PAGE_LIMIT))
        start = max(0, start)
        return len(matched), matched[start:start + limit]
