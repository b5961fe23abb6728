"""What every figure of bench/figures.py shares: matplotlib's settings, the colours, the reading of the
results files and the caption under each figure."""

from __future__ import annotations

import json
import os
import statistics
import textwrap

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "docs", "_static", "figures")
WIDTH = 7.0  # inches; saved at DPI, shown about 700 px wide
DPI = 200

# One colour per package: JAX's own callbacks grey, the original JAXbind orange, jaxbind blue.
GREY, LIGHT_GREY = "#6b6b6b", "#b0b0b0"
ORANGE, LIGHT_ORANGE = "#d9730d", "#f2b275"
BLUE, LIGHT_BLUE, DARK_BLUE = "#1f5fa8", "#7fb2e5", "#0b2e59"
GREEN = "#2e8b57"

plt.rcParams.update(
    {
        "font.size": 9.5,
        "axes.titlesize": 10.5,
        "axes.labelsize": 9.5,
        "legend.fontsize": 8.5,
        "xtick.labelsize": 9,
        "ytick.labelsize": 9,
        "figure.titlesize": 11.5,
        "axes.spines.top": False,
        "axes.spines.right": False,
        "savefig.facecolor": "white",
    }
)


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------


def load(results, name):
    """The wrapped results file NAME.json ({"run": ..., "results": ...}), or None if absent."""
    path = os.path.join(results, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        return json.load(handle)


def load_runs(results, stem):
    """Every run of a benchmark that ran more than once (STEM-1.json, STEM-2.json, ...)."""
    runs, k = [], 1
    while (run := load(results, f"{stem}-{k}")) is not None:
        runs.append(run)
        k += 1
    return runs


def finish(fig, path, title, note, runs, sources, top=0.45):
    """Title at the top, ``note`` (the method) and a footer (machine, versions, date, load, data files)
    under the axes, then save. ``top``: inches kept under the title for a legend."""
    height = fig.get_figheight()
    first = runs[0]["run"]
    v = first["versions"]
    dates = sorted({r["run"]["started_utc"][:10] for r in runs})
    loads = [x for r in runs for x in (r["run"]["load_average_before"][0], r["run"]["load_average_after"][0])]
    packages = sorted({(r["run"]["versions"].get("jaxbind", "?"), r["run"]["versions"]["jax"]) for r in runs})
    jaxes = sorted({jax for _, jax in packages})
    what = " and ".join(("JAXbind " if b.startswith("1.") else "jaxbind ") + b for b, _ in packages)
    machine = (
        f"{first['cpus']} cores, Python {v['python']}, {what} on jax {' / '.join(jaxes)}, numpy {v['numpy']}"
        + (f", numba {v['numba']}" if any("numba" in s for s in sources) else "")
        + (f", scipy {v['scipy']}" if any("solvers" in s for s in sources) else "")
        + f"; measured {', '.join(dates)}, load average "
        + (f"{min(loads):.1f}–{max(loads):.1f}" if f"{min(loads):.1f}" != f"{max(loads):.1f}" else f"{min(loads):.1f}")
    )
    data = "Data: " + ", ".join(f"bench/results/{s}" for s in sources) + "; drawn by bench/figures.py"
    fig.text(0.01, 0.06 / height, machine + "\n" + data, fontsize=7, color="#555555", va="bottom", linespacing=1.3)
    note = "\n".join(textwrap.wrap(note, 128))  # 7.5 pt over 7 inches
    lines = note.count("\n") + 1
    fig.text(0.01, 0.42 / height, note, fontsize=7.5, color="#222222", va="bottom", linespacing=1.3)
    fig.suptitle(title, x=0.01, y=1 - 0.08 / height, ha="left", va="top", fontweight="bold")
    bottom = 0.5 + 0.15 * lines
    fig.tight_layout(rect=(0, bottom / height, 1, 1 - (0.25 + top) / height))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def top_legend(fig, handles, labels, ncol):
    height = fig.get_figheight()
    fig.legend(
        handles,
        labels,
        ncol=ncol,
        loc="upper left",
        bbox_to_anchor=(0.0, 1 - 0.3 / height),
        frameon=False,
        columnspacing=1.2,
        handlelength=1.6,
    )


def number(value):
    """3 significant digits, without an exponent."""
    return f"{value:,.0f}" if value >= 999.5 else f"{value:.3g}"


def spread(values):
    """Median of the runs, and its distance to the lowest and the highest run (for error bars)."""
    m = statistics.median(values)
    return m, m - min(values), max(values) - m
