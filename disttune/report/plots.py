"""Draw a site's two plots with matplotlib: a configs x ranks heat map and the agreed time per config.

    figure = heatmap_figure(site)       # or agreed_figure(site); the caller saves it (disttune.report)

Figures are made on the Agg canvas without pyplot, so no global backend is switched and nothing is
left open; their size grows with the configs and ranks (capped at 40 inches). Nothing here writes a
file. Cost: drawing takes milliseconds; rendering happens when a figure is saved, about 0.1-0.3 s a
figure. matplotlib and numpy are imported on the first figure, not with this module.
"""

from __future__ import annotations

import math
import textwrap
from typing import TYPE_CHECKING, Any, Sequence

from .logs import clip
from .sites import SiteSummary

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _figure(width: float, height: float) -> Figure:
    """A Figure drawn by the Agg canvas, without pyplot: no global backend switch, nothing to leak."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)
    return figure


def _colormap(name: str) -> Any:
    import matplotlib

    return matplotlib.colormaps[name].with_extremes(bad="white")


def _config_labels(site: SiteSummary, width: int = 44) -> list[str]:
    """Tick labels ``[i] short config`` wrapped at ``width`` characters (at most 3 lines), winner marked."""
    labels = []
    for row in site.configs:
        text = f"[{row.index}] {row.label}" + ("  (winner)" if row.index == site.winner else "")
        lines = textwrap.wrap(text, width) or [""]
        if len(lines) > 3:
            lines = lines[:2] + [clip(" ".join(lines[2:]), width)]
        labels.append("\n".join(lines))
    return labels


def _label_size(labels: Sequence[str]) -> tuple[float, int]:
    """(inches the widest label line needs at 9 pt, most lines in one label)."""
    lines = [line for label in labels for line in label.split("\n")]
    return 0.075 * max(map(len, lines), default=1), max((label.count("\n") + 1 for label in labels), default=1)


def _wrap_title(text: str, width_in: float) -> str:
    return "\n".join(textwrap.wrap(text, max(30, int(width_in * 11))))


def heatmap_figure(site: SiteSummary) -> Figure:
    """Configs x ranks heat map of each rank's time (annotated, failed cells hatched, winner row framed)."""
    import numpy as np
    from matplotlib.patches import Rectangle

    n_configs, n_ranks = len(site.configs), len(site.ranks)
    data = np.array([row.per_rank_ms for row in site.configs], dtype=float).reshape(n_configs, n_ranks)
    labels = _config_labels(site)
    label_in, label_lines = _label_size(labels)
    width = min(40.0, 2.2 + label_in + 0.95 * n_ranks)
    height = min(40.0, 1.7 + (0.3 + 0.16 * label_lines) * n_configs)
    figure = _figure(width, height)
    axes = figure.add_subplot()
    masked = np.ma.masked_invalid(data)
    cmap = _colormap("YlOrRd")
    finite = data[np.isfinite(data)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    if high <= low:
        high = low + (abs(low) or 1.0) * 1e-3
    image = axes.imshow(masked, cmap=cmap, aspect="auto", interpolation="nearest", vmin=low, vmax=high)
    colorbar = figure.colorbar(image, ax=axes, fraction=0.046 if n_ranks > 2 else 0.08, pad=0.03)
    colorbar.set_label("time (ms)")
    axes.set_xticks(range(n_ranks), [f"rank {r}" + ("" if r in site.logged_ranks else "\n(not in its log)")
                                     for r in site.ranks],
                    rotation=45 if n_ranks > 8 else 0, ha="right" if n_ranks > 8 else "center")
    axes.set_yticks(range(n_configs), labels)
    for tick, row in zip(axes.get_yticklabels(), site.configs):
        if row.index == site.winner:
            tick.set_fontweight("bold")
    annotate = n_ranks <= 32 and n_configs * n_ranks <= 800
    size = 9 if n_ranks <= 8 else 7
    for i in range(n_configs):
        for j in range(n_ranks):
            value = data[i, j]
            if math.isinf(value):
                axes.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="#dddddd", edgecolor="#777777",
                                         hatch="//", linewidth=0))
                text, color = "failed", "black"
            elif math.isnan(value):
                axes.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="white", edgecolor="none"))
                text, color = "n/a", "#555555"
            else:
                text = f"{value:#.4g}"
                color = "white" if (value - low) / (high - low) > 0.6 else "black"
            if annotate:
                axes.text(j, i, text, ha="center", va="center", fontsize=size, color=color)
    if site.winner is not None and site.row(site.winner) is not None:
        w = [row.index for row in site.configs].index(site.winner)
        axes.add_patch(Rectangle((-0.5, w - 0.5), n_ranks, 1, fill=False, edgecolor="#1f4e9e", linewidth=2.5))
    axes.set_xlabel("rank")
    axes.set_ylabel("config")
    axes.set_title(_wrap_title(f"{site.name}: {site.title}: each rank's time (ms)", width), fontsize=10)
    return figure


