"""Search, filter and page the index's entries, in dataset order."""
from __future__ import annotations

from dataclasses import dataclass, fields

from trajgen.viewer.index import DISCARDED, FAILED, Entry, RunIndex

STATUSES = ("ok", "filtered", "discarded", "failed")
PAGE_LIMIT = 500


def status(entry: Entry, keep_hallucinated: bool) -> str:
    if entry.kind == FAILED:
        return "failed"
    if entry.kind == DISCARDED:
        return "discarded"
    return "filtered" if entry.hallucinated and not keep_hallucinated else "ok"


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

    def match(self, entry: Entry, keep_hallucinated: bool) -> bool:
        q = self.q.lower()
        found = not q or q in entry.search or q in (str(entry.prompt_index), entry.key, (entry.dataset_id or "").lower())
        return (found
                and (not self.status or status(entry, keep_hallucinated) == self.status)
                and (not self.tool or self.tool in entry.tools)
                and (not self.toolset or self.toolset in entry.toolsets_offered)
                and (not self.hallucinated or entry.hallucinated == (self.hallucinated == "yes"))
                and (not self.partial or entry.partial == (self.partial == "yes"))
                and (not self.failed_class or (entry.kind == FAILED and entry.reason == self.failed_class)))


class Pager:
    """Pages of the matching entries. The match of the last filters is kept until the index changes,
    so turning pages costs only the page."""

    def __init__(self, index: RunIndex):
        self.index = index
        self._sorted: tuple[int, list[Entry]] = (-1, [])
        self._matched: tuple[tuple, list[Entry]] = ((), [])

    def ordered(self) -> list[Entry]:
        if self._sorted[0] != self.index.version:
            entries = sorted(self.index.entries, key=lambda e: (e.prompt_index is None, e.prompt_index or 0, e.key or ""))
            self._sorted = (self.index.version, entries)
        return self._sorted[1]

    def matching(self, filters: Filters, keep_hallucinated: bool) -> list[Entry]:
        stamp = (self.index.version, filters, keep_hallucinated)
        if self._matched[0] != stamp:
            self._matched = (stamp, [e for e in self.ordered() if filters.match(e, keep_hallucinated)])
        return self._matched[1]

    def page(self, filters: Filters, keep_hallucinated: bool, start: int, limit: int) -> tuple[int, list[Entry]]:
        """(how many match, the entries from `start`)."""
        matched = self.matching(filters, keep_hallucinated)
        limit = max(1, min(limit, PAGE_LIMIT))
        start = max(0, start)
        return len(matched), matched[start:start + limit]
