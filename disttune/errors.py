"""The errors a tuning call raises with the same text on every rank, and those of a wait for the peers."""

from __future__ import annotations

from typing import Sequence


class TuningError(RuntimeError):
    """Tuning could not complete; raised with the same message on every rank."""


class StoreWarning(UserWarning):
    """Something about the winner store was wrong and dealt with (a damaged entry re-tuned, a held lock, a
    stored winner that failed on some rank)."""


class CollectiveTimeout(RuntimeError):
    """A wait did not complete in time (a peer died, hung or skipped the step); ``missing`` names the ranks
    that had not arrived, where the communicator can tell."""

    def __init__(self, message: str, missing: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.missing = tuple(missing)


class PeerFailed(RuntimeError):
    """A peer posted on the watched channel (an error, or leaving after one) while this rank waited."""

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
