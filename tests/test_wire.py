"""The control plane's messages are plain data: exact round trips, and nothing that would run code."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

from disttune import wire
from disttune.wire import MalformedMessage


def test_what_the_tuner_gathers_comes_back_exact():
    digest = {"error": None, "options": {"reduce": "'max'"}, "sites": [("k", "(64, 'torch.float32')", 0, ("a", "b"))],
              "lookups": [2, None], "failures": [{0: "TypeError: x", 3: "y"}], "split": [False, True],
              "times": [1.5, math.inf], "nested": {(1, 2): [("t",)]}}
    back = wire.unpack(wire.pack(digest), 0, "consensus")
    assert back == digest
    assert isinstance(back["sites"][0], tuple) and isinstance(back["sites"][0][3], tuple)
    assert list(back["failures"][0]) == [0, 3]  # int keys stay ints
    assert wire.unpack(wire.pack(math.nan), 0, "x") != wire.unpack(wire.pack(math.nan), 0, "x")  # nan stays nan


def test_a_dict_that_uses_a_tag_as_a_key_is_kept_apart():
    value = {"__tuple__": [1, 2], "other": 3}
    assert wire.unpack(wire.pack(value), 0, "x") == value


def test_objects_are_refused_before_they_leave():
    with pytest.raises(TypeError, match="plain data only, not object"):
        wire.pack({"x": object()})


class _Bomb:
    def __reduce__(self):
        return (exec, ("raise SystemExit('the bomb went off')",))


def test_a_pickle_is_refused_and_names_its_sender():
    with pytest.raises(MalformedMessage, match="rank 3 sent a message for note .*not disttune's plain data"):
        wire.unpack(pickle.dumps(_Bomb()), 3, "note")


@pytest.mark.parametrize("junk", [b"{", b'{"__items__": [[[1], 2]]}', b'{"__items__": [1]}', "é".encode("latin-1")])
def test_malformed_messages_are_named_not_crashes(junk):
    with pytest.raises(MalformedMessage, match="rank 1 sent"):
        wire.unpack(junk, 1, "consensus")


def test_float_vectors_have_a_fixed_layout():
    data = wire.pack_floats([1.0, math.inf, -2.5])
    assert len(data) == 24
    np.testing.assert_array_equal(wire.unpack_floats(data, 3, 0, "x"), [1.0, math.inf, -2.5])
    with pytest.raises(MalformedMessage, match="rank 2 sent 24 bytes for agreement, where 4 float64"):
        wire.unpack_floats(data, 4, 2, "agreement")


def test_keyed_messages_come_back_whole_however_the_stream_is_cut():
    messages = [("disttune/all/step#0/c/7", b""), ("k", b"\x00" * 3 + b"body"), ("node\u00e9/c/8", bytes(range(256)))]
    stream = b"".join(wire.pack_keyed(key, body) for key, body in messages)
    for piece in (1, 2, 7, len(stream)):
        reader, read = wire.KeyedStream(), []
        for start in range(0, len(stream), piece):
            read.extend(reader.feed(stream[start : start + piece]))
        assert read == messages, piece
    half = wire.KeyedStream()
    assert half.feed(stream[:-1]) == messages[:2]  # the last message waits for its last byte
    assert half.feed(stream[-1:]) == messages[2:]
