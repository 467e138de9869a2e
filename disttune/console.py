"""What the tuners show people while they work: progress bars and the summary of a tuning call.

Rank 0 prints; the others stay quiet. A bar appears only on a terminal and unless
``DISTTUNE_PROGRESS=0``; costs a tqdm update per step.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from . import env
from .configs import describe_config
from .objective import describe_measurements


def progress_bar(wanted: bool, total: Optional[int], description: str, unit: str = "run") -> Any:
    """A tqdm bar on stderr when ``wanted``, on a terminal, and not turned off by ``DISTTUNE_PROGRESS=0``;
    None otherwise (``total`` None: a bar without an end, for an iterable of unknown length)."""
    if not wanted or total == 0 or not env.progress_enabled() or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=description, unit=unit, leave=False, file=sys.stderr)


def print_summary(name: str, report: Any, reduce: str, log_path: Any) -> None:
    """Rank 0's summary of a tuning call: its cost and each site's winner with its agreed time."""
    lines = [f"disttune: tuned {name} over {report.world_size} rank(s) in {report.wall_s:.2f} s "
             f"({report.function_runs} runs of the function); log: {log_path}"]
    for r in report.results:
        agreed = f"{r.agreed_ms[r.winner]:.4f} ms agreed ({reduce})" if r.source == "tuned" else r.source
        if r.measurements:  # a measured objective: what the score saw beside the time
            agreed += f", {describe_measurements(r.measurements[r.winner])}, score {r.scores[r.winner]:.4g}"
        lines.append(f"  {r.site.kernel} {r.site.key_text()} (occurrence {r.site.occurrence}) -> "
                     f"{describe_config(r.config)}: {agreed}")
    print("\n".join(lines), file=sys.stdout, flush=True)


def print_triton_style(report: Any, rank: int) -> None:
    """What Triton prints after tuning, per site, when ``TRITON_PRINT_AUTOTUNING=1``."""
    for r in report.results:
        print(f"Triton autotuning for function {r.site.kernel} (disttune, rank {rank}),\n"
              f"with key as {r.site.key},\nfinished after {report.wall_s:.2f}s,\n"
              f"best config selected: {r.config};", flush=True)
