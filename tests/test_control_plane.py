"""The tuner's control plane over the rendezvous store, on 2 ranks (gloo on CPUs, NCCL on GPUs): collectives,
posts, decisions, progress, gathers that wait for nobody, and a store that stays small."""

from __future__ import annotations

import json

import numpy as np

from disttune.comm import LocalComm, start_gather_floats
from disttune.unseen import NewKeyVotes
from helpers import describe, run_launch, write_script

PLANE_SCRIPT = """
    import json, sys, time
    import torch.distributed as dist
    from disttune import dist as dt_dist
    from disttune.comm import TorchComm

    dt_dist.init()
    comm = TorchComm(timeout_s=20)
    r = comm.rank
    out = {"rank": r}
    out["floats"] = comm.all_gather_floats([r, 0.5], "floats").tolist()
    out["objects"] = comm.all_gather_objects({"rank": r, "key": (64, "torch.float16"), "failed": {2: "x"}}, "objects")
    comm.barrier("barrier")
    for i in range(200):
        comm.all_gather_floats([float(i)], "many")
    comm.barrier("after many")
    keys = [f"disttune/all/plane/c/{i}/{k}" for i in range(210) for k in "dnk"]
    deadline = time.monotonic() + 10  # the last arriver deletes on its watch thread, off the collective's path
    while (left := sum(comm.store.check([key]) for key in keys)) > 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    out["keys_left"] = left
    comm.watch("call#0")  # a tuning call's channel: posts, a decision, progress
    if r == 1:
        comm.post("call#0", "note", {"step": "x", "lines": ["rank 1: ValueError: boom"]})
    comm.barrier("after the post")
    out["peers_posted"] = comm.peers_posted("call#0")
    out["posted"] = {str(k): v for k, v in comm.posted("call#0", "note").items()}
    out["undecided"] = comm.decided("call#0", "other")
    out["decided"] = comm.decide("call#0", "verdict", {"from": r})
    out["read_back"] = comm.decided("call#0", "verdict")
    comm.note_progress("call#0", 3 + r)
    comm.barrier("after progress")
    out["progress"] = {str(k): v for k, v in comm.progress("call#0").items()}
    comm.watch(None)
    finish = comm.start_gather_floats([10.0 + r], "async", "votes")  # waits for nobody now
    if r == 1:
        time.sleep(0.5)  # rank 0 has long gone on: its start did not wait for rank 1
    out["async"] = finish().tolist()
    with open(f"{sys.argv[1]}/plane-{r}.json", "w") as handle:
        json.dump(out, handle)
    dt_dist.destroy()
"""


def test_the_store_plane_on_two_ranks(tmp_path):
    script = write_script(tmp_path, PLANE_SCRIPT)
    proc = run_launch(["--nproc_per_node=2", str(script), str(tmp_path)], timeout=120)
    assert proc.returncode == 0, describe(proc)
    ranks = [json.loads((tmp_path / f"plane-{r}.json").read_text()) for r in range(2)]
    for seen in ranks:
        assert seen["floats"] == [[0.0, 0.5], [1.0, 0.5]]
        assert seen["objects"] == [{"rank": r, "key": [64, "torch.float16"], "failed": {"2": "x"}} for r in range(2)]
        # of 204 collectives, the last one's three keys stay behind (each one's last arriver deletes the one before)
        assert seen["keys_left"] == 3, seen
        assert seen["posted"] == {"1": {"step": "x", "lines": ["rank 1: ValueError: boom"]}}
        assert seen["progress"] == {"0": 3, "1": 4}
        assert seen["async"] == [[10.0], [11.0]]
    assert [seen["peers_posted"] for seen in ranks] == [True, False]  # rank 1's own post is not a peer's
    assert ranks[0]["decided"] == ranks[1]["decided"]  # the first decision stands for both
    assert [seen["read_back"] for seen in ranks] == [ranks[0]["decided"]] * 2
    assert [seen["undecided"] for seen in ranks] == [None, None]


class _Recording(LocalComm):
    """A world of one whose gathers are recorded (what the agreement points hand the communicator)."""

    def __init__(self, peers: list[float]) -> None:
        self.peers, self.sent = peers, []
        self.world_size = 1 + len(peers)

    def all_gather_floats(self, values, step):
        self.sent.append(list(values))
        return np.array([list(values)] + [[p] for p in self.peers], dtype=np.float64)


def test_new_key_votes_tune_a_period_at_the_next_point_when_every_rank_named_the_same_call():
    comm = _Recording(peers=[5.0])
    votes = NewKeyVotes("step")
    assert votes.point(comm, (5, "args of the fifth call")) is None  # gathered now, decided at the next point
    assert votes.point(comm, None) == (5, "args of the fifth call")  # every rank named the fifth call: tune it now
    assert votes.point(comm, (7, "args of the seventh call")) is None  # the last period met nothing here
    assert votes.point(comm, None) is None  # rank 1 named the fifth call again, this rank the seventh: no agreement
    assert comm.sent == [[5.0], [-1.0], [7.0], [-1.0]]


def test_a_communicator_without_its_own_start_gathers_at_once():
    comm = _Recording(peers=[2.0])
    finish = start_gather_floats(comm, [2.0], "x", "channel")
    assert comm.sent == [[2.0]]
    np.testing.assert_array_equal(finish(), [[2.0], [2.0]])
