"""The errors a tuning call raises with the same text on every rank."""

from __future__ import annotations


class TuningError(RuntimeError):
    """Tuning could not complete; raised with the same message on every rank."""


class StoreWarning(UserWarning):
    """Something about the winner store was wrong and dealt with (a damaged entry re-tuned, a held lock, a
    stored winner that failed on some rank)."""
