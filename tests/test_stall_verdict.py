"""The verdict of a stall that held the posting ranks inside the wrapped function (``disttune.ending.describe_stall``):
a CollectiveTimeout naming the ranks that neither posted nor finished, only when every post tells of such a wait."""

from __future__ import annotations

from disttune.ending import describe_stall, held_up

GLOO_TIMEOUT = "rank 0: RuntimeError: [pair.cc:1] Timed out waiting 12000ms for recv operation to complete"


def note(held_up: bool, line: str = GLOO_TIMEOUT, step: str = "tuning run 4/9") -> dict:
    return {"step": step, "failed": f"{step} failed", "lines": [line], "held_up": held_up}


def test_held_up_posts_name_the_ranks_that_never_came_back():
    verdict = describe_stall("step", {0: note(True)}, {0: "drained", 1: "blocked"}, 2, 10.0)
    assert verdict is not None and verdict["type"] == "CollectiveTimeout", verdict
    first, cause = verdict["text"].splitlines()
    assert first.startswith("disttune: step: step 'tuning run 4/9': rank(s) [1] did not arrive within 10 s"), first
    assert "rank(s) [0] waited for them" in first, first
    assert cause == "  " + GLOO_TIMEOUT, cause


def test_a_rank_that_did_not_answer_is_named_too():
    verdict = describe_stall("step", {0: note(True), 1: note(True, "rank 1: RuntimeError: Timed out")},
                             {0: "drained", 1: "drained"}, 3, 10.0)
    assert verdict is not None and "rank(s) [2] did not arrive" in verdict["text"], verdict


def test_an_error_of_its_own_is_no_stall():
    """A rank that raised on its own (its post is not held up) is the cause, though its peer is blocked."""
    own = note(False, "rank 1: ValueError: the user's own")
    assert describe_stall("step", {1: own}, {0: "blocked", 1: "drained"}, 2, 10.0) is None
    assert describe_stall("step", {0: note(True), 1: own}, {0: "drained", 1: "drained"}, 2, 10.0) is None


def test_only_a_timeout_met_after_the_tuners_timeout_is_held_up():
    timed_out = RuntimeError("[unbound_buffer.cc:78] Timed out waiting 12000ms for recv operation to complete")
    assert held_up(timed_out, 12.5, 10.0)
    assert not held_up(timed_out, 3.0, 10.0)  # a timeout of the function's own, well inside the tuner's
    assert not held_up(ValueError("bad input"), 12.5, 10.0)  # an error of its own after a long run
    assert not held_up(None, 12.5, 10.0)


def test_no_stall_when_every_rank_posted_or_finished():
    assert describe_stall("step", {0: note(True)}, {0: "drained", 1: "drained"}, 2, 10.0) is None
    assert describe_stall("step", {0: note(True), 1: note(True)}, {}, 2, 10.0) is None
    assert describe_stall("step", {}, {1: "blocked"}, 2, 10.0) is None
    assert describe_stall("step", {0: "not disttune's"}, {1: "blocked"}, 2, 10.0) is None
