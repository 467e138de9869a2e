"""The nearest tuned key: which agreed winner serves a key that was never tuned.

The rule, the same on every rank because it reads only the agreed table (a wrapper's agreed
winners, a pinned table) and the key:

1. A key is flattened into its parts (nested tuples and lists, ``torch.Size`` included, are walked
   in order). A part is *numeric* when it is an ``int`` or ``float`` (not a ``bool``), finite and
   greater than zero; every other part (dtypes, strings, flags, zero, negative numbers) is
   *exact*.
2. A tuned key is a candidate only when it has the same structure (the same nesting and
   lengths), numeric parts in the same positions, and equal exact parts.
3. Among the candidates the nearest has the smallest distance, the sum over numeric parts of
   ``|log2 a - log2 b|`` (rounded to 9 decimals, so that equal ratios tie: 8 and 32 are equally
   near to 16).
4. Ties go to the smaller key (its numeric parts compared in order), then to the smaller
   ``repr`` of the key.
5. No candidate: ``None`` (the caller serves the first config).

Cost: one pass over the candidates, a few microseconds each; callers remember the answer per key.
"""

from __future__ import annotations

import ast
import math
from typing import Any, Hashable, Iterable, Optional

__all__ = ["nearest_key", "key_distance", "parse_key"]

_NUMERIC = object()  # what a numeric part looks like in a key's structure


def _numeric(part: Any) -> bool:
    return (isinstance(part, (int, float)) and not isinstance(part, bool)
            and math.isfinite(part) and part > 0)


def _flatten(key: Any) -> tuple[tuple, tuple]:
    """(the key's structure with numeric parts replaced by a marker, its numeric parts in order)."""
    numbers: list[float] = []

    def walk(part: Any) -> Any:
        if isinstance(part, (tuple, list)):
            return ("seq", len(part), tuple(walk(p) for p in part))
        if _numeric(part):
            numbers.append(part)
            return _NUMERIC
        return ("exact", part)

    return walk(key), tuple(numbers)


def key_distance(key: Any, other: Any) -> Optional[float]:
    """The distance of two keys under the rule above, or None when ``other`` is not a candidate for ``key``."""
    shape, numbers = _flatten(key)
    other_shape, other_numbers = _flatten(other)
    if not _same_structure(shape, other_shape):
        return None
    return _distance(numbers, other_numbers)


def _same_structure(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # exact parts whose == does not give a bool (tensors): never a match
        return False


def _distance(numbers: tuple, other: tuple) -> float:
    return round(sum(abs(math.log2(a) - math.log2(b)) for a, b in zip(numbers, other)), 9)


def nearest_key(key: Any, candidates: Iterable[Hashable]) -> Optional[Hashable]:
    """The candidate nearest to ``key`` (see the module doc), or None when none is a candidate.

    ``key`` itself among the candidates is its own nearest (distance 0).
    """
    shape, numbers = _flatten(key)
    best, best_rank = None, None
    for candidate in candidates:
        other_shape, other_numbers = _flatten(candidate)
        if not _same_structure(shape, other_shape):
            continue
        rank = (_distance(numbers, other_numbers), other_numbers, repr(candidate))
        if best_rank is None or rank < best_rank:
            best, best_rank = candidate, rank
    return best


def parse_key(text: str) -> Any:
    """A key as the store and pinned tables hold it (its ``repr``) back as a value; the text itself when
    it does not parse (such a key then matches only an equal text)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text
