"""How a tuning call that fails on some rank ends on every rank: the same error, within seconds, no stuck GPU.

A rank can fail where its peers are elsewhere: inside the user's own collective, behind it on the
GPU, or in a collective of the tuner. Every rank then ends with the same exception, decided once:

1. **Posting.** A rank that brings an error posts it on the tuning call's channel
   (:meth:`~disttune.comm.ControlPlane.post`). A peer waiting anywhere in the tuner (a collective,
   a wait on the GPU) reads the post within 0.1 s and leaves its wait.
2. **Settling.** Each rank then says whether its GPU has finished its work (``drained``: it does
   within :data:`DRAIN_S`) or not (``stuck``: queued behind a collective some peer never entered),
   and waits up to :data:`SETTLE_S` for every rank to say so. A rank whose main thread is held up
   elsewhere (blocked in the user's code, say) cannot answer; its *watcher*, which reads the channel's
   posts from the process's watch thread while a tuning call runs, answers ``blocked`` for it once a
   peer's post has stood for :data:`GRACE_S`.
3. **The verdict.** Any rank that is not ``drained``, or did not answer, means the job's process
   groups can never complete their next collective: they are aborted on every rank
   (``torch.distributed``'s ``_abort_process_group``; NCCL's own watchdog would abort them minutes
   later with no cause). The first rank to settle writes the verdict (exception type, text, abort or
   not) into the rendezvous store; every rank raises exactly that one. A rank that arrives late (a
   stalled rank, a rank freed by the abort) raises the verdict standing there.

**A stall where gloo holds the peers.** A rank that stalls before the function's own collective leaves its gloo
peers inside that collective, whose host thread nothing can free but the process group's own timeout
(:func:`disttune.dist.group_timeout_s`: the tuner's timeout and a few seconds). The error that timeout raises is a
consequence: each post says whether its rank's error is such a timeout, met after longer than the tuner's timeout
in the wrapped function (``held_up``: :func:`held_up`). When every post is held up and some ranks neither
posted nor finished (their watcher answered ``blocked``, or nothing did), the verdict is a
:class:`~disttune.comm.CollectiveTimeout` naming those ranks, the posted errors after it (:func:`describe_stall`).

Every verdict that carries the ranks' errors has the one wording of :func:`~disttune.errors.failed_on_ranks`,
headed by where the first failing rank failed (its post says so), so a fault reads the same whichever rank
settled first and whichever tuner raised it.

When the rendezvous store itself is gone (:class:`~disttune.comm.ControlPlaneLost`) nothing can be posted or
decided: each surviving rank raises that error at once, naming the step it was in, and aborts its groups.

Cost: nothing while nothing fails, but a watcher per tuning call that reads one store counter every 0.1 s
(every :attr:`~disttune.storeplane.StorePosts.post_poll_s` in a large job), run by the process's one
:class:`~disttune.storeplane.WaitWatch` thread: no thread is started per call. On failure: up to :data:`DRAIN_S`
for the GPU, up to :data:`SETTLE_S` for the peers.
MPI and a world of one have no rendezvous store: their errors are left as the collectives give them.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Optional

from . import device
from .comm import CollectiveTimeout, Communicator, ControlPlane, ControlPlaneLost, MalformedMessage, PeerFailed
from .errors import CALL_FAILED, TuningError, failed_on_ranks
from .sites import AllConfigsFailed
from .storeplane import wait_watch

#: How long a peer's post stands before the watcher answers for a main thread held up elsewhere.
GRACE_S = 1.0
#: How long a settling rank gives its GPU to finish before it calls itself stuck.
DRAIN_S = 1.0
#: How long a settling rank waits for every rank to settle.
SETTLE_S = 2.5
#: What a verdict that aborted the process groups adds to its text.
ABORTED = ("\nThe job's process groups were aborted on every rank: a GPU waited for a collective that a peer never "
           "entered, or a rank could not reach the tuner. Create the process group again "
           "(disttune.dist.init, or torch.distributed.init_process_group) before its next collective, or end the job.")

_KINDS = {"TuningError": TuningError, "CollectiveTimeout": CollectiveTimeout, "AllConfigsFailed": AllConfigsFailed}


def abort_process_groups() -> None:
    """Abort every process group of this process (frees a GPU stream stuck behind a collective, and closes
    the sockets a peer's gloo collective waits on); nothing when none exists."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d
    except ImportError:
        return
    if not dist.is_available() or not dist.is_initialized():
        return
    abort = getattr(distributed_c10d, "_abort_process_group", None)
    try:
        abort() if abort is not None else dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - an abort that fails leaves the groups to NCCL's watchdog, as before
        pass


def describe(name: str, err: BaseException, step: Optional[str], failed: Optional[str], notes: dict[int, Any]
             ) -> dict[str, str]:
    """A rank's candidate verdict for ``err`` (met at ``step``, where its own errors arose as ``failed``), given the
    ``notes`` posted so far by rank. An error every rank computed alike (from a completed collective) stands as
    it is; otherwise every posted error, headed by where the lowest posting rank failed, and the timeout if one
    ended the wait."""
    if isinstance(err, (TuningError, AllConfigsFailed)):
        return {"type": type(err).__name__, "text": str(err)}
    timeout = str(err).replace("disttune: ", "", 1) if isinstance(err, CollectiveTimeout) else ""
    posted_failed, lines = None, []
    for rank in sorted(notes):
        note = notes[rank]
        if isinstance(note, dict) and isinstance(note.get("lines"), list):
            lines.extend(str(line) for line in note["lines"])
            if posted_failed is None and isinstance(note.get("failed"), str):
                posted_failed = note["failed"]
        else:  # not disttune's plain data: one line naming the rank that sent it
            lines.append(str(note) if isinstance(note, MalformedMessage) else
                         f"disttune: rank {rank} posted a note that is not disttune's ({type(note).__name__})")
    if lines:
        what = posted_failed or failed or (f"{step} failed" if step else CALL_FAILED)
        lines += [timeout] if timeout else []
        return {"type": "TuningError", "text": failed_on_ranks(name, what, list(notes), lines)}
    if timeout:
        return {"type": "CollectiveTimeout", "text": f"disttune: {name}: {timeout}"}
    if isinstance(err, PeerFailed):
        return {"type": "TuningError", "text": f"disttune: {name}: rank(s) {list(err.ranks)} left the tuning call at "
                                               f"step '{step}' with no error posted"}
    return {"type": "TuningError", "text": f"disttune: {name}: {type(err).__name__}: {err}"}


def held_up(raised: Optional[BaseException], away_s: float, timeout_s: float) -> bool:
    """Whether ``raised`` ended a wait that held a rank in the wrapped function past the tuner's ``timeout_s``: a
    timeout of the process group's (gloo's reads ``Timed out waiting ...``), met ``away_s`` after the call's last
    collective, more than ``timeout_s``."""
    return isinstance(raised, RuntimeError) and "timed out" in str(raised).lower() and away_s > timeout_s


def describe_stall(name: str, notes: dict[int, Any], answers: dict[int, Any], world_size: int, timeout_s: float
                   ) -> Optional[dict[str, str]]:
    """The verdict of a stall that held the posting ranks inside the wrapped function (see the module doc), given
    the ``notes`` and the settle ``answers`` by rank; None when the posts do not tell of one."""
    if not notes or not all(isinstance(note, dict) and note.get("held_up") is True for note in notes.values()):
        return None
    stalled = [rank for rank in range(world_size) if rank not in notes and answers.get(rank) in (None, "blocked")]
    if not stalled:
        return None
    first = notes[min(notes)]
    lines = [str(line) for rank in sorted(notes) for line in notes[rank].get("lines") or []]
    return {"type": "CollectiveTimeout",
            "text": f"disttune: {name}: step '{first.get('step')}': rank(s) {stalled} did not arrive within "
                    f"{timeout_s:g} s (a rank died, hung, or skipped the step); rank(s) {sorted(notes)} waited for "
                    "them inside the wrapped function until the process group's own timeout ended the wait:\n  "
                    + "\n  ".join(lines)}


class Ending:
    """The ending of one tuning call of ``name`` on ``channel`` over ``comm`` (see the module doc).

    Use as a context manager around the call: it runs the watcher, and an exception leaving the call
    leaves it as the verdict (:meth:`conclude`). :meth:`settle` turns an exception into the one every
    rank raises; :meth:`check` (which every wait of the call makes first) raises the verdict if the watcher
    has already settled. ``failed`` arguments say where a rank's errors arose, for the verdict's heading
    (``"tuning run 4/9 failed"``; see :func:`~disttune.errors.failed_on_ranks`).
    """

    def __init__(self, comm: Communicator, name: str, channel: str) -> None:
        self.plane: Optional[ControlPlane] = comm if isinstance(comm, ControlPlane) and comm.world_size > 1 else None
        self.name, self.channel = name, channel
        self._lock = threading.Lock()
        self._state: Optional[str] = None  # "settling" (the main thread), or "blocked" (the watcher answered)
        self._verdict: Optional[BaseException] = None
        self._stopped = False  # the call has left: the watcher no longer answers for this rank
        self._looking = threading.Lock()  # held by a look of the watcher; the call's exit waits for it
        self._watched: Optional[int] = None  # the watcher's number on the process's watch thread
        self._first_post: Optional[float] = None  # when the watcher first saw a peer's post
        self.step: Optional[str] = None  # the last step this rank's main thread entered (it names a lost store)
        self._resumed_at = time.monotonic()  # when the main thread last went back to the wrapped function

    def __enter__(self) -> "Ending":
        if self.plane is not None:
            self.plane.watch(self.channel)
            self._watched = wait_watch().watch(math.inf, self._look, lambda: None,
                                               getattr(self.plane, "post_poll_s", 0.1))  # longer on a large job
        return self

    def __exit__(self, kind: Any, err: Optional[BaseException], traceback: Any) -> None:
        """Stop the watcher; an exception leaving the call becomes the verdict (:meth:`conclude`)."""
        ended = self.conclude(err) if err is not None else None
        with self._looking:  # a look under way (its post and abort) finishes first; later ones do nothing
            self._stopped = True
        if self._watched is not None:
            wait_watch().cancel(self._watched)
        if self.plane is not None:
            self.plane.watch(None)
        if isinstance(ended, ControlPlaneLost):
            raise ended from None  # the one error of this rank: torch's reason is in its text
        if ended is not None and ended is not err:
            raise ended from err

    # -- posting ---------------------------------------------------------------------------------------------

    def resumed(self) -> None:
        """A collective of the call has completed: until this rank's next post its main thread is in the wrapped
        function (or the tuner's own work between runs)."""
        self._resumed_at = time.monotonic()

    def post_errors(self, step: str, lines: list[str], failed: Optional[str] = None,
                    raised: Optional[BaseException] = None) -> None:
        """Post this rank's ``lines`` (each ``"rank r: ..."``, its own exception first) on the channel, for peers
        waiting anywhere; ``failed`` says where they arose (default: ``step`` failed), ``raised`` is the exception
        they came from, if any (is it :func:`held_up`?)."""
        if self.plane is not None and lines and self._state is None:
            away_s = time.monotonic() - self._resumed_at
            self.plane.post(self.channel, "note", {"step": step, "failed": failed or f"{step} failed", "lines": lines,
                                                   "held_up": held_up(raised, away_s, self.plane.timeout_s)})

    # -- the verdict ---------------------------------------------------------------------------------------------

    def check(self, step: str, failed: Optional[str] = None) -> None:
        """Enter ``step``: raise the verdict now if the watcher answered for this rank (what the main thread would
        bring to the step is a consequence of the abort, not news)."""
        self.step = step
        if self._state == "blocked" and self.plane is not None:
            posters = sorted(set(self.plane.posted(self.channel, "note")) | set(self.plane.posted(self.channel, "settle"))
                             - {self.plane.rank})
            raise self.settle(PeerFailed("held up while a peer failed", posters), step, failed)

    def conclude(self, err: BaseException) -> BaseException:
        """What the tuning call raises for ``err`` on this rank: the verdict, or ``err`` itself where there is none
        to settle (no rendezvous store, one rank). A ``KeyboardInterrupt`` is posted for the peers and kept here."""
        if self.plane is None:
            return err
        if isinstance(err, ControlPlaneLost):
            return self.lost(err)
        if not isinstance(err, Exception):  # Ctrl-C, SystemExit: the peers hear of it and settle without this rank
            try:
                self.post_errors("interrupted", [f"rank {self.plane.rank}: {type(err).__name__}"], CALL_FAILED)
                with self._lock:
                    answer, self._state = self._state is None, self._state or "settling"
                if answer:
                    self.plane.post(self.channel, "settle", "interrupted")
            except ControlPlaneLost:
                pass  # nobody is left to tell
            abort_process_groups()
            return err
        try:
            if not isinstance(err, (TuningError, AllConfigsFailed, CollectiveTimeout, PeerFailed)):
                self.post_errors("tuning call", [f"rank {self.plane.rank}: {type(err).__name__}: {err}"], CALL_FAILED,
                                 err)
            return self.settle(err)
        except ControlPlaneLost as lost:
            return self.lost(lost)

    def lost(self, err: ControlPlaneLost) -> ControlPlaneLost:
        """This rank's error once the rendezvous store is gone: no post, no verdict (nothing can be decided without
        the store); it names the step this rank was in, and the job's process groups are aborted."""
        if self._verdict is None:
            at = f"step '{self.step}': " if self.step else ""
            self._verdict = ControlPlaneLost(f"disttune: {self.name}: {at}{str(err).removeprefix('disttune: ')}. "
                                             "No rank can finish the tuning call: end the job and start it again.")
            abort_process_groups()
        return self._verdict  # type: ignore[return-value]

    def settle(self, err: BaseException, step: Optional[str] = None, failed: Optional[str] = None) -> BaseException:
        """The exception every rank raises for ``err`` (met at ``step``, where this rank's own errors arose as
        ``failed``): settle, decide once, abort if due."""
        if self.plane is None or self._verdict is not None:
            return self._verdict or err
        try:
            return self._settle(self.plane, err, step, failed)
        except ControlPlaneLost as lost:
            return self.lost(lost)

    def _settle(self, plane: ControlPlane, err: BaseException, step: Optional[str], failed: Optional[str]
                ) -> BaseException:
        with self._lock:
            answer = self._state is None
            if answer:
                self._state = "settling"
        if answer:
            plane.post(self.channel, "settle", "drained" if device.drained(DRAIN_S) else "stuck")
        entries = self._settled(plane)
        abort = len(entries) < plane.world_size or any(state != "drained" for state in entries.values())
        notes = plane.posted(self.channel, "note")
        candidate = (describe_stall(self.name, notes, entries, plane.world_size, plane.timeout_s)
                     or describe(self.name, err, step, failed, notes))
        verdict = plane.decide(self.channel, "verdict", {**candidate, "abort": abort})
        if verdict.get("abort"):
            abort_process_groups()
        kind = _KINDS.get(verdict.get("type"), TuningError)
        text = str(verdict.get("text")) + (ABORTED if verdict.get("abort") else "")
        self._verdict = kind(text)
        self._verdict.__cause__ = err
        return self._verdict

    def _settled(self, plane: ControlPlane) -> dict[int, Any]:
        """Every rank's settle answer, waiting up to :data:`SETTLE_S` for the missing ones, or until a peer has
        decided the verdict (it stands for every rank; a peer that hosts the store may leave soon after)."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            entries = plane.posted(self.channel, "settle")
            if len(entries) >= plane.world_size or time.monotonic() > deadline:
                return entries
            if plane.decided(self.channel, "verdict") is not None:
                return entries
            time.sleep(0.01)

    # -- the watcher ------------------------------------------------------------------------------------------------

    def _look(self) -> bool:
        """The watcher's look at the channel's posts, every ``post_poll_s`` on the process's watch thread while the
        call runs: once a peer's post has stood for :data:`GRACE_S` and this rank's main thread has not started to
        settle, answer ``blocked`` for it and abort the process groups. True: the watcher is done."""
        with self._looking:
            return self._stopped or self._answer_if_held_up()

    def _answer_if_held_up(self) -> bool:
        """The look itself (the call has not left): one read of the post counter, and the answer when it is due."""
        plane = self.plane
        assert plane is not None
        try:
            if not plane.peers_posted(self.channel):
                return False
        except Exception:  # noqa: BLE001 - the store is gone: the main thread's waits time out
            return True
        self._first_post = self._first_post or time.monotonic()
        if time.monotonic() - self._first_post < GRACE_S:
            return False
        with self._lock:
            if self._state is not None:
                return True  # the main thread is settling
            self._state = "blocked"
        try:
            plane.post(self.channel, "settle", "blocked")
        except ControlPlaneLost:
            pass  # the main thread's next wait says so
        finally:
            abort_process_groups()  # frees this rank's host if it is stuck in a CUDA call behind the GPU
        return True
