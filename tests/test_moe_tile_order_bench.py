"""bench/moe_tile_order.py's reading of an ncu CSV (the part that runs without a GPU)."""

from __future__ import annotations

import csv
import io

import pytest

from helpers import load_bench


def ncu_csv(bench, rows: int, units=("ns", "byte", "hz")) -> str:
    """An ncu ``--csv --page raw`` file: its own message lines, a header, a units row, one row per kernel;
    kernel i takes 1000 * (i // LAUNCHES + 1) + (i % LAUNCHES) ns and reads i MB."""
    out = io.StringIO()
    out.write("==PROF== Connected to process 1\n")
    writer = csv.writer(out, quoting=csv.QUOTE_ALL)
    writer.writerow(["ID", "Kernel Name", *bench.METRICS])
    writer.writerow(["", "", *units])
    for i in range(rows):
        ns = 1000 * (i // bench.LAUNCHES + 1) + i % bench.LAUNCHES
        writer.writerow([str(i), "_moe_gemm_body", f"{ns:,}", str(i * 1_000_000), "1,600,000,000"])
    out.write("==PROF== Disconnected from process 1\n")
    return out.getvalue()


def test_parse_gives_each_contender_the_median_of_its_launches(tmp_path, capsys):
    bench = load_bench("moe_tile_order")
    contenders = len(bench.SHAPES) * len(bench.specs())
    path = tmp_path / "ncu.csv"
    path.write_text(ncu_csv(bench, contenders * bench.LAUNCHES))
    bench.parse(str(path))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| E=")]
    assert len(lines) == contenders
    first, last = lines[0].split(" | "), lines[-1].split(" | ")
    assert first[1:3] == ["torch._grouped_mm, sorted A", "row-major"]
    assert first[3:] == ["1.0", "1", "1.60 |"]  # median of 1000, 1001, 1002 ns; of 0, 1, 2 MB
    assert last[1:3] == ["tl, sorted A, bands inside experts", "K-major"]
    assert last[3] == f"{contenders:.1f}" and last[4] == str(contenders * bench.LAUNCHES - 2)


def test_parse_refuses_a_run_with_kernels_missing_or_unknown_units(tmp_path):
    bench = load_bench("moe_tile_order")
    contenders = len(bench.SHAPES) * len(bench.specs())
    path = tmp_path / "ncu.csv"
    path.write_text(ncu_csv(bench, contenders * bench.LAUNCHES - 1))
    with pytest.raises(SystemExit, match="profiled kernels, expected"):
        bench.parse(str(path))
    path.write_text(ncu_csv(bench, contenders * bench.LAUNCHES, units=("ns", "furlong", "hz")))
    with pytest.raises(SystemExit, match="unknown units"):
        bench.parse(str(path))


def test_in_tile_order_sets_the_order_for_the_launch_only():
    from disttune.kernels import moe

    bench = load_bench("moe_tile_order")
    default, seen = moe.EXPERT_BANDS, []
    bench.in_tile_order(lambda: seen.append(moe.EXPERT_BANDS), not default)()

    def fails():
        seen.append(moe.EXPERT_BANDS)
        raise RuntimeError("launch failed")

    with pytest.raises(RuntimeError, match="launch failed"):
        bench.in_tile_order(fails, not default)()
    assert seen == [not default, not default] and moe.EXPERT_BANDS == default
