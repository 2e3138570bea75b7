"""``BatchRefusal``: why a ``*_batch`` call computed nothing, gathered body by body.

A batch is all or nothing (SPEC §2.2): one invalid request fails the call, naming every bad
position. The problems are gathered as the bodies are decoded, in order, and kept small: the
first few described, the positions as runs (``0-24, 30``), the rest counted. Holding every
error instead (each with its traceback, which holds its frames) took one 30 MB batch of six
million one-character bodies past 10 GB.
"""

from __future__ import annotations

from ..errors import InferenceError, InvalidRequestError

__all__ = ["LISTED_RUNS", "NAMED_PROBLEMS", "BatchRefusal"]

#: Problems a refused ``*_batch`` call describes one by one; the rest are counted. A body of a
#: million tiny invalid elements must not answer with a message of tens of megabytes.
NAMED_PROBLEMS = 20
#: Runs of bad positions listed (``0-24, 30``): every one in any batch a user would send; past
#: this many (a huge batch, every other body bad), the rest are counted.
LISTED_RUNS = 1_000
#: The most positions an error lists in its ``positions`` (one run can be millions long).
GIVEN_POSITIONS = 100_000


class _Runs:
    """Ascending positions as runs, ``0-3, 7, 9-10``; past :data:`LISTED_RUNS` runs, the
    positions of the rest are only counted."""

    def __init__(self) -> None:
        self.count = 0
        self._runs: list[list[int]] = []
        self._unlisted = 0

    def add(self, position: int) -> None:
        self.count += 1
        if not self._unlisted and self._runs and position == self._runs[-1][1] + 1:
            self._runs[-1][1] = position
        elif len(self._runs) < LISTED_RUNS:
            self._runs.append([position, position])
        else:
            self._unlisted += 1

    def positions(self) -> list[int] | None:
        """Every position, or None if some are only counted, or there are too many."""
        if self._unlisted or self.count > GIVEN_POSITIONS:
            return None
        return [position for a, b in self._runs for position in range(a, b + 1)]

    def __str__(self) -> str:
        shown = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in self._runs)
        if self._unlisted:
            shown += f" and {self._unlisted} more after them"
        return f"position{'s' if self.count > 1 else ''} {shown}"


class BatchRefusal:
    """The problems of one ``*_batch`` call's bodies, added in ascending position."""

    def __init__(self) -> None:
        self._invalid = _Runs()
        self._described: list[InvalidRequestError] = []
        self._kinds: set[type[InvalidRequestError]] = set()
        self._failed = _Runs()
        self._first_failure: InferenceError | None = None

    def __bool__(self) -> bool:
        return bool(self._invalid.count or self._failed.count)

    def add(self, position: int, problem: InferenceError) -> None:
        if isinstance(problem, InvalidRequestError):
            self._invalid.add(position)
            self._kinds.add(type(problem))
            if len(self._described) < NAMED_PROBLEMS:
                self._described.append(problem)
        else:
            self._failed.add(position)
            if self._first_failure is None:
                self._first_failure = problem

    def error(self, total: int) -> InferenceError:
        """Why the call computed nothing: the invalid requests, every bad position and what is
        wrong with the first ones (SPEC §2.2: ``InvalidRequestError``, whatever else failed);
        else a model's failure to prepare a request as it is (ServerModel.prepared_tile)."""
        error = self._error(total)
        invalid, failed = self._invalid.positions(), self._failed.positions()
        if invalid is not None and failed is not None:
            positions = sorted(invalid + failed)
            error.positions = positions if len(positions) <= GIVEN_POSITIONS else None
        return error

    def _error(self, total: int) -> InferenceError:
        if not self._invalid.count:
            assert self._first_failure is not None, "error() of a batch with no problem"
            return self._first_failure
        # The class a single request would get when every problem is of that kind (all
        # bulk_rna: UnsupportedModeError, 400 over HTTP), else the general one.
        kind = next(iter(self._kinds)) if len(self._kinds) == 1 else InvalidRequestError
        named = "; ".join(map(str, self._described))
        if self._invalid.count > len(self._described):
            named += f"; and {self._invalid.count - len(self._described)} more"
        if self._failed.count:  # valid requests the model could not prepare: said, not hidden
            named += f"; and the model failed to prepare {self._failed}: {self._first_failure}"
        invalid = self._invalid.count
        return kind(
            f"{invalid} of {total} requests are invalid ({self._invalid}), nothing was computed: "
            f"{named}"
        )
