"""torchrun, whose report of a failed job is one line: what ``scripts/launch.sh`` runs.

    python scripts/torchrun_one_line.py TORCHRUN-ARGS... script.py [ARGS...]

Runs ``torch.distributed.run`` (torchrun) in this process with the same arguments. When ranks fail, torchrun
logs each failure and raises ``ChildFailedError``, whose traceback and table run to some 30 lines after the
ranks' own errors; here its failure logs are left out and the table becomes one line on stderr,

    launch.sh: ranks 0, 1 exited with status 1; exit status 1

and the exit status is the first failed rank's (128 + N for a rank killed by signal N). The ranks' own output
is untouched: a disttune error is already one line per job (:mod:`disttune.startup`). ``DISTTUNE_TRACEBACK=1``
(which :mod:`disttune.startup` reads too) runs torchrun as it is, report and all.
"""

from __future__ import annotations

import logging
import os
import sys


def exit_status(exitcode: int) -> int:
    """A shell's exit status for a rank's: the code itself, or 128 + N for a rank killed by signal N."""
    return exitcode if exitcode >= 0 else 128 - exitcode


def ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def summary(failures: dict) -> tuple[str, int]:
    """The line for torchrun's ``failures`` (global rank -> ``ProcessFailure``) and the job's exit status.

    A rank that ended by SIGTERM after another failed is one torchrun stopped; it is named as such."""
    first_rank, first = min(failures.items(), key=lambda item: (item[1].timestamp, item[1].exitcode == -15, item[0]))
    stopped = sorted(r for r, f in failures.items() if f.exitcode == -15 and r != first_rank)
    by_outcome: dict[str, list[int]] = {}
    for rank, failure in sorted(failures.items()):
        if rank not in stopped:
            code = failure.exitcode
            by_outcome.setdefault(f"exited with status {code}" if code >= 0 else f"killed by {failure.signal_name()}",
                                  []).append(rank)
    line = "; ".join(f"{ranks_text(ranks)} {outcome}" for outcome, ranks in by_outcome.items())
    if stopped:
        line += f" (then torchrun stopped {ranks_text(stopped)})"
    status = exit_status(first.exitcode) or 1
    return f"launch.sh: {line}; exit status {status}", status


def main(argv: list[str]) -> int:
    from torch.distributed.run import main as torchrun, parse_args, run

    if os.environ.get("DISTTUNE_TRACEBACK", "0") not in ("", "0"):
        torchrun(argv)
        return 0
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # torchrun logs each failed rank and the closing of the others: the line below says it once
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as failed:
        line, status = summary(failed.failures)
        print(line, file=sys.stderr, flush=True)
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