def agreed_figure(site: SiteSummary) -> Figure:
    """Horizontal bars of the agreed time per config, winner highlighted, failed configs hatched; an error bar on
    each shows the spread of every rank's samples of that config (median, 20th to 80th percentile)."""
    from matplotlib.patches import Patch

    n_configs = len(site.configs)
    labels = _config_labels(site)
    label_in, label_lines = _label_size(labels)
    width = min(30.0, 6.5 + label_in)
    height = min(40.0, 1.6 + (0.27 + 0.16 * label_lines) * n_configs)
    figure = _figure(width, height)
    axes = figure.add_subplot()
    finite = [row.agreed_ms for row in site.configs if math.isfinite(row.agreed_ms)]
    top = max(finite) if finite else 1.0
    right = top * 1.22  # room for the value labels
    bands = {row.index: row.sample_band for row in site.configs}
    top = max([top] + [band[2] for band in bands.values() if band is not None and math.isfinite(band[2])])
    right = top * 1.22
    for y, row in enumerate(site.configs):
        value = row.agreed_ms
        if math.isfinite(value):
            color = "#2ca02c" if row.index == site.winner else "#7f9fbf"
            axes.barh(y, value, color=color, edgecolor="black", linewidth=0.6, height=0.7)
            band = bands[row.index]
            if band is not None:  # the samples of every rank: median, 20th to 80th percentile
                low, middle, high = band
                axes.errorbar(middle, y, xerr=[[middle - low], [high - middle]], fmt="o", color="black",
                              markersize=2.5, elinewidth=1.1, capsize=3)
            axes.text(max(value, band[2] if band else value) + top * 0.01, y, f"{value:#.4g} ms", va="center",
                      ha="left", fontsize=9)
        else:  # no bar: a hatched band across the whole axis, labelled
            axes.barh(y, right, color="#f2f2f2", edgecolor="#aaaaaa", hatch="//", linewidth=0.6, height=0.7)
            if math.isinf(value):
                who = ", ".join(f"rank {r}" for r in sorted(row.failures))
                text = f"failed on {who}" if who else "failed"
            else:
                text = "no data"
            axes.text(right / 2, y, text, va="center", ha="center", fontsize=9,
                      bbox={"facecolor": "white", "edgecolor": "#aaaaaa", "boxstyle": "round,pad=0.3"})
    axes.set_yticks(range(n_configs), labels)
    for tick, row in zip(axes.get_yticklabels(), site.configs):
        if row.index == site.winner:
            tick.set_fontweight("bold")
    axes.invert_yaxis()  # config 0 on top, as in the table and the heat map
    axes.set_xlim(0, right)
    axes.set_xlabel(f"agreed time (ms, reduce={site.reduce or '?'})")
    axes.grid(axis="x", linestyle=":", alpha=0.6)
    axes.set_axisbelow(True)
    from matplotlib.lines import Line2D

    handles = [Patch(facecolor="#2ca02c", edgecolor="black", label="winner"),
               Patch(facecolor="#7f9fbf", edgecolor="black", label="other configs")]
    if any(band is not None for band in bands.values()):
        handles.append(Line2D([], [], color="black", marker="o", markersize=3,
                              label="samples, all ranks:\nmedian, 20th-80th %"))
    if any(not math.isfinite(row.agreed_ms) for row in site.configs):
        handles.append(Patch(facecolor="#f2f2f2", edgecolor="#aaaaaa", hatch="//", label="failed / no data"))
    axes.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False, fontsize=9)
    axes.set_title(_wrap_title(f"{site.name}: {site.title}: agreed time per config", width), fontsize=10)
    return figure
