"""What the tuner's control plane carries: plain data, never code.

Every message a rank sends its peers (gathered objects, notes in the rendezvous store, the verdict
of a failed call) is JSON text. Any process that can reach the store's port can write into it, so
nothing read from there is unpickled: :func:`unpack` builds only ``None``, booleans, numbers
(``inf`` and ``nan`` included), strings, lists, tuples and dicts, and a message that does not
decode is a :class:`MalformedMessage` naming the rank it came from. Float vectors travel as
fixed-layout float64 bytes (:func:`pack_floats`), checked for their length.

Many ranks' messages travel together as *frames* (:func:`pack_frame`: the sender's rank and the
length before each payload), so that a collective keeps them all in one store key; a result that
goes back to every rank keeps each distinct payload once (:func:`pack_shared`), since most ranks
send the same status or digest. On a socket between the ranks of a node, each message is named by its
collective's key (:func:`pack_keyed`, read back by a :class:`KeyedStream`).

JSON has no tuples and only string keys, so two tagged forms keep what the tuner gathers exact:
a tuple is ``{"__tuple__": [...]}`` and a dict with other keys is ``{"__items__": [[key, value], ...]}``.
Cost: ``json.dumps``/``json.loads`` of a few hundred bytes, microseconds.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Sequence

import numpy as np

__all__ = ["MalformedMessage", "pack", "unpack", "pack_floats", "unpack_floats", "pack_frame", "unpack_frames",
           "pack_shared", "unpack_shared", "pack_keyed", "KeyedStream"]

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



_HEADER = struct.Struct("<II")  # sender (or index), payload length
_TABLE = 0xFFFFFFFF  # the tag of a shared result's index table


def pack_frame(sender: int, payload: bytes) -> bytes:
    """``payload`` framed with its sender, to be appended to others' frames in one store value."""
    return _HEADER.pack(sender, len(payload)) + payload


def unpack_frames(data: bytes, what: str) -> list[tuple[int, bytes]]:
    """Every ``(sender, payload)`` of concatenated frames, in order; a :class:`MalformedMessage` when they do
    not parse (a frame cut short: another program wrote into the key)."""
    frames, offset, view = [], 0, memoryview(data)
    while offset < len(view):
        if offset + _HEADER.size > len(view):
            raise _broken(what, offset, len(view))
        sender, length = _HEADER.unpack_from(view, offset)
        offset += _HEADER.size
        if offset + length > len(view):
            raise _broken(what, offset, len(view))
        frames.append((sender, bytes(view[offset : offset + length])))
        offset += length
    return frames


def _broken(what: str, offset: int, size: int) -> MalformedMessage:
    return MalformedMessage(f"disttune: the messages for {what} do not parse (a frame is cut short at byte {offset} "
                            f"of {size}); is another program writing into this job's rendezvous store?")


def pack_shared(payloads: Sequence[bytes]) -> bytes:
    """One payload per rank, each distinct payload once (framed with the first rank that sent it) and a table of
    which payload each rank sent: ``world`` equal statuses cost one status and ``4 * world`` bytes."""
    index: dict[bytes, int] = {}
    frames, table = [], []
    for rank, payload in enumerate(payloads):
        if payload not in index:
            index[payload] = len(index)
            frames.append(pack_frame(rank, payload))
        table.append(index[payload])
    return b"".join(frames) + pack_frame(_TABLE, np.asarray(table, dtype="<u4").tobytes())


def unpack_shared(data: bytes, world: int, what: str) -> list[tuple[int, bytes]]:
    """What :func:`pack_shared` packed: per rank, ``(first sender, payload)`` (the first sender names a payload
    that does not decode); a :class:`MalformedMessage` when the table does not cover ``world`` ranks."""
    frames = unpack_frames(data, what)
    if not frames or frames[-1][0] != _TABLE or len(frames[-1][1]) != 4 * world:
        raise MalformedMessage(f"disttune: the messages for {what} do not carry one entry per rank of {world}; is "
                               "another program writing into this job's rendezvous store?")
    distinct = frames[:-1]
    table = np.frombuffer(frames[-1][1], dtype="<u4")
    if len(table) and int(table.max()) >= len(distinct):
        raise MalformedMessage(f"disttune: the messages for {what} refer to a payload they do not carry; is another "
                               "program writing into this job's rendezvous store?")
    return [distinct[int(i)] for i in table]


_KEYED = struct.Struct("<HI")  # the key's length in bytes, then the body's


def pack_keyed(key: str, body: bytes) -> bytes:
    """``body`` named by ``key`` (a collective's), for a byte stream that carries many: :class:`KeyedStream`."""
    name = key.encode()
    return _KEYED.pack(len(name), len(body)) + name + body


class KeyedStream:
    """The :func:`pack_keyed` messages of one byte stream, parsed as its reads come (a read may end inside a message
    or hold several). Costs a copy of each message."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[str, bytes]]:
        """Add one read; every message it completed, as ``(key, body)`` (a key that is not UTF-8 raises
        ``UnicodeDecodeError``: the stream is not disttune's)."""
        self._buffer += data
        done, offset = [], 0
        while len(self._buffer) - offset >= _KEYED.size:
            key_size, body_size = _KEYED.unpack_from(self._buffer, offset)
            start = offset + _KEYED.size
            end = start + key_size + body_size
            if end > len(self._buffer):
                break
            done.append((self._buffer[start : start + key_size].decode(), bytes(self._buffer[start + key_size : end])))
            offset = end
        del self._buffer[:offset]
        return done
