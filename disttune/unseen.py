"""Keys a tuned wrapper was never tuned for: served at once on a rank-independent fallback, never a stall.

After tuning, a call may meet a key (a new batch size, a new token count) that no tuning call of
the wrapper covered. Only some ranks may meet it, so the rank that does must not enter a
collective: it would wait for peers that are busy with their own collectives. ``on_new_key=``
says what happens instead:

* ``"nearest"``: the launch runs at once, with no collective, on the winner of the nearest tuned
  key (the rule below, over this wrapper's agreed winners and its pinned table), or on
  the first config when no tuned key is a candidate. Every rank that meets the key computes the
  same fallback from the same agreed table. The key is never tuned in traffic.
* ``"tune"`` (the default): served the same way, and remembered as pending. Every ``agree_every``
  calls (SPMD code calls the wrapper as often on every rank, so that call is a point all ranks
  share) each rank gives one number: the position, within the period of ``agree_every`` calls just
  ended, of the first call that met a pending key (``-1``: none). The gather of those numbers waits
  for nobody (:class:`NewKeyVotes`): each rank sets its number at one point and reads its peers' at
  the next. When every rank named the same call, every rank met new keys in that call: each re-runs
  a normal tuning call with that call's arguments (kept until then), and the keys are tuned as the
  first call tunes. Otherwise they stay on their fallback, and a later period tries again. A world
  of one needs no agreement: there the launch runs its first config and the next call tunes (no
  peer can be left waiting).
* ``"error"``: :class:`UnseenKeyError` on the rank that meets the key, before it launches (a
  pinned deployment that must never run an untuned config).

The trade-off: a key every rank meets in the same call is tuned between ``agree_every`` and
``2 * agree_every`` calls later, not in that call, since only a collective in every call could
tell a rank that its peers met the key too; until then it runs on its fallback, the same on every
rank. Cost on the fast path: one counter per call; per ``agree_every`` calls (``"tune"`` with more
than one rank only), three or four operations on the rendezvous store and no wait for the peers,
unless one is a whole period behind (never a wait on the GPU); a launch on a fallback costs a dict
lookup over the planned launch, and the first one per key the nearest search and a line in the
rank log.

The policies are :data:`NEW_KEY_POLICIES`, by name: a new one is a :class:`NewKeyPolicy` (its fallback
function, and whether its keys are tuned later) and one line there (``docs/extending.md``).

**The nearest tuned key.** The rule, the same on every rank because it reads only the agreed table (a wrapper's agreed
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
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Optional

from . import triton_launch as triton
from .comm import Communicator, start_gather_floats
from .configs import config_text, describe_config
from .sites import SiteId

DEFAULT_AGREE_EVERY = 128
NEVER = 1 << 62  # a countdown that never reaches zero in a process's life


class UnseenKeyError(RuntimeError):
    """``on_new_key="error"``: a launch met a key that no tuning call and no pinned table covers."""


# -- the nearest tuned key ---------------------------------------------------------------------------------

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


# -- fallbacks -----------------------------------------------------------------------------------------------

def table_candidates(table: Optional[dict], name: str, occurrence: int) -> dict:
    """``{key: winner config text}`` of a pinned table's entries for kernel (or function) ``name``."""
    if table is None:
        return {}
    return {parse_key(r["key"]): r["configs"][r["winner"]] for r in table["entries"]
            if r["name"] == name and int(r.get("occurrence", 0)) == occurrence}


def choose(key: Any, configs: list, candidates: dict, describe: Callable[[Any], str] = config_text) -> tuple[Any, str]:
    """The fallback for ``key`` among ``configs``: (config, where it came from).

    ``candidates`` maps tuned keys to their winners (configs or their texts); a candidate whose winner
    is not among ``configs`` (pruned for this key) does not count.
    """
    texts = [describe(c) for c in configs]
    usable = {}
    for tuned, winner in candidates.items():
        text = winner if isinstance(winner, str) else describe(winner)
        if text in texts:
            usable[tuned] = texts.index(text)
    nearest = nearest_key(key, usable)
    if nearest is None:
        return configs[0], "first config (no tuned key is a candidate)"
    return configs[usable[nearest]], f"nearest tuned key {nearest!r}"


def refuse(key: Any, configs: list, candidates: dict, describe: Callable[[Any], str] = config_text) -> tuple[Any, str]:
    """``on_new_key="error"``'s fallback: none, an :class:`UnseenKeyError` (the caller names the site)."""
    raise UnseenKeyError(f"key {key!r} was not tuned for (on_new_key='error')")


@dataclass(frozen=True)
class NewKeyPolicy:
    """What a call after tuning does with a key it was not tuned for: it runs on ``fallback(key, configs,
    candidates, describe)`` (a config of ``configs`` and where it came from; ``candidates`` maps the tuned keys
    to their winners), which may raise instead; with ``tunes`` the key is tuned later, at an agreement point
    (with several ranks) or at the next call (a world of one). The fallback must be the same on every rank:
    compute it from its arguments only."""

    fallback: Callable[..., tuple[Any, str]]
    tunes: bool = False


#: ``on_new_key=`` by name. A new policy is one function and one line here.
NEW_KEY_POLICIES: dict[str, NewKeyPolicy] = {
    "tune": NewKeyPolicy(choose, tunes=True),
    "nearest": NewKeyPolicy(choose),
    "error": NewKeyPolicy(refuse),
}


