"""The errors a tuning call raises with the same text on every rank, those of a wait for the peers, and the one
wording they share."""

from __future__ import annotations

from typing import Iterable, Sequence


class TuningError(RuntimeError):
    """Tuning could not complete; raised with the same message on every rank."""


class StoreWarning(UserWarning):
    """Something about the winner store was wrong and dealt with (a damaged entry re-tuned, a held lock, a
    stored winner that failed on some rank)."""


def failed_on_ranks(name: str, what: str, ranks: Iterable[int], lines: Sequence[str]) -> str:
    """The text of every error that some ranks brought to a tuning call of ``name``, whichever tuner and whichever
    path (a completed all-gather, or a verdict settled after a peer was stranded) raises it::

        disttune: NAME: WHAT on rank(s) 1, 3:
          rank 1: ValueError: the cause, as the exception said it
          rank 3: ...

    ``what`` says where (``"tuning run 4/9 failed"``, :data:`NOT_STARTED`, :data:`FINAL_RUN_FAILED`); each of
    ``lines`` is ``"rank r: ..."``, a rank's own exception before anything that followed from it."""
    listed = ", ".join(str(rank) for rank in sorted(set(ranks)))
    return f"disttune: {name}: {what} on rank(s) {listed}:\n  " + "\n  ".join(lines)


#: ``what`` of an error before the first tuning run: a setting, ``key_fn``/``prune_fn``, the discovery run.
NOT_STARTED = "tuning could not start"
#: ``what`` of an error in the run with the agreed winners, whose result the caller gets.
FINAL_RUN_FAILED = "the final run (with the winners) failed"
#: ``what`` of an error that left a tuning call outside any of its collectives (or an interrupt).
CALL_FAILED = "the tuning call failed"


class CollectiveTimeout(RuntimeError):
    """A wait did not complete in time (a peer died, hung or skipped the step); ``missing`` names the ranks
    that had not arrived, where the communicator can tell."""

    def __init__(self, message: str, missing: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.missing = tuple(missing)


class ControlPlaneLost(RuntimeError):
    """The rendezvous store cannot be reached any more: its host (torchrun's agent, or rank 0 of a job started
    without torchrun) is gone, so no collective of the tuner can complete."""


class PeerFailed(RuntimeError):
    """A peer posted on the watched channel (an error, or leaving after one) while this rank waited."""

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
