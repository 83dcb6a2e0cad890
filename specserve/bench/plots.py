"""PNG plots for the bench reports (matplotlib's Agg canvas, no pyplot and so no global figure state)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _figure(width: float, height: float, ncols: int = 1) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, axes


def _save(fig: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(path), format="png")


@dataclass(frozen=True)
class RateAxis:
    """Request rates on an x axis: `inf` (all requests at once) sits one step past the largest finite rate."""

    rates: tuple[float, ...]

    @property
    def inf_position(self) -> float:
        finite = [r for r in self.rates if math.isfinite(r)]
        return max(finite) * 1.5 if finite else 1.0

    def x(self, rate: float) -> float:
        return rate if math.isfinite(rate) else self.inf_position

    def apply(self, ax: Any) -> None:
        ticks = sorted(set(self.rates), key=self.x)
        ax.set_xticks([self.x(r) for r in ticks])
        ax.set_xticklabels(["inf" if not math.isfinite(r) else f"{r:g}" for r in ticks])
        ax.set_xlabel("request rate (req/s)")


def _rate(value: Any) -> float:
    return math.inf if value in ("inf", None) else float(value)


def plot_rate_sweep(path: Path, rows: Sequence[Mapping[str, Any]], title: str) -> None:
    """Three panels against request rate, one line per server config: end-to-end latency (mean,
    p99), TPOT (mean, p99) and output tokens/s."""
    configs = list(dict.fromkeys(str(r["config"]) for r in rows))
    axis = RateAxis(tuple(_rate(r["request_rate"]) for r in rows))
    fig, (ax_e2e, ax_tpot, ax_tput) = _figure(15, 4.4, 3)
    colors = ["C0", "C1", "C2", "C3", "C4", "C5", "C6", "C7"]
    panels = (
        (ax_e2e, ("mean_e2el_ms", "p99_e2el_ms"), "end-to-end latency (ms)"),
        (ax_tpot, ("mean_tpot_ms", "p99_tpot_ms"), "time per output token (ms)"),
    )
    for i, config in enumerate(configs):
        pts = sorted((r for r in rows if str(r["config"]) == config), key=lambda r: axis.x(_rate(r["request_rate"])))
        xs = [axis.x(_rate(r["request_rate"])) for r in pts]
        color = colors[i % len(colors)]
        for ax, (mean_key, p99_key), _ in panels:
            ax.plot(xs, [_num(r.get(mean_key)) for r in pts], "-o", color=color, label=f"{config} mean")
            ax.plot(xs, [_num(r.get(p99_key)) for r in pts], "--s", color=color, alpha=0.7, label=f"{config} p99")
        ax_tput.plot(xs, [_num(r.get("output_throughput")) for r in pts], "-o", color=color, label=config)
    for ax, _, ylabel in panels:
        ax.set_ylabel(ylabel)
    ax_tput.set_ylabel("output tokens/s")
    for ax in (ax_e2e, ax_tpot, ax_tput):
        axis.apply(ax)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_ylim(bottom=0)
    ax_e2e.set_title("latency vs rate")
    ax_tpot.set_title("TPOT vs rate")
    ax_tput.set_title("throughput vs rate")
    fig.suptitle(title)
    _save(fig, path)


def plot_grouped_bars(path: Path, groups: Sequence[str], series: Mapping[str, Sequence[float | None]],
                      ylabel: str, title: str, xlabel: str = "") -> None:
    """Bars for each group (x) and series (colour); a missing value leaves a gap."""
    fig, (ax,) = _figure(min(16.0, max(6.0, 0.9 * len(groups) * max(1, len(series)))), 4.4)
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, [_num(v) for v in values], width, label=name)
        if len(series) <= 3:  # more bars a group and their labels overlap
            ax.bar_label(bars, labels=["" if v is None else f"{v:.1f}" for v in values], fontsize=7)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=20 if max((len(g) for g in groups), default=0) > 8 else 0)
    ax.set_ylabel(ylabel)
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    _save(fig, path)


def _num(value: Any) -> float:
    return math.nan if value is None else float(value)