class NewKeys:
    """The unseen-key policy of one contextual wrapper: its agreed winners, fallbacks, pending keys.

    ``known`` accumulates the agreed winners of every tuning call (the table the fallback reads);
    ``served`` holds each unseen site's fallback, chosen once; ``log(ident, config, source)`` records it.
    """

    def __init__(self, name: str, mode: str, table: Optional[dict] = None,
                 log: Optional[Callable[[SiteId, Any, str], None]] = None) -> None:
        self.name, self.policy, self.table, self.log = name, NEW_KEY_POLICIES[mode], table, log
        self.known: dict[SiteId, Any] = {}
        self.served: dict[SiteId, tuple[Any, str]] = {}
        self.pinned: dict[SiteId, Any] = {}  # sites the pinned table has a winner for: served as tuned
        self.pending: set[SiteId] = set()
        self.met_in_call = False  # set by a launch on a fallback, read and cleared by the wrapper

    def remember(self, winners: dict[SiteId, Any]) -> None:
        """Winners agreed by a tuning call: known from now on, and no longer served by a fallback."""
        self.known.update(winners)
        for ident in winners:
            self.served.pop(ident, None)
            self.pending.discard(ident)

    def fallbacks(self) -> dict[str, str]:
        """``{site: "config <- source"}`` for every site served by a fallback so far, for logs and reports."""
        return {ident.describe(): f"{describe_config(config)} <- {source}"
                for ident, (config, source) in self.served.items()}

    def launch(self, ident: SiteId, autotuner: Any, key: tuple, args: tuple, kwargs: dict) -> Any:
        """Launch ``ident`` on its fallback (chosen on first sight); no collective. The kernel's ``best_config``
        becomes the config launched, as after a tuning call it is the winner: the config last chosen for it."""
        config = self.pinned.get(ident)
        if config is not None:
            autotuner.best_config = config
            return triton.launch_winner(autotuner, args, kwargs, config)
        served = self.served.get(ident)
        if served is None:
            configs = triton.candidate_configs(autotuner, args, kwargs)
            exact = self._pinned_winner(ident, key, configs)
            if exact is not None:
                self.pinned[ident] = exact
                autotuner.best_config = exact
                return triton.launch_winner(autotuner, args, kwargs, exact)
            try:
                served = self.served[ident] = self.policy.fallback(key, configs, self._candidates(ident))
            except UnseenKeyError as err:
                raise UnseenKeyError(
                    f"disttune: {self.name} launched {ident.describe()}, which no tuning call and no pinned "
                    f"table covers: {err}; tune it (step.sweep) and deploy the table, or pass "
                    "on_new_key='nearest'") from None
            if self.log is not None:
                self.log(ident, served[0], served[1])
        if self.policy.tunes:
            self.pending.add(ident)
            self.met_in_call = True
        autotuner.best_config = served[0]
        return triton.launch_winner(autotuner, args, kwargs, served[0])

    def _pinned_winner(self, ident: SiteId, key: tuple, configs: list) -> Optional[Any]:
        """The pinned table's winner for exactly this site (same key and candidate list), if it has one."""
        if self.table is None:
            return None
        texts = [config_text(c) for c in configs]
        for record in self.table["entries"]:
            if (record["name"], int(record.get("occurrence", 0)), record["configs"]) == (ident.kernel, ident.occurrence,
                                                                                         texts) \
                    and parse_key(record["key"]) == key:
                return configs[int(record["winner"])]
        return None

    def _candidates(self, ident: SiteId) -> dict:
        """The tuned keys of ``ident``'s kernel and occurrence, with their winners (this wrapper's, then the table's)."""
        candidates = {known.key: config for known, config in self.known.items()
                      if known.kernel == ident.kernel and known.occurrence == ident.occurrence}
        for tuned, text in table_candidates(self.table, ident.kernel, ident.occurrence).items():
            candidates.setdefault(tuned, text)
        return candidates


class NewKeyVotes:
    """The agreement on new keys of one tuner (``on_new_key="tune"`` with several ranks), a point every
    ``agree_every`` calls; see the module doc.

    :meth:`point` finishes the gather started at the previous point and starts this period's: the
    ranks never wait for each other at a point (a peer a whole period behind is waited for, bounded
    by the communicator's timeout).
    """

    def __init__(self, name: str) -> None:
        self.channel = f"{name}:new keys"
        self._pending: Optional[tuple[Callable[[], Any], Optional[tuple]]] = None

    def point(self, comm: Communicator, saved: Optional[tuple]) -> Optional[tuple]:
        """``saved``: this period's first call that met a pending key (its position first), or None.
        Returns the saved call of the previous period when every rank named that same call: the call to tune
        now, on every rank."""
        due = None
        if self._pending is not None:
            finish, earlier = self._pending
            positions = finish()
            if earlier is not None and bool((positions == float(earlier[0])).all()):
                due = earlier
        position = -1.0 if saved is None else float(saved[0])
        self._pending = (start_gather_floats(comm, [position], "agreement on new keys", self.channel), saved)
        return due


def pinned_or_nearest(lookup: Callable[[Any], Optional[int]], table: dict,
                      chosen: dict[SiteId, tuple[Any, str]]) -> Callable[[Any], Optional[int]]:
    """A pinned-table lookup that answers a site the table lacks with its nearest entry (or the first config),
    noting each such answer in ``chosen``: ``on_new_key="nearest"`` with ``pinned=`` in a tuning call."""

    def answer(site: Any) -> Optional[int]:
        index = lookup(site)
        if index is None:
            config, source = choose(site.id.key, site.configs,
                                    table_candidates(table, site.id.kernel, site.id.occurrence))
            index = site.configs.index(config)
            chosen[site.id] = (config, f"pinned table's {source}")
        return index

    return answer
