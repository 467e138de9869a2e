"""ShardPusher's flag protocol run across simulated ranks and streams on the CPU.

On GPUs the pushes are copy-engine copies and stream memory operations whose order across ranks
and streams no test controls, and the cross-rank part needs 2 or more GPUs. Here the pusher's own
``gather`` / ``finish`` code runs unchanged against a simulated GPU: every stream is a queue of the
operations it was given (the copies are real memory copies between CPU tensors standing in for
symmetric memory), and a scheduler executes the head of a randomly chosen stream whose operation
can go (a flag wait whose flag holds the value, an event wait whose record has run, a collective
every rank has reached). Each call a rank writes a tag into its tokens, pushes them, joins a
collective (AG-MoE's routing all-gather) and runs a "GEMM" that waits for every shard's arrival
flag and then checks that each shard holds its sender's tag of *this* call: a stale or
overwritten shard, or a state where nothing can go (a hang), fails the test.

Both protocols run eagerly (a call's operations enqueued afresh each call, rows changing between
calls, some ranks without rows), and the graph-safe one also as a CUDA graph: one call's operations
enqueued once and replayed. The epoch protocol replayed the same way must fail (that is why
``graph_safe`` exists), which shows the checks can.
"""

from __future__ import annotations

import collections
import ctypes
import random

import pytest
import torch

from disttune.kernels import symm
from symm_standins import simulated_pusher, workspaces

WIDTH = 4
COPY_STREAMS = 2  # each rank's side streams: a shard's pieces spread over them (epoch mode)
PIECES = 3  # pieces per shard (of at least 256 rows each: shards of more rows travel in several)
ROW_SCALE = 300  # the tests' row counts are in units of this many rows, so shards span several pieces


class Event:
    """A CUDA event: a wait waits for the last record enqueued before it."""

    def __init__(self) -> None:
        self.enqueued = self.done = 0

    def record(self, stream: "Stream") -> None:
        self.enqueued += 1
        stream.ops.append(("record", self))


class Stream:
    def __init__(self, gpu: "Gpu", name: str) -> None:
        self.gpu, self.name, self.ops = gpu, name, collections.deque()

    def wait_event(self, event: Event) -> None:
        self.ops.append(("wait_event", event, event.enqueued))


class Gpu:
    """Every rank's streams, the flags in every rank's memory, and the scheduler."""

    def __init__(self, world: int, graph_safe: bool) -> None:
        self.flags: dict = collections.defaultdict(int)
        for owner in range(world):  # SignalBoard's initial FREED row
            for slot in range(world):
                self.flags[(owner, symm.SignalBoard.FREED, slot)] = 1 if graph_safe else 0
        self.current = [Stream(self, f"rank {r} current") for r in range(world)]
        self.sides = [[Stream(self, f"rank {r} side {n}") for n in range(COPY_STREAMS)] for r in range(world)]
        self.own_sides = [Stream(self, f"rank {r} own copy") for r in range(world)]
        self.collectives = [0] * world  # collectives each rank has reached (executed or at a stream's head)
        self.failures: list = []

    def streams(self) -> list:
        return self.current + [side for sides in self.sides for side in sides] + self.own_sides

    def ready(self, op) -> bool:
        kind = op[0]
        if kind == "wait_value":
            return self.flags[op[1]] >= op[2]
        if kind == "wait_event":
            return op[1].done >= op[2]
        if kind == "collective":
            return all(reached > op[1] for reached in self.collectives)
        if kind == "gemm":
            return all(self.flags[flag] >= epoch for flag, epoch in op[1])
        return True

    def execute(self, op) -> None:
        kind = op[0]
        if kind == "write_value":
            self.flags[op[1]] = op[2]
        elif kind == "copy":
            ctypes.memmove(op[1], op[2], op[3])
        elif kind == "record":
            op[1].done += 1
        elif kind in ("tag", "gemm"):
            op[2]()

    def run(self, rng: random.Random) -> None:
        """Execute operations in a random order the dependencies allow, until every stream is empty. Each
        stream gets a random pace (some far slower than others), so one rank or copy engine running far
        ahead of another, where ordering bugs show, is a common schedule rather than a rare one."""
        pace = {s.name: rng.choice([1.0, 1.0, 0.02]) for s in self.streams()}
        while any(s.ops for s in self.streams()):
            for rank, stream in enumerate(self.current):  # a rank reaches a collective when it is at the head
                if stream.ops and stream.ops[0][0] == "collective":
                    self.collectives[rank] = max(self.collectives[rank], stream.ops[0][1] + 1)
            goable = [s for s in self.streams() if s.ops and self.ready(s.ops[0])]
            if not goable:
                heads = {s.name: s.ops[0][:2] if s.ops[0][0] != "gemm" else "gemm" for s in self.streams() if s.ops}
                raise AssertionError(f"hang: no stream can go; heads {heads}")
            stream = rng.choices(goable, weights=[pace[s.name] for s in goable])[0]
            self.execute(stream.ops.popleft())


