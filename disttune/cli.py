"""The ``disttune`` command: demo, report, and winner-store management (show, export, import, clear).

Holds no tuning logic: each subcommand calls the library (``store``, ``report``) or
launches the example through ``scripts/launch.sh``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from . import store

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMOS = {"ag_gemm": "examples/ag_gemm.py", "tp_mlp": "examples/tp_mlp.py"}


def _age(created: Optional[float]) -> str:
    if not created:
        return "?"
    seconds = max(0.0, time.time() - created)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def cmd_demo(args: argparse.Namespace) -> int:
    if args.kernel not in DEMOS:
        print(f"disttune demo: there is no {args.kernel!r} demo; available: {', '.join(DEMOS)}",
              file=sys.stderr)
        return 2
    launcher, example = REPO_ROOT / "scripts" / "launch.sh", REPO_ROOT / DEMOS[args.kernel]
    if not launcher.exists() or not example.exists():
        print(f"disttune demo: needs a source checkout (missing {launcher} or {example}); "
              "clone the repository and pip install -e it", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir or os.environ.get("DISTTUNE_LOG_DIR") or "logs").resolve()
    env = {**os.environ, "DISTTUNE_LOG_DIR": str(log_dir)}
    command = ["bash", str(launcher)] + ([f"--nproc_per_node={args.nproc}"] if args.nproc else []) + [str(example)]
    code = subprocess.call(command + list(args.example_args), env=env)
    if code != 0:
        return code
    from .report import build_report

    report = build_report(log_dir)
    print(f"report: {report.markdown_path}" + (f" ({len(report.plots)} plots)" if report.plots else ""))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .report import build_report

    try:
        report = build_report(args.log_dir, args.out)
    except FileNotFoundError as err:
        print(f"disttune report: {err}", file=sys.stderr)
        return 1
    print(f"report: {report.markdown_path}")
    for plot in report.plots:
        print(f"plot: {plot}")
    for problem in report.problems:
        print(f"problem: {problem}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    rows = list(store.iter_records(args.cache_dir))
    root = store.resolve_cache_dir(args.cache_dir)
    if not rows:
        print(f"no stored winners under {root}")
        return 0
    print(f"stored winners under {root}:")
    for path, record, problem in rows:
        if record is None or problem:
            print(f"  UNUSABLE {path}: {problem}")
            continue
        fingerprint = record.get("fingerprint", {})
        print(f"  {record['name']} key={record['key']} occ={record.get('occurrence', 0)} -> "
              f"{record.get('winner_config', record['winner'])}  [{fingerprint.get('gpu') or 'cpu'}, "
              f"world {fingerprint.get('world_size')}, triton {fingerprint.get('triton')}, "
              f"age {_age(record.get('created'))}, env {path.stem.split('-')[-1]}]")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    count = store.export_table(args.file, args.cache_dir)
    print(f"exported {count} winner(s) to {args.file}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    try:
        count = store.import_table(args.file, args.cache_dir)
    except ValueError as err:
        print(str(err), file=sys.stderr)
        return 1
    print(f"imported {count} winner(s) into {store.resolve_cache_dir(args.cache_dir)}")
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    removed = 0
    for path, record, _ in store.iter_records(args.cache_dir):
        if args.kernel and (record is None or args.kernel not in record.get("name", "")):
            continue
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".lock").unlink(missing_ok=True)
        removed += 1
    print(f"removed {removed} entr{'y' if removed == 1 else 'ies'} from {store.resolve_cache_dir(args.cache_dir)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disttune", description="Tune Triton kernels across ranks, in context.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="launch the 2-rank contextual tuning demo and write its report")
    demo.add_argument("--nproc", type=int, default=None, help="ranks (default: GPUs present, else 2)")
    demo.add_argument("--kernel", default="ag_gemm", help="which example: " + ", ".join(DEMOS))
    demo.add_argument("--log-dir", default=None, help="where the per-rank logs go (default: $DISTTUNE_LOG_DIR or logs)")
    demo.add_argument("example_args", nargs=argparse.REMAINDER, help="passed to the example (e.g. --M 4096)")
    demo.set_defaults(run=cmd_demo)

    report = sub.add_parser("report", help="merge rank-*.log into a Markdown report with plots")
    report.add_argument("log_dir", nargs="?", default=os.environ.get("DISTTUNE_LOG_DIR", "logs"))
    report.add_argument("--out", default=None, help="report directory (default: LOG_DIR/report)")
    report.set_defaults(run=cmd_report)

    for name, handler, text in (("show", cmd_show, "list stored winners with fingerprint and age"),
                                ("export", cmd_export, "write every stored winner into one JSON table"),
                                ("import", cmd_import, "copy a JSON winners table into the store"),
                                ("clear", cmd_clear, "delete stored winners")):
        command = sub.add_parser(name, help=text)
        if name in ("export", "import"):
            command.add_argument("file", help="the JSON winners table")
        if name == "clear":
            command.add_argument("--kernel", default=None, help="only entries whose name contains this text")
        command.add_argument("--cache-dir", default=None, help="store directory (default: $DISTTUNE_CACHE_DIR or "
                                                               "the per-user cache)")
        command.set_defaults(run=handler)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
