"""The ``disttune`` command: demo, sweep, report, verify, and winner-store management (show, export, import,
clear).

Holds no tuning logic: each subcommand calls the library (``store``, ``report``) or
launches the example through ``scripts/launch.sh``. An error is one line on stderr,
``disttune <command>: <what went wrong>``, and a non-zero exit status; a bad argument
prints that subcommand's usage (exit status 2).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from . import env, store
from .logs import resolve_log_dir
from .configs import describe_config

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMOS = {"ag_gemm": "examples/ag_gemm.py", "tp_mlp": "examples/tp_mlp.py", "moe": "examples/moe_layer.py"}


class CommandError(Exception):
    """A failure the command reports as one line (no traceback)."""


def version_text() -> str:
    """``disttune 0.1.0 (torch 2.13.0, triton 3.6.0)``, from the installed packages' metadata (no imports)."""
    def installed(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return (f"disttune {installed('disttune')} "
            f"(torch {installed('torch')}, triton {installed('triton')})")


def _age(created: Any) -> str:
    if not isinstance(created, (int, float)) or not created:
        return "?"
    seconds = max(0.0, time.time() - created)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def check_environment(command: str) -> dict[str, str]:
    """Refuse bad ``DISTTUNE_*`` settings before any rank starts (one line, no traceback); warn of unknown ones.
    Returns what the ranks' environment adds: that the settings were checked (so the ranks do not warn again)."""
    errors, warnings = env.check_settings()
    for warning in warnings:
        print(f"disttune {command}: warning: {warning}", file=sys.stderr)
    if errors:
        raise CommandError("; ".join(errors))
    return {env.SETTINGS_CHECKED: "1"}


def sizes_problem(example: Path, argv: Sequence[str], world: int, parser: argparse.ArgumentParser) -> Optional[str]:
    """The example's own check of its arguments at ``world`` ranks (its ``parse_args`` and ``sizes_error``),
    run here before any rank starts. An argument the example refuses is an error with the demo's usage
    (``parser``'s, status 2); ``--help`` after ``--`` prints the example's help (status 0)."""
    import contextlib
    import importlib.util
    import io

    spec = importlib.util.spec_from_file_location(f"disttune_demo_{example.stem}", example)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.path.insert(0, str(example.parent))
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    finally:
        sys.path.remove(str(example.parent))
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            options = module.parse_args(list(argv))
    except SystemExit as exit_info:
        if not exit_info.code:
            raise
        refusal = said.getvalue().strip().splitlines()[-1:] or [f"bad example arguments: {' '.join(argv)}"]
        parser.error(f"{refusal[0].split(': error: ', 1)[-1]} (`disttune demo -- --help` lists the example's "
                     "arguments)")
    return module.sizes_error(options, world)


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def launch_demo(command: list[str], child_env: dict[str, str]) -> int:
    """Run the demo's ranks: their output as it comes, each rank's error once, in rank order, at the end (not every
    rank's traceback and the launcher's report, which are printed only where no rank said what went wrong, or
    with ``DISTTUNE_TRACEBACK=1``)."""
    import tempfile

    if env.traceback_requested():
        return subprocess.call(command, env=child_env)
    with tempfile.TemporaryDirectory(prefix="disttune-demo-") as folder:
        proc = subprocess.run(command, env={**child_env, "DISTTUNE_DEMO_ERRORS": folder}, stderr=subprocess.PIPE,
                              text=True)
        errors = {int(path.stem.removeprefix("rank-")): path.read_text().strip()
                  for path in Path(folder).glob("rank-*.txt") if path.stem.removeprefix("rank-").isdigit()}
    if proc.returncode == 0 or not errors:
        sys.stderr.write(proc.stderr)
        return proc.returncode
    by_text: dict[str, list[int]] = {}
    for rank in sorted(errors):
        by_text.setdefault(errors[rank], []).append(rank)
    for text, ranks in by_text.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        print(f"disttune demo: {who}: {text.removeprefix('disttune: ')} ({env.TRACEBACK}=1 prints the tracebacks)",
              file=sys.stderr)
    return proc.returncode


def cmd_demo(args: argparse.Namespace) -> int:
    if args.kernel not in DEMOS:
        print(f"disttune demo: there is no {args.kernel!r} demo; available: {', '.join(DEMOS)}",
              file=sys.stderr)
        return 2
    launcher, example = REPO_ROOT / "scripts" / "launch.sh", REPO_ROOT / DEMOS[args.kernel]
    if not launcher.exists():
        print(f"disttune demo: needs a source checkout (missing {launcher}); "
              "clone the repository and pip install -e it", file=sys.stderr)
        return 2
    if not example.exists():
        print(f"disttune demo: the {args.kernel} example is missing from this checkout ({example})", file=sys.stderr)
        return 2
    checked = check_environment("demo")
    problem = sizes_problem(example, args.example_args, args.nproc or visible_gpus() or 2, args.parser)
    if problem:
        raise CommandError(problem)
    log_dir = resolve_log_dir(args.log_dir).resolve()
    command = ["bash", str(launcher)] + ([f"--nproc_per_node={args.nproc}"] if args.nproc else []) + [str(example)]
    code = launch_demo(command + list(args.example_args), {**env.environ_with_log_dir(log_dir), **checked})
    if code != 0:
        return code
    from .report import build_report

    report = build_report(log_dir)
    print(f"report: {report.markdown_path}" + (f" ({len(report.plots)} plots)" if report.plots else ""))
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    """Run a script that sweeps (``step.sweep`` / ``fn.sweep``) on the launcher; its sweeps write ``--table``."""
    launcher, script = REPO_ROOT / "scripts" / "launch.sh", Path(args.script)
    if not launcher.exists():
        raise CommandError(f"needs a source checkout (missing {launcher})")
    if not script.is_file():
        raise CommandError(f"no such script: {script}")
    checked = check_environment("sweep")
    table = Path(args.table).resolve()
    table.parent.mkdir(parents=True, exist_ok=True)
    child_env = {**env.environ_with_log_dir(resolve_log_dir(args.log_dir).resolve()), **checked}
    child_env["DISTTUNE_SWEEP_TABLE"] = str(table)
    command = ["bash", str(launcher)] + ([f"--nproc_per_node={args.nproc}"] if args.nproc else []) + [str(script)]
    before = file_identity(table)
    code = subprocess.call(command + list(args.script_args), env=child_env)
    if code != 0:
        return code
    if file_identity(table) in (None, before):  # a table left by an earlier run is not this run's
        raise CommandError(f"{script} finished without a sweep writing {table} (call step.sweep(cases) in it)")
    print(f"pinned table: {table} ({len(store.load_table(table)['entries'])} winner(s)); deploy it with "
          f"pinned= and on_new_key='nearest'")
    return 0


def file_identity(path: Path) -> Optional[tuple[int, int, int]]:
    """What changes when ``path`` is written again (a table is written to a new file renamed into place): its
    inode, size and modification time; None where there is no file."""
    try:
        status = path.stat()
    except FileNotFoundError:
        return None
    return status.st_ino, status.st_size, status.st_mtime_ns


def cmd_report(args: argparse.Namespace) -> int:
    from .report import build_report

    report = build_report(resolve_log_dir(args.log_dir), args.out, history=args.all,
                          all_runs=args.all_runs)  # OSError: no logs, or unwritable
    print(f"report: {report.markdown_path}")
    for plot in report.plots:
        print(f"plot: {plot}")
    for problem in report.problems:
        print(f"problem: {problem}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .report import verify

    if args.script is None and args.logs is None:
        args.parser.error("give a SCRIPT to run with its stored or pinned winners, or --logs DIR of an earlier run")
    log_dir = Path(args.logs) if args.script is None else resolve_log_dir(args.log_dir).resolve()
    return verify.run_command(args.script, args.script_args, args.threshold, args.nproc, log_dir, args.pinned,
                              args.cache_dir, REPO_ROOT, judge_cpu=args.judge_cpu)


def cmd_show(args: argparse.Namespace) -> int:
    rows = list(store.iter_records(args.cache_dir))
    leftovers = list(store.leftover_files(args.cache_dir))
    root = store.resolve_cache_dir(args.cache_dir)
    if not rows and not leftovers:
        print(f"no stored winners under {root}")
        return 0
    print(f"stored winners under {root}:")
    for path, record, problem in rows:
        if record is None or problem:
            print(f"  DAMAGED {path}: {problem} (ignored; `disttune clear` removes it)")
            continue
        fingerprint = record["fingerprint"]
        winner = record["configs"][record["winner"]]
        key = record["key_text"] if isinstance(record.get("key_text"), str) else f"key={record['key']}"
        print(f"  {record['name']} {key} occurrence={record.get('occurrence', 0)} -> "
              f"{describe_config(str(winner))}  [{fingerprint.get('gpu') or 'cpu'}, "
              f"world {fingerprint.get('world_size')}, triton {fingerprint.get('triton')}, "
              f"age {_age(record.get('created'))}, env {path.stem.split('-')[-1]}]")
    for path in leftovers:
        print(f"  LEFTOVER {path}: a temporary file of a writer that did not finish (`disttune clear` removes it)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    try:
        count = store.export_table(args.file, args.cache_dir)
    except OSError as err:  # the table is written beside its path, then renamed: name the path asked for
        raise CommandError(f"cannot write {args.file}: {err.strerror or err}") from err
    print(f"exported {count} winner(s) to {args.file}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    root = store.resolve_cache_dir(args.cache_dir)
    try:
        count = store.import_table(args.file, args.cache_dir)  # ValueError: not a readable winners table
    except OSError as err:
        raise CommandError(f"cannot write the store under {root}: {err.strerror or err}") from err
    print(f"imported {count} winner(s) into {root}")
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    """Remove entries (``--kernel``: those whose name, or kernel folder, contains the text), the damaged ones
    among them, their lock files and the temporary files writers left behind; links are removed, not followed."""
    def chosen(path: Path, record: Optional[dict]) -> bool:
        names = [path.name if path.parent == root else path.parent.name]
        if record is not None and isinstance(record.get("name"), str):
            names.append(record["name"])
        return not args.kernel or any(args.kernel in name for name in names)

    root = store.resolve_cache_dir(args.cache_dir)
    removed = leftovers = 0
    for path in list(store.leftover_files(args.cache_dir)):
        if chosen(path, None):
            path.unlink(missing_ok=True)
            leftovers += 1
    for path, record, _ in store.iter_records(args.cache_dir):
        if not chosen(path, record):
            continue
        path.unlink(missing_ok=True)  # a link (entry or kernel folder) goes, its target stays
        if path.parent != root:
            path.with_name(path.name + ".lock").unlink(missing_ok=True)
        removed += 1
    print(f"removed {removed} entr{'y' if removed == 1 else 'ies'} from {root}"
          + (f" and {leftovers} leftover temporary file{'s' * (leftovers != 1)}" if leftovers else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The parser; each subcommand's own parser is its namespace's ``parser`` (for its usage on errors)."""
    parser = argparse.ArgumentParser(prog="disttune", description="Tune Triton kernels across ranks, in context.")
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo", help="launch the 2-rank contextual tuning demo and write its report", allow_abbrev=False,
        usage="disttune demo [-h] [--nproc N] [--kernel NAME] [--log-dir DIR] [EXAMPLE ARGS ...]",
        description="Launch an example through scripts/launch.sh, then write the report of its logs. "
                    "Arguments the demo does not know go to the example (disttune demo --M 4096); after --, "
                    "all of them do (disttune demo -- --help shows the example's).")
    demo.add_argument("--nproc", type=positive_int, default=None, metavar="N",
                      help="ranks (default: GPUs present, else 2)")
    demo.add_argument("--kernel", default="ag_gemm", metavar="NAME", help="which example: " + ", ".join(DEMOS))
    demo.add_argument("--log-dir", default=None, metavar="DIR",
                      help="where the per-rank logs go (default: $DISTTUNE_LOG_DIR or logs)")
    demo.set_defaults(run=cmd_demo, parser=demo, example_args=[])

    sweep = sub.add_parser(
        "sweep", help="run a script's sweeps on the launcher and keep their pinned winners table",
        usage="disttune sweep [-h] [--nproc N] [--table FILE] [--log-dir DIR] SCRIPT [SCRIPT ARGS ...]",
        description="Launch SCRIPT through scripts/launch.sh with DISTTUNE_SWEEP_TABLE set, so that its "
                    "step.sweep(cases) calls write the winners of the job's sweeps to --table (a sweep that passes "
                    "table= writes that file too); arguments after SCRIPT, if any, go to it.")
    sweep.add_argument("--nproc", type=positive_int, default=None, metavar="N",
                       help="ranks (default: GPUs present, else 2)")
    sweep.add_argument("--table", default="winners.json", metavar="FILE",
                       help="the pinned winners table of every sweep of the job (default: winners.json)")
    sweep.add_argument("--log-dir", default=None, metavar="DIR",
                       help="where the per-rank logs go (default: $DISTTUNE_LOG_DIR or logs)")
    sweep.add_argument("script", help="the Python script that sweeps")
    # REMAINDER takes every argument after SCRIPT as the script's, even --nproc; it may take none
    sweep.add_argument("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS).required = False
    sweep.set_defaults(run=cmd_sweep, parser=sweep)

    report = sub.add_parser("report", help="merge rank-*.log into a Markdown report with plots")
    report.add_argument("log_dir", nargs="?", default=None,
                        help="the tuner's log_dir (default: $DISTTUNE_LOG_DIR or logs)")
    report.add_argument("--out", default=None, help="report directory (default: LOG_DIR/report)")
    report.add_argument("--all", action="store_true",
                        help="every tuning call of each site, oldest first (default: the last of each)")
    report.add_argument("--all-runs", action="store_true",
                        help="every run (job) that logged into the folder, each in its own section (default: the latest)")
    report.set_defaults(run=cmd_report, parser=report)

    check = sub.add_parser(
        "verify", help="rerun a step with its stored or pinned winners; fail when one got slower", allow_abbrev=False,
        usage="disttune verify [-h] [--threshold T] [--nproc N] [--pinned FILE] [--cache-dir DIR] [--log-dir DIR] "
              "SCRIPT [ARGS ...] | --logs DIR",
        description="Launch SCRIPT through scripts/launch.sh with DISTTUNE_VERIFY set: each tuner times its stored "
                    "or pinned winners in place and logs them beside the times recorded when they were chosen. "
                    "Exits 1 naming each site, config and both times where a winner is slower than recorded by "
                    "more than the threshold (or when nothing was verified). Arguments after SCRIPT go to it.")
    check.add_argument("script", nargs="?", default=None, metavar="SCRIPT", help="the step's script")
    check.add_argument("--threshold", type=float, default=0.1, metavar="T",
                       help="allowed slowdown, relative (default 0.1: 10%%)")
    check.add_argument("--nproc", type=positive_int, default=None, metavar="N",
                       help="ranks (default: GPUs present, else 2)")
    check.add_argument("--pinned", default=None, metavar="FILE", help="a winners table to verify instead of the store")
    check.add_argument("--cache-dir", default=None, metavar="DIR", help="the winner store (default: the usual one)")
    check.add_argument("--log-dir", default=None, metavar="DIR",
                       help="where the rank logs go (default: $DISTTUNE_LOG_DIR or logs)")
    check.add_argument("--logs", default=None, metavar="DIR",
                       help="no SCRIPT: judge the verify records of an earlier run in DIR (or, where it has none, the "
                            "winners it tuned against the store's times)")
    check.add_argument("--judge-cpu", action="store_true",
                       help="judge timings taken on a CPU too (by default they cannot show a regression)")
    check.set_defaults(run=cmd_verify, parser=check, script_args=[])

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
        command.set_defaults(run=handler, parser=command)
    return parser


def _one_line(err: BaseException) -> str:
    """An exception's message on one line, without the library's own ``disttune:`` prefix."""
    if isinstance(err, OSError) and err.strerror and err.filename:  # not "[Errno 20] Not a directory: 'x'"
        return f"cannot use {err.filename}: {err.strerror}"
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__
    return text.removeprefix("disttune: ")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one subcommand; returns the exit status (argparse exits with 2 on a bad argument)."""
    args, unknown = build_parser().parse_known_args(argv)
    if args.run is cmd_demo:
        if "--" in unknown:  # everything after it belongs to the example, even names the demo also has
            unknown.remove("--")
        args.example_args = unknown
    elif args.run is cmd_verify and args.script is not None:
        args.script_args = [arg for arg in unknown if arg != "--"]
    elif unknown:
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.run(args) or 0)
    except (CommandError, OSError, ValueError) as err:
        print(f"disttune {args.command}: {_one_line(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"disttune {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