@pytest.fixture
def simulated_driver(monkeypatch):
    """Route the pusher's driver calls and stream lookups to the simulated GPU."""
    state = {"rank": 0, "gpu": None}
    monkeypatch.setattr(symm, "wait_flag_at", lambda s, a, v: s.ops.append(("wait_value", a, v)))
    monkeypatch.setattr(symm, "write_flag_at", lambda s, a, v: s.ops.append(("write_value", a, v)))
    monkeypatch.setattr(symm, "copy_async", lambda s, d, src, n: s.ops.append(("copy", d, src, n)))
    monkeypatch.setattr(symm, "stream_handle", lambda s: s)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: state["gpu"].current[state["rank"]])
    monkeypatch.setattr(symm, "raw_current_stream", lambda device: id(state["gpu"].current[state["rank"]]))
    return state


def _tag(rank: int, call: int) -> float:
    return float(1000 * call + rank + 1)


class Job:
    """World ranks running AG-MoE's transport: each call, tokens tagged, pushed, a collective, a GEMM, finish."""

    def __init__(self, state: dict, world: int, capacity: int, graph_safe: bool) -> None:
        self.state, self.world, self.graph_safe = state, world, graph_safe
        self.gpu = state["gpu"] = Gpu(world, graph_safe)
        self.spaces = workspaces(world, capacity * ROW_SCALE, WIDTH, graph_safe)
        self.tokens = [torch.zeros(capacity * ROW_SCALE, WIDTH) for _ in range(world)]
        self.pushers = [simulated_pusher(r, self.spaces, graph_safe, sides=tuple(self.gpu.sides[r]),
                                         own_side=self.gpu.own_sides[r], ready=Event(),
                                         pushed=[Event() for _ in range(COPY_STREAMS + 1)]) for r in range(world)]
        self.collective = 0
        self.checked = 0

    def enqueue_call(self, rows: tuple, call: list) -> None:
        """Every rank's host side of one call (``call[0]``: the call number the tags and checks use when run);
        ``rows`` in units of ROW_SCALE rows."""
        rows = tuple(r * ROW_SCALE for r in rows)
        for rank in range(self.world):
            self.state["rank"] = rank
            pusher, current = self.pushers[rank], self.gpu.current[rank]
            local = self.tokens[rank][: rows[rank]]
            current.ops.append(("tag", None, lambda r=rank, n=rows[rank]: self.tokens[r][:n].fill_(_tag(r, call[0]))))
            workspace = pusher.gather(local, rows, PIECES, include_own=True)
            current.ops.append(("collective", self.collective))
            plan = pusher._plan
            waits = [(flag, pusher.epoch) for flags in plan.shard_flags for flag in flags]
            current.ops.append(("gemm", waits, lambda r=rank, w=workspace: self.check(r, w, rows, call[0])))
            pusher.finish()
        self.collective += 1

    def check(self, rank: int, workspace: torch.Tensor, rows: tuple, call: int) -> None:
        start = 0
        for shard, count in enumerate(rows):
            got = workspace[start: start + count]
            if count and not bool((got == _tag(shard, call)).all()):
                self.gpu.failures.append(f"call {call}: rank {rank} read rank {shard}'s rows holding "
                                         f"{sorted(set(got.flatten().tolist()))}, not tag {_tag(shard, call)}")
            start += count
        self.checked += 1


LAYOUTS = [(3, 5), (4, 0, 2), (0, 6, 1, 3), (2, 2, 2, 2)]


