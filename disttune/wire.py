"""What the tuner's control plane carries: plain data, never code.

Every message a rank sends its peers (gathered objects, notes in the rendezvous store, the verdict
of a failed call) is JSON text. Any process that can reach the store's port can write into it, so
nothing read from there is unpickled: :func:`unpack` builds only ``None``, booleans, numbers
(``inf`` and ``nan`` included), strings, lists, tuples and dicts, and a message that does not
decode is a :class:`MalformedMessage` naming the rank it came from. Float vectors travel as
fixed-layout float64 bytes (:func:`pack_floats`), checked for their length.

JSON has no tuples and only string keys, so two tagged forms keep what the tuner gathers exact:
a tuple is ``{"__tuple__": [...]}`` and a dict with other keys is ``{"__items__": [[key, value], ...]}``.
Cost: ``json.dumps``/``json.loads`` of a few hundred bytes, microseconds.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

__all__ = ["MalformedMessage", "pack", "unpack", "pack_floats", "unpack_floats"]

_TUPLE, _ITEMS = "__tuple__", "__items__"
_TAGS = (_TUPLE, _ITEMS)


class MalformedMessage(RuntimeError):
    """A peer's message did not decode as disttune's plain data (another program wrote it, or it is damaged)."""


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, tuple):
        return {_TUPLE: [_plain(v) for v in value]}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) and k not in _TAGS for k in value):
            return {k: _plain(v) for k, v in value.items()}
        return {_ITEMS: [[_plain(k), _plain(v)] for k, v in value.items()]}
    raise TypeError(f"disttune: the control plane carries plain data only, not {type(value).__name__} ({value!r})")


def _restore(value: Any) -> Any:
    if isinstance(value, list):
        return [_restore(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_TUPLE} and isinstance(value[_TUPLE], list):
            return tuple(_restore(v) for v in value[_TUPLE])
        if set(value) == {_ITEMS} and isinstance(value[_ITEMS], list):
            pairs = value[_ITEMS]
            if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
                raise ValueError("a tagged dict whose items are not [key, value] pairs")
            return {_hashable(_restore(k)): _restore(v) for k, v in pairs}
        return {k: _restore(v) for k, v in value.items()}
    return value


def _hashable(key: Any) -> Any:
    hash(key)  # a list or dict as a key: TypeError, reported as a malformed message
    return key


def pack(value: Any) -> bytes:
    """``value`` (plain data: see the module doc) as the bytes a peer decodes with :func:`unpack`."""
    return json.dumps(_plain(value), separators=(",", ":")).encode()


def unpack(data: bytes, sender: int, what: str) -> Any:
    """Decode a message ``sender`` sent for ``what``; a :class:`MalformedMessage` naming the rank otherwise."""
    try:
        return _restore(json.loads(bytes(data).decode()))
    except (UnicodeDecodeError, ValueError, TypeError, RecursionError) as err:
        preview = bytes(data[:40])
        raise MalformedMessage(f"disttune: rank {sender} sent a message for {what} that is not disttune's plain "
                               f"data ({type(err).__name__}: {err}; it starts {preview!r}); is another program "
                               "writing into this job's rendezvous store?") from None


def pack_floats(values: Sequence[float]) -> bytes:
    """A float vector as float64 bytes (little-endian)."""
    return np.ascontiguousarray(values, dtype="<f8").tobytes()


def unpack_floats(data: bytes, length: int, sender: int, what: str) -> np.ndarray:
    """``length`` float64 values sent by ``sender``; a :class:`MalformedMessage` if the size is wrong."""
    if len(data) != 8 * length:
        raise MalformedMessage(f"disttune: rank {sender} sent {len(data)} bytes for {what}, where {length} float64 "
                               f"values ({8 * length} bytes) were due: the ranks are at different steps, or another "
                               "program is writing into this job's rendezvous store")
    return np.frombuffer(bytes(data), dtype="<f8").astype(np.float64)

