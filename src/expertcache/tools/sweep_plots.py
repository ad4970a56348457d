"""A sweep's figures: per trace and order (and timing combination), the miss-ratio curve of every policy
with OPT's dashed, and a heat map of the ratio to OPT (policies x capacities). matplotlib, Agg."""

from __future__ import annotations

import math
import os
import re
import textwrap
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from expertcache.errors import ExpertcacheError
from expertcache.paths import output_file
from expertcache.tools.sweep_table import TIMING_IDENTITY

_ANNOTATE_MAX = 12  # a heat map writes its values in the cells up to this many rows and columns
_HEATMAP_MAX_IN = (16, 12)  # a heat map's largest figure (inches, at 100 dpi), however many cells
_TICKS_MAX = (40, 40)  # labels on its axes at most: every n-th capacity (policy) beyond


def check_plot_dir(folder: str | Path) -> None:
    """The folder the plots go to exists (it is made) and can be written, before the sweep runs."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise ExpertcacheError(f"{folder}: cannot write the plots there: it is a file, not a folder")
    if not path.exists() and not path.absolute().parent.is_dir():  # the folder is made, not its parents
        raise ExpertcacheError(
            f"{folder}: cannot write the plots there: directory {path.absolute().parent} does not exist"
        )
    try:
        path.mkdir(exist_ok=True)
    except OSError as e:
        raise ExpertcacheError(f"{folder}: cannot make the plot folder ({e.strerror or e})") from None
    if not os.access(path, os.W_OK):
        raise ExpertcacheError(f"{folder}: cannot write the plots there: permission denied")


def plot_sweep(rows: Sequence[dict[str, object]], folder: str | Path) -> list[Path]:
    """Two PNGs per (trace, order, timing combination): ``NAME_ORDER[_TIMING]_mrc.png`` and
    ``..._ratio.png``; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    groups: dict[tuple, list[dict[str, object]]] = defaultdict(list)
    for row in rows:
        timing = tuple(row.get(c) for c in TIMING_IDENTITY)
        groups[(row["trace"], row["trace_sha"], row["order"], timing)].append(row)
    stems = _stems({(trace, sha) for trace, sha, _, _ in groups})
    written = []
    for (trace, sha, order, timing), group in groups.items():
        suffix = _timing_slug(timing)
        base = Path(folder) / f"{stems[trace, sha]}_{order}{suffix}"
        title = f"{trace} ({order} order{_timing_title(timing)})"
        written.append(_save(_curves(group, title), base.with_name(base.name + "_mrc.png")))
        written.append(_save(_heatmap(group, title), base.with_name(base.name + "_ratio.png")))
    return written


def _stems(traces: set[tuple[object, object]]) -> dict[tuple[object, object], str]:
    """A file name per trace: its stem, with its hash where two traces share one."""
    stem = {key: Path(str(key[0])).stem for key in traces}
    counts = defaultdict(int)
    for s in stem.values():
        counts[s] += 1
    return {key: s if counts[s] == 1 else f"{s}-{key[1]}" for key, s in stem.items()}


def _timing_slug(timing: tuple) -> str:
    """``_fetch_eam-w1_16GBps_20us`` for a timing combination; nothing for a counting cell."""
    if all(v is None for v in timing):
        return ""
    miss, prefetch, window, bw, lat = timing
    text = f"_{miss}_{prefetch}{'' if window is None else f'-w{window}'}_{bw:g}GBps_{lat:g}us"
    return re.sub(r"[^A-Za-z0-9_.=-]+", "-", text)


def _timing_title(timing: tuple) -> str:
    if all(v is None for v in timing):
        return ""
    miss, prefetch, window, bw, lat = timing
    pf = prefetch if window is None else f"{prefetch} (window {window})"
    return f"; miss {miss}, prefetch {pf}, link {bw:g} GB/s + {lat:g} us"


def _label(row: dict[str, object]) -> str:
    return f"{row['policy']}:{row['params']}" if row["params"] else str(row["policy"])