@pytest.mark.parametrize("graph_safe", [True, False], ids=["graph-safe", "epochs"])
@pytest.mark.parametrize("seed", range(12))
def test_eager_calls_with_changing_rows_read_this_calls_tokens_and_never_hang(simulated_driver, graph_safe, seed):
    rng = random.Random(seed)
    world = [2, 3, 4][seed % 3]
    layouts = [r for r in LAYOUTS if len(r) == world] or [tuple(rng.randrange(0, 5) for _ in range(world))]
    job = Job(simulated_driver, world, 16, graph_safe)
    calls = 0
    for burst in range(3):  # bursts of calls enqueued back to back, then run in a random interleaving
        for _ in range(6):
            rows = tuple(rng.randrange(0, 5) for _ in range(world)) if rng.random() < 0.5 else rng.choice(layouts)
            calls += 1
            job.enqueue_call(rows, [calls])
        job.gpu.run(rng)
    assert job.gpu.failures == []
    assert job.checked == calls * world
    if graph_safe:  # finish reset every arrival flag: none is left set for a later call to pass early
        assert all(v == 0 for (owner, row, slot), v in job.gpu.flags.items() if row == symm.SignalBoard.ARRIVED)


@pytest.mark.parametrize("seed", range(100))
def test_a_rank_idle_for_one_call_does_not_unpair_the_graph_safe_handshake(simulated_driver, seed):
    """Rows (4, 4), then (4, 0), then (4, 4) again, all enqueued before any runs: rank 1 sends nothing
    in the second call, yet rank 0 still tells it "read it" after that call. Unless rank 1 takes part
    in that call's handshake too, the extra signal can land late and let rank 1's push of the fourth
    call overwrite rows rank 0's third GEMM has not read yet."""
    job = Job(simulated_driver, 2, 16, graph_safe=True)
    for call, rows in enumerate([(4, 4), (4, 0), (4, 4), (4, 4), (4, 4), (4, 0), (4, 4)], start=1):
        job.enqueue_call(rows, [call])
    job.gpu.run(random.Random(seed))
    assert job.gpu.failures == []


def _replay(state: dict, rows: tuple, graph_safe: bool, seed: int, replays: int = 5) -> list:
    """One call captured (its operations enqueued once) and replayed: the same operations with the same
    values, each replay's event waits pointing at that replay's records, tags of the replay's call."""
    rng = random.Random(seed)
    job = Job(state, len(rows), 16, graph_safe)
    job.enqueue_call(rows, [0])  # eager warm-up, as before torch.cuda.graph
    job.gpu.run(rng)
    call = [1]
    job.enqueue_call(rows, call)  # the capture
    captured = {s.name: list(s.ops) for s in job.gpu.streams()}
    for s in job.gpu.streams():
        s.ops.clear()
    records = collections.Counter(op[1] for ops in captured.values() for op in ops if op[0] == "record")
    for replay in range(replays):
        call[0] = 1 + replay  # (read by the tag and check operations when they run)
        for s in job.gpu.streams():
            s.ops.extend(("wait_event", op[1], op[2] + replay * records[op[1]]) if op[0] == "wait_event"
                         else ("collective", op[1] + replay) if op[0] == "collective" else op
                         for op in captured[s.name])
        job.gpu.run(rng)  # replays run one after another here; a graph's launches on one stream do too
    return job.gpu.failures


@pytest.mark.parametrize("rows", [(3, 5), (4, 0, 2), (2, 2, 2, 2)], ids=str)
@pytest.mark.parametrize("seed", range(6))
def test_graph_safe_calls_replayed_as_a_graph_read_each_replays_tokens(simulated_driver, rows, seed):
    assert _replay(simulated_driver, rows, graph_safe=True, seed=seed) == []


def test_epoch_calls_replayed_as_a_graph_read_stale_tokens(simulated_driver):
    """The reason graph_safe exists: a replay repeats the captured epoch, so a GEMM passes the flag the
    previous replay set and reads rows still holding that replay's tokens (in some interleaving)."""
    stale = [_replay(simulated_driver, (3, 5), graph_safe=False, seed=seed) for seed in range(10)]
    assert any(stale), "replayed epoch flags should have let some GEMM read the previous replay's tokens"
    assert all("not tag" in failure for failures in stale for failure in failures)
