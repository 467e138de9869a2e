"""A job over two nodes, both on this host: two torchrun agents (``scripts/launch.sh`` with ``NNODES=2`` and
their own ``NODE_RANK``) meet at one rendezvous endpoint, 2 ranks each. Each node has a store folder of its
own, as nodes with local disks do. Bounded in wall time; the agents are killed as a whole on timeout.
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest

from helpers import describe, failure, read_records, run_launch

CASES = Path(__file__).with_name("file_cases.py")
PER_NODE = 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_two_nodes(out: Path, cases: list[str], timeout: float = 300) -> dict:
    port, procs = free_port(), {}

    def agent(node: int) -> None:
        procs[node] = run_launch([f"--nproc_per_node={PER_NODE}", str(CASES), *cases, "--out", str(out)],
                                 timeout=timeout,
                                 extra_env={"NNODES": "2", "NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1",
                                            "MASTER_PORT": str(port), "DISTTUNE_TIMEOUT": "60"})

    agents = [threading.Thread(target=agent, args=(node,)) for node in (0, 1)]
    for thread in agents:
        thread.start()
    for thread in agents:
        thread.join()
    for node in (0, 1):
        assert node in procs, f"node {node}'s agent raised (see the output above)"
        assert procs[node].returncode == 0, describe(procs[node])
    return read_records(out, cases, range(2 * PER_NODE), procs[0])


@pytest.mark.slow
def test_two_nodes_share_compiles_per_node_and_write_the_store_once(tmp_path):
    out = tmp_path / "out"
    results = launch_two_nodes(out, ["nodes_node_writer", "nodes_global_writer"])
    for case, per_rank in results.items():
        for rank, result in enumerate(per_rank):
            assert result["ok"], failure(result)
            assert (result["node"], result["local_rank"], result["local_world"]) == (rank // 2, rank % 2, 2)
            assert result["source"] == "tuned" and result["output_ok"]
        assert {r["winner"] for r in per_rank} == {2}, [r["winner"] for r in per_rank]

        # compile_split: each node's two ranks split the candidates between them (not the world's four),
        # and every rank's share is done before any rank compiles the rest (the host clock is shared)
        blocks, share_ended, rest_started = per_rank[0]["blocks"], [], []
        for result in per_rank:
            mine = [blocks[0]] + [b for i, b in enumerate(blocks) if i >= 1 and (i - 1) % 2 == result["local_rank"]]
            compiled = sorted(block for block, _, _ in result["calls"])
            assert compiled == sorted(blocks), f"rank {result['rank']}: every config compiled once: {compiled}"
            share_ended += [end for block, _, end in result["calls"] if block in mine]
            rest_started += [start for block, start, _ in result["calls"] if block not in mine]
        assert max(share_ended) <= min(rest_started), [r["calls"] for r in per_rank]

    # one writer per node with store_writer="node"; rank 0 alone with "global"
    node_files = {node: sorted((out / "nodes-node" / f"node{node}").glob("*/*.json")) for node in (0, 1)}
    global_files = {node: sorted((out / "nodes-global" / f"node{node}").glob("*/*.json")) for node in (0, 1)}
    assert [len(node_files[0]), len(node_files[1])] == [1, 1], node_files
    assert [len(global_files[0]), len(global_files[1])] == [1, 0], global_files
    record = json.loads(node_files[1][0].read_text())
    fingerprint = record["fingerprint"]
    assert (fingerprint["world_size"], fingerprint["ranks_per_node"]) == (4, 2)
    assert "driver" in fingerprint and "nccl" in fingerprint, fingerprint
    assert record["winner"] == 2 and record["source_digest"]
