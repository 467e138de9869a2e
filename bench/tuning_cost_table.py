"""The tables of ``bench/tuning_cost.sh``, from the rows ``bench/tuning_cost.py`` wrote.

    python bench/tuning_cost_table.py ROWS.jsonl

Three tables: each variant's first call against the baseline, with its *tuning overhead* (first call
minus the untuned cold first call, which compiles one config and pays Triton's one-time
initialisation too) and whether it found the baseline's (exhaustive) winner; where each tuned
variant's first call went (``TuningReport.phases`` of rank 0, plus the compile threads' busy seconds
beside it); and what a warm start adds. Rows of a variant that did not run are left out.
"""

from __future__ import annotations

import json
import sys

from disttune.phases import OTHER, SPANS

ORDER = ("baseline", "parallel", "sequential_compiles", "background", "own_group", "warmed", "early", "warmed_early",
         "split", "share", "all", "untuned", "untuned_cold", "warm")


def load(path: str) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    with open(path) as handle:
        for line in handle:
            row = json.loads(line)
            rows[row["variant"]] = row  # the last row of a variant counts
    return rows


def first_calls(rows: dict[str, dict]) -> list[str]:
    base = rows.get("baseline")
    cold = rows.get("untuned_cold")
    head = next(iter(rows.values()))
    step = {"gemm": "AG-GEMM step", "moe": "AG + MoE grouped GEMM step"}[head.get("workload", "gemm")]
    lines = [f"tuning cost, {step}, {head['world']} x {head['device']} (torch {head['torch']}, "
             f"triton {head['triton']}, {head['date']})",
             f"{'variant':<20} {'first call s':>12} {'vs baseline':>11} {'overhead s':>10} {'vs baseline':>11} "
             f"{'runs':>5} {'source':>7} {'step ms (100)':>13} {'= baseline':>10}  winner"]
    base_overhead = base["first_call_s"] - cold["first_call_s"] if base and cold else None
    for name in ORDER:
        r = rows.get(name)
        if r is None:
            continue
        ratio = f"{r['first_call_s'] / base['first_call_s']:10.2f}x" if base else f"{'':>11}"
        overhead = r["first_call_s"] - cold["first_call_s"] if cold else None
        overhead_text = f"{overhead:10.3f}" if overhead is not None else f"{'':>10}"
        overhead_ratio = (f"{overhead / base_overhead:10.2f}x" if overhead is not None and base_overhead
                          else f"{'':>11}")
        same = ("yes" if r["winner"] == base["winner"] else "NO") if base else ""
        lines.append(f"{name:<20} {r['first_call_s']:12.3f} {ratio} {overhead_text} {overhead_ratio} "
                     f"{r['function_runs']:5d} {r['source']:>7} {r['step_ms_median_of_100']:13.4f} {same:>10}  "
                     f"{r['winner']}")
    if base_overhead is not None:
        lines.append(f"tuning overhead: first call minus the untuned cold first call ({cold['first_call_s']:.3f} s: "
                     f"the winner alone, compiled into a cold Triton cache); the baseline's is {base_overhead:.3f} s")
    warmed = [r for r in rows.values() if r.get("warm_up_s") is not None]
    for r in warmed:
        lines.append(f"{r['variant']}: disttune.warm_up() took {r['warm_up_s']:.3f} s before the first call "
                     f"(not in its first call)")
    return lines


def breakdown(rows: dict[str, dict]) -> list[str]:
    tuned = [name for name in ORDER if name in rows and rows[name].get("phases")]
    if not tuned:
        return []
    seen = {phase for name in tuned for phase in rows[name]["phases"]}
    names = [phase for phase in (*SPANS, OTHER) if phase in seen] + sorted(seen - {*SPANS, OTHER})
    extra: list[str] = []
    for name in tuned:
        for key in rows[name].get("background") or {}:
            if key not in extra:
                extra.append(key)
    width = max(12, *(len(n) for n in tuned))
    lines = ["", "where the first call went, s (rank 0; the phases sum to the tuning call's wall time; compile "
             "threads beside it)", f"{'phase':<22}" + "".join(f"{n:>{width + 1}}" for n in tuned)]
    for phase in names:
        lines.append(f"{phase:<22}" + "".join(f"{rows[n]['phases'].get(phase, 0.0):{width + 1}.3f}" for n in tuned))
    lines.append(f"{'= tuning call':<22}" + "".join(f"{rows[n]['tuning_wall_s']:{width + 1}.3f}" for n in tuned))
    for key in extra:
        lines.append(f"{'(' + key + ')':<22}" + "".join(
            f"{(rows[n].get('background') or {}).get(key, 0.0):{width + 1}.3f}" for n in tuned))
    return lines


def warm_start(rows: dict[str, dict]) -> list[str]:
    base, warm, untuned = rows.get("baseline"), rows.get("warm"), rows.get("untuned")
    if not (base and warm and untuned):
        return []
    within = warm["first_call_s"] - warm["plain_call_s"]
    added = warm["first_call_s"] - untuned["first_call_s"]
    return ["",
            f"warm start over an untuned call: {within:.3f} s = {100 * within / base['first_call_s']:.1f}% of the "
            "baseline's tuning time (same process: warm first call minus a later call)",
            f"warm start over an untuned run: {added:.3f} s = {100 * added / base['first_call_s']:.1f}% of the "
            f"baseline's tuning time (first calls of two fresh processes: store hit {warm['first_call_s']:.3f} s, "
            f"winner fixed without a tuner {untuned['first_call_s']:.3f} s; target <= 5%)"]


def main() -> None:
    rows = load(sys.argv[1])
    print("\n" + "\n".join(first_calls(rows) + breakdown(rows) + warm_start(rows)))


if __name__ == "__main__":
    main()
