"""`ViewList`: the simulator's one list of worker views, which remembers the positions it
replaced (router/planner_caches.py's `ReplacementLog`), so the planner looks at those only."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from deepinfer_gateway.router.worker_view import WorkerView


class ViewList(list[WorkerView]):
    """A view list that remembers which positions were replaced (`views[i] = view`, its only
    mutation), for a caller that keeps one list and replaces the views that change: the
    planner then looks at those positions instead of comparing every view with the last
    request's (a fleet has ~1,000 views and a few change per request)."""

    _KEEP = 4  # positions remembered, per view in the list, before the oldest marks expire

    def __init__(self, views: Iterable[WorkerView] = ()) -> None:
        super().__init__(views)
        self._replaced: list[int] = []
        self._first = 0  # the mark of _replaced[0]

    def __setitem__(self, i: Any, view: Any) -> None:
        if not isinstance(i, int):
            raise TypeError("ViewList: only single positions are replaced")
        super().__setitem__(i, view)
        if len(self._replaced) >= self._KEEP * max(1, len(self)):
            self._first += len(self._replaced)
            self._replaced = []
        self._replaced.append(i % len(self))

    @property
    def mark(self) -> int:
        """Where `replaced_since` starts for replacements after now."""
        return self._first + len(self._replaced)

    def replaced_since(self, mark: int) -> list[int] | None:
        """The positions replaced since `mark` (repeats possible); None when no longer known."""
        start = mark - self._first
        return None if start < 0 else self._replaced[start:]

    def _fixed(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("ViewList: only single positions are replaced (views[i] = view)")

    __delitem__ = __iadd__ = __imul__ = append = extend = insert = pop = remove = clear = sort = reverse = _fixed