def _mean_by(group: Sequence[dict[str, object]], value: str) -> dict[str, dict[int, float]]:
    """label -> capacity -> the value's mean over seeds."""
    acc: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in group:
        if row[value] is not None:
            acc[_label(row)][int(row["capacity"])].append(float(row[value]))
    return {label: {c: sum(v) / len(v) for c, v in caps.items()} for label, caps in acc.items()}


def _curves(group: Sequence[dict[str, object]], title: str):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    opt = dict(
        sorted({(int(r["capacity"]), r["opt_misses"] / r["requests"]) for r in group if r["requests"]})
    )
    for label, by_cap in _mean_by(group, "miss_ratio").items():
        if label == "opt" and all(math.isclose(m, opt.get(c, math.nan)) for c, m in by_cap.items()):
            continue  # OPT's own rows: the dashed line (with prefetching, opt's rows differ from it)
        caps = sorted(by_cap)
        ax.plot(caps, [by_cap[c] for c in caps], label=label, marker="." if len(caps) < 40 else None)
    marker = "." if len(opt) < 40 else None
    ax.plot(list(opt), list(opt.values()), "k--", linewidth=2, label="OPT", marker=marker)
    ax.set_xlabel("capacity (experts)")
    ax.set_ylabel("miss ratio")
    ax.set_title(f"miss ratio against capacity\n{_wrapped(title, fig)}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _heatmap(group: Sequence[dict[str, object]], title: str):
    import matplotlib.pyplot as plt
    import numpy as np

    ratios = _mean_by(group, "ratio_to_opt")
    labels = list(ratios)
    caps = sorted({c for by_cap in ratios.values() for c in by_cap})
    grid = np.array([[ratios[lab].get(c, math.nan) for c in caps] for lab in labels])  # [policies, caps]
    width = min(_HEATMAP_MAX_IN[0], max(7, 0.5 * len(caps) + 3))
    height = min(_HEATMAP_MAX_IN[1], max(3.5, 0.4 * len(labels) + 2))
    fig, ax = plt.subplots(figsize=(width, height))
    image = ax.imshow(grid, aspect="auto", cmap="viridis_r", interpolation="nearest")
    norm = image.norm
    xs, ys = _thinned(len(caps), _TICKS_MAX[0]), _thinned(len(labels), _TICKS_MAX[1])
    ax.set_xticks(xs, [str(caps[j]) for j in xs], rotation=90 if len(xs) > 12 else 0)
    ax.set_yticks(ys, [labels[i] for i in ys])
    if len(caps) <= _ANNOTATE_MAX and len(labels) <= _ANNOTATE_MAX:
        for i in range(len(labels)):
            for j in range(len(caps)):
                if not math.isnan(grid[i, j]):  # dark text on the light (low) end of the colour map
                    color = "k" if norm(grid[i, j]) < 0.5 else "w"
                    ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7, color=color)
    fig.colorbar(image, ax=ax, label="misses / OPT's misses")
    ax.set_xlabel("capacity (experts)")
    ax.set_title(f"ratio to OPT\n{_wrapped(title, fig)}", fontsize=9)
    fig.tight_layout()
    return fig


def _wrapped(title: str, fig) -> str:
    """The title in lines that fit the figure's width at the titles' 9 points (a long trace path and a
    timing combination ran off both edges): about 13 characters an inch, paths broken anywhere."""
    width = max(20, int(fig.get_figwidth() * 72 / (0.62 * 9)))
    return "\n".join(textwrap.wrap(title, width, break_long_words=True, break_on_hyphens=False))


def _thinned(n: int, most: int) -> list[int]:
    """Positions of the tick labels on an axis of ``n`` cells: all, or every k-th for at most ``most``."""
    return list(range(0, n, math.ceil(n / most) if n > most else 1))


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    try:
        with output_file(path, "the plot") as target:
            fig.savefig(target, dpi=100)
    except (OSError, ValueError) as e:
        raise ExpertcacheError(f"{path}: cannot write the plot ({e})") from None
    finally:
        plt.close(fig)
    return path
