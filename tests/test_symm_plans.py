"""The push plans of ``kernels.symm.ShardPusher``, checked across simulated ranks on the CPU.

The pushes themselves need GPUs with symmetric memory: tests/test_moe.py -k graph runs them at one
rank (the own shard only) and tests/test_tp.py and the gloo2 cases of test_moe.py across 2 GPUs. What a CPU can check is the bookkeeping every rank derives
from the same ``rows``: whatever each sender flags in a receiver's memory is exactly what that
receiver waits for and resets, every (sender, receiver) pair of the graph-safe handshake has a
push guarded by the right "read it" flag (a rank without rows included), and the copies land
in the receiver's workspace at the sender's rows (``tests/symm_standins.py``: each rank's buffer is a
CPU tensor standing in for its symmetric-memory copy, each flag address the tuple (owner, row, slot)).
``tests/test_symm_protocol.py`` runs the pushes and flags themselves against a simulated GPU.
"""

from __future__ import annotations

import pytest
import torch

from disttune.kernels.symm import SignalBoard, arrival_order, chunk_rows, push_order
from symm_standins import simulated_pusher, workspaces

WIDTH = 8
ELEMENT = torch.empty((), dtype=torch.bfloat16).element_size()


def _plans(rows: tuple, chunks: int, include_own: bool, graph_safe: bool, parity: int = 0, streams: int = 1) -> list:
    tensors = workspaces(len(rows), sum(rows), WIDTH, graph_safe, torch.bfloat16)
    sides = tuple(f"side {n}" for n in range(streams))
    plans = [simulated_pusher(rank, tensors, graph_safe, sides=sides)._make_plan(rows, chunks, parity, include_own)
             for rank in range(len(rows))]
    return plans, tensors


ROWS = [(5,), (0,), (3, 4), (4, 0), (0, 0), (300, 0, 17), (2, 2, 2, 2), (0, 600, 0, 1), (600, 300, 600, 513)]


@pytest.mark.parametrize("graph_safe,parity", [(True, 0), (False, 0), (False, 1)], ids=["graph-safe", "even", "odd"])
@pytest.mark.parametrize("include_own", [True, False])
@pytest.mark.parametrize("chunks,streams", [(1, 1), (2, 1), (3, 2), (4, 4)], ids=lambda v: str(v))
@pytest.mark.parametrize("rows", ROWS, ids=str)
def test_every_flag_a_sender_sets_is_one_its_receiver_resets_and_copies_land_at_the_senders_rows(
        rows, chunks, streams, include_own, graph_safe, parity):
    plans, tensors = _plans(rows, chunks, include_own, graph_safe, parity, streams)
    world = len(rows)
    row_bytes = WIDTH * ELEMENT
    step = chunk_rows(rows, chunks)
    set_in = {r: [] for r in range(world)}  # flags each receiver gets, from every sender's plan
    for sender, plan in enumerate(plans):
        copied = {}  # receiver -> [(offset into the sender's rows there, bytes)] over all of the sender's streams
        order = []  # receivers in the order this sender first pushes to them
        streams_to = {}  # receiver -> the streams that carry its pieces
        for side, free, pieces in plan.pushes:
            receivers = {flag[0] for _, _, _, flag in pieces}
            assert len(receivers) == 1 and pieces
            receiver = receivers.pop()
            if receiver not in order:
                order.append(receiver)
            streams_to.setdefault(receiver, []).append(side)
            assert free == (None if receiver == sender else (sender, SignalBoard.FREED, receiver))
            # graph-safe: the own shard is copied on the current stream (None), peers on a copy stream; else the
            # own shard on the stream kept for it, beside the first push to a peer
            assert (side is None) == (graph_safe and receiver == sender)
            assert (side == streams) == (not graph_safe and receiver == sender)  # (the index after the copy streams)
            start = tensors[receiver][parity].data_ptr() + sum(rows[:sender]) * row_bytes
            copied.setdefault(receiver, []).extend((dest - start, size) for _, dest, size, _ in pieces if size)
            set_in[receiver] += [flag for _, _, _, flag in pieces]
        for receiver, sizes in copied.items():  # every piece once, at its place: piece c at c * step rows
            assert sum(size for _, size in sizes) == rows[sender] * row_bytes
            assert sorted(offset for offset, _ in sizes) == [c * step * row_bytes for c in range(len(sizes))]
        for receiver, sides in streams_to.items():  # graph-safe: one stream per receiver (its handshake)
            pieces = -(-rows[sender] // step) if rows[sender] else 1
            assert len(set(sides)) == len(sides) == (1 if graph_safe or receiver == sender else min(streams, pieces))
        peers = {p for p in range(world) if p != sender}
        expected = (peers if rows[sender] or graph_safe else set()) | ({sender} if include_own and rows[sender] else set())
        assert set(order) == expected, f"rank {sender} pushes to {sorted(order)}, expected {sorted(expected)}"
        # the order: itself first, then the next ranks, so at each step every rank sends to a different rank
        assert order == [p for p in push_order(sender, world, include_own) if p in expected]
        # the flags this rank sets in its peers after reading: exactly the ones its senders wait on
        assert sorted(plan.frees) == sorted((p, SignalBoard.FREED, sender) for p in peers)
    for receiver, plan in enumerate(plans):
        flags = set_in[receiver]
        assert len(flags) == len(set(flags)), f"rank {receiver}: a flag set twice in one call"
        assert all(flag[:2] == (receiver, SignalBoard.ARRIVED) for flag in flags)
        if graph_safe:  # what finish waits for and resets: every flag that arrives, no other
            assert sorted(plan.arrivals) == sorted(flags)
        for shard in range(world):  # wait_shard's flags: every piece of the shard, each set by its sender
            expected = [(receiver, SignalBoard.ARRIVED, shard * chunks + c) for c in range(-(-rows[shard] // step))]
            assert plan.shard_flags[shard] == expected
            if shard != receiver or include_own:
                assert set(expected) <= set(flags)


def test_the_shards_a_rank_receives_arrive_in_the_order_it_consumes_them():
    """At step k every rank pushes to one rank and each rank receives from one, and the sender rank r hears
    from at step k is the k-th shard of its arrival_order (its own shard being the 0-th)."""
    for world in range(1, 9):
        for k in range(1, world):
            targets = {sender: push_order(sender, world)[k - 1] for sender in range(world)}
            assert sorted(targets.values()) == list(range(world))  # a permutation: one sender per receiver
            for sender, receiver in targets.items():
                assert arrival_order(receiver, world)[k] == sender
        for rank in range(world):
            assert arrival_order(rank, world)[0] == rank and sorted(arrival_order(rank, world)) == list(range(world))


def test_a_rank_without_rows_keeps_the_graph_safe_handshake_paired():
    """Rows (4, 0): rank 1 copies nothing but still waits for rank 0's "read it" flag, clears it and
    flags its arrival, so rank 0's reset and rank 1's next push alternate every call."""
    plans, _ = _plans((4, 0), 1, True, graph_safe=True)
    (side, free, pieces), = plans[1].pushes
    assert free == (1, SignalBoard.FREED, 0) and pieces == [(0, 0, 0, (0, SignalBoard.ARRIVED, 1))]
    assert (0, SignalBoard.ARRIVED, 1) in plans[0].arrivals
    epoch_plans, _ = _plans((4, 0), 1, True, graph_safe=False)
    assert epoch_plans[1].pushes == []  # the epoch protocol needs no handshake from an idle rank

