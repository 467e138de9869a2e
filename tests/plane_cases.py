"""Cases that both store protocols must pass (:mod:`test_store_plane`, flat; :mod:`test_node_plane`, through node
stores), each given a ``run(job, prefix, timeout_s)`` that runs ``job(rank, plane)`` on every simulated rank at once
and returns what each returned (or raised), in rank order."""

from __future__ import annotations

from typing import Any, Callable

from disttune.errors import PeerFailed

Run = Callable[..., list[Any]]


def a_post_ends_every_waiting_rank(run: Run) -> None:
    """One rank posts an error instead of arriving at a barrier: every other rank, blocked there with a timeout of
    ten minutes, leaves with the same :class:`PeerFailed` naming it (only the post can end the waits in time)."""
    poster, channel = 40, "step#0"

    def job(r: int, plane: Any) -> str:
        plane.all_gather_floats([r], "before")  # the node step's stores are open by then
        plane.watch(channel)
        if r == poster:  # fails before the barrier: posts instead of arriving
            plane.post(channel, "note", {"step": "tuning run 1/9", "lines": [f"rank {r}: ValueError: boom"]})
            return "posted"
        plane.barrier("tuning run 1/9")
        return "returned"

    results = run(job, "posts", timeout_s=600.0)
    assert results[poster] == "posted"
    errors = [result for r, result in enumerate(results) if r != poster]
    assert all(isinstance(err, PeerFailed) and err.ranks == (poster,) for err in errors), errors
    assert {str(err) for err in errors} == {"disttune: step 'tuning run 1/9': rank(s) [40] posted an error or left"}
