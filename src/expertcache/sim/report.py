"""Presenting simulation results: a text table, JSON records, and a misses-against-capacity plot."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

from expertcache.errors import ExpertcacheError
from expertcache.paths import output_file
from expertcache.sim.replay import SimResult

_LONG_TABLE_MAX_ROWS = 40
_PIVOT_COLUMNS = 8


def format_table(results: Sequence[SimResult]) -> str:
    """One row per result when there are few; otherwise policies x a sample of capacities."""
    if len(results) <= _LONG_TABLE_MAX_ROWS:
        return _long_table(results)
    return _pivot_table(results)


def format_layers(results: Sequence[SimResult]) -> str:
    """Per-layer requests and misses of each result, one row per layer."""
    blocks = []
    for r in results:
        req, mis = r.layer_requests.sum(axis=0), r.layer_misses.sum(axis=0)
        rows = [
            (str(layer), str(q), str(m), f"{m / q:.4f}" if q else "-")
            for layer, (q, m) in enumerate(zip(req.tolist(), mis.tolist(), strict=True))
        ]
        title = f"{r.label} at capacity {r.capacity} ({r.order} order)"
        blocks.append(title + "\n" + _render(("layer", "requests", "misses", "miss ratio"), rows))
    return "\n\n".join(blocks)


def _long_table(results: Sequence[SimResult]) -> str:
    head = ("policy", "capacity", "requests", "hits", "misses", "miss ratio", "prefill", "decode", "x OPT")
    rows = []
    for r in results:
        phases = r.to_dict()["phases"]
        rows.append(
            (
                r.label,
                str(r.capacity),
                str(r.requests),
                str(r.hits),
                str(r.misses),
                f"{r.miss_ratio:.4f}",
                str(phases["prefill"]["misses"]),
                str(phases["decode"]["misses"]),
                "-" if r.ratio_to_opt is None else f"{r.ratio_to_opt:.3f}" + ("" if r.opt_is_bound else "*"),
            )
        )
    notes = ["prefill/decode: misses in prompt steps and in generated tokens."]
    if any(r.opt_is_bound is False for r in results):
        notes.append(
            "*: a prefill group was split (larger than the capacity or a layer's budget); OPT is Belady "
            "under the same serving rule there, not a guaranteed lower bound."
        )
    return _render(head, rows) + "\n" + "\n".join(notes)


def _pivot_table(results: Sequence[SimResult]) -> str:
    caps = sorted({r.capacity for r in results})
    step = max(1, len(caps) // _PIVOT_COLUMNS)
    shown = caps[::step][:_PIVOT_COLUMNS]
    if caps[-1] not in shown:
        shown[-1] = caps[-1]
    cell = {(r.label, r.capacity): r for r in results}
    policies = list(dict.fromkeys(r.label for r in results))
    head = ("policy \\ capacity", *map(str, shown))
    rows = []
    for p in policies:
        rows.append((p, *(f"{cell[p, c].miss_ratio:.3f}" if (p, c) in cell else "-" for c in shown)))
    note = (
        f"miss ratio at {len(shown)} of {len(caps)} capacities "
        f"({results[0].requests} requests, order {results[0].order}); "
        "every capacity is in --json and --plot."
    )
    return _render(head, rows) + "\n" + note


def _render(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    top = line(head)
    return "\n".join([top, "-" * len(top), *(line(r) for r in rows)])


def check_plot_path(path: str | Path) -> None:
    """Refuse a plot file of a format matplotlib cannot write, before the replays that feed it."""
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = Path(path).suffix.lower().removeprefix(".")
    formats = FigureCanvasBase.get_supported_filetypes()
    if not suffix:  # matplotlib would take the format from the file it is given (a temporary one's, or add
        # .png to a link's or a device's name and write elsewhere than said)
        raise ExpertcacheError(f"{path}: a plot's file name ends in its format: .png, .svg or .pdf")
    if suffix not in formats:
        raise ExpertcacheError(f"{path}: cannot write a .{suffix} plot; use .png, .svg or .pdf")


def plot_curves(results: Sequence[SimResult], path: str | Path, title: str = "") -> None:
    """Misses against capacity, one line per policy, OPT dashed, written to ``path`` (PNG, SVG, PDF)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    policies = list(dict.fromkeys(r.label for r in results))
    for p in policies:
        pts = sorted((r.capacity, r.misses) for r in results if r.label == p)
        style = {"color": "black", "linestyle": "--", "linewidth": 2} if p == "opt" else {}
        ax.plot(
            [c for c, _ in pts], [m for _, m in pts], label=p, marker="." if len(pts) < 40 else None, **style
        )
    if "opt" not in policies and results and results[0].opt_misses is not None:
        pts = sorted({(r.capacity, r.opt_misses) for r in results})
        ax.plot([c for c, _ in pts], [m for _, m in pts], "k--", linewidth=2, label="opt")
    ax.set_xlabel("capacity (experts)")
    ax.set_ylabel("misses")
    # a long trace path wraps rather than running off the figure
    ax.set_title(textwrap.fill(title or f"misses against capacity ({results[0].order} order)", 64))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        with output_file(path, "plot") as target:
            fig.savefig(target)
    except (OSError, ValueError) as e:
        raise ExpertcacheError(f"{path}: cannot write plot ({e})") from None
    finally:
        plt.close(fig)
