"""Draw the performance page's figures from the committed benchmark results.

Run:  python bench/figures.py [--results bench/results] [--out docs/_static/figures]
      python bench/figures.py --check      # CI: draw every figure into a temporary folder and check it
      python bench/figures.py --summary    # print the figures' numbers (for the page's captions)

The results are ``bench/results/*.json``, written by ``bench/collect.py`` (which runs
``overhead.py`` and ``jaxbind131.py`` twice each, taking turns, then ``numba_kernels.py``,
``thread_safe.py``, ``scaling.py`` and ``solvers.py``; each file keeps the script's own JSON
under "results" and the run's date, load average and versions under "run"). Nothing here
measures anything: the figures are redrawn from the files as they are, and need matplotlib
only (no jax, no jaxbind).

Figures (PNG, 7 inches wide, for a page about 700 px wide):
  per_call.png      per-call cost of jax.pure_callback, buffer_callback, JAXbind 1.3.1 and jaxbind
  per_call_worker.png   the same, in a program XLA runs on its worker threads
  vmap_cores.png    a vmapped walk against a fori_loop of single calls / against one thread
  vmap_batch.png    vmap over 64 x 1000 numbers: the ways each package batches a Python callback
  solvers.png       derivatives through external solvers, with and without residuals
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

from _figure_style import (
    BLUE,
    DARK_BLUE,
    DPI,
    GREY,
    LIGHT_BLUE,
    LIGHT_GREY,
    LIGHT_ORANGE,
    ORANGE,
    OUT,
    RESULTS,
    ROOT,
    WIDTH,
    finish,
    load,
    load_runs,
    number,
    plt,
    spread,
    top_legend,
)
from _figure_vmap import BATCH_ROWS, vmap_batch_figure, vmap_cores_figure
from matplotlib.patches import Patch

# ---------------------------------------------------------------------------
# (a) per call
# ---------------------------------------------------------------------------

PER_CALL_ROWS = [
    # label, file stem, key in per_call_us (caller: the tiny program XLA runs on the Python thread), colour, hatch
    ("jax.pure_callback", "overhead", "jax.pure_callback [caller]", GREY, None),
    ("buffer_callback", "overhead", "buffer_callback [caller]", LIGHT_GREY, None),
    ("JAXbind 1.3.1, NumPy body", "jaxbind131", "JAXbind 1.3.1 python [caller]", ORANGE, None),
    ("JAXbind 1.3.1, empty body", "jaxbind131", "JAXbind 1.3.1 python, empty body [caller]", LIGHT_ORANGE, "//"),
    ("jaxbind, NumPy body", "overhead", "jaxbind python [caller]", BLUE, None),
    ("jaxbind, empty body", "overhead", "jaxbind python, empty body [caller]", LIGHT_BLUE, "//"),
    ("jaxbind, native C kernel", "overhead", "jaxbind native [caller]", DARK_BLUE, None),
]


def per_call_figure(results, path, mode="caller"):
    """``mode``: "caller", the tiny program XLA runs on the calling thread, or "worker", the same loop
    beside an independent sum(sin(x)), which XLA runs on one of its own threads, as it does real programs."""
    runs = {"overhead": load_runs(results, "overhead"), "jaxbind131": load_runs(results, "jaxbind131")}
    if not runs["overhead"]:
        raise SystemExit(f"no overhead-1.json in {results}: run bench/collect.py")
    sizes = [s for s in ("1", "1000", "1000000") if all(s in r["results"]["per_call_us"] for r in runs["overhead"])]
    rows = [row for row in PER_CALL_ROWS if runs[row[1]]]
    fig, ax = plt.subplots(figsize=(WIDTH, 5.0))
    width = 0.8 / len(rows)
    for j, (label, stem, key, colour, hatch) in enumerate(rows):
        for i, size in enumerate(sizes):
            key = key.replace("[caller]", f"[{mode}]")
            values = [
                r["results"]["per_call_us"][size][key]
                for r in runs[stem]
                if key in r["results"]["per_call_us"].get(size, {})
            ]
            if not values:
                continue
            m, low, high = spread(values)
            x = i + (j - (len(rows) - 1) / 2) * width
            ax.bar(
                x,
                m,
                width * 0.92,
                color=colour,
                hatch=hatch,
                edgecolor="white" if hatch else colour,
                linewidth=0,
                label=label if i == 0 else None,
            )
            ax.errorbar(x, m, yerr=[[low], [high]], fmt="none", ecolor="black", elinewidth=0.8, capsize=1.5)
            ax.text(x, m + high, f" {number(m)}", rotation=90, ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylim(0.05, ax.get_ylim()[1] * 2.5)
    ax.set_xticks(range(len(sizes)), [f"{int(s):,} float64" + (" number" if s == "1" else " numbers") for s in sizes])
    ax.set_xlabel("array size (y = 2 x)")
    ax.set_ylabel("time per call, µs (log scale)")
    ax.grid(axis="y", which="major", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    title = (
        "Per-call cost of a callback op inside a jitted loop"
        if mode == "caller"
        else "Per-call cost, in a program XLA runs on its worker threads"
    )
    if not runs["jaxbind131"]:
        title += " (JAXbind 1.3.1: not measured)"
    handles, labels = ax.get_legend_handles_labels()
    blank = Patch(visible=False)
    columns = {"jax": [], "JAXbind": [], "jaxbind": []}  # one column per package
    for h, label in zip(handles, labels):
        columns["jax" if not label.lower().startswith("jaxbind") else label.split()[0].rstrip(",")].append((h, label))
    rows = max(len(c) for c in columns.values())
    cells = [cell for c in columns.values() for cell in c + [(blank, "")] * (rows - len(c))]
    top_legend(fig, [h for h, _ in cells], [label for _, label in cells], ncol=3)
    n = len(runs["overhead"])
    where = (
        "; XLA runs this tiny program on the calling thread."
        if mode == "caller"
        else ", beside an independent sum(sin(x)) that makes XLA run the program on its own threads."
    )
    note = (
        f"(T(K) − T(0)) / K of K calls in one jitted lax.fori_loop with a traced trip count{where}"
        + f" Bars: median of {n} runs taking turns, whiskers: lowest and highest run."
    )
    finish(
        fig,
        path,
        title,
        note,
        runs["overhead"] + runs["jaxbind131"],
        ["overhead-*.json", "jaxbind131-*.json"],
        top=0.05 + 0.2 * rows,
    )


# ---------------------------------------------------------------------------
# (b) vmap and the cores
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# (c) solvers
# ---------------------------------------------------------------------------


def solvers_figure(results, path):
    solvers = load(results, "solvers")
    if solvers is None:
        raise SystemExit(f"no solvers.json in {results}")
    roots, ode = solvers["results"]["root_solve"], solvers["results"]["ode_jacrev"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(WIDTH, 4.4), gridspec_kw={"width_ratios": [1.55, 1]})
    names = list(roots)
    labels = {
        "forward solve alone": "forward\nsolve",
        "jit(grad), residuals": "grad,\nresiduals",
        "jit(grad), no residuals": "grad, no\nresiduals",
    }
    colours = [GREY, BLUE, ORANGE]
    x = range(len(names))
    wall = [1e3 * roots[n]["seconds"] for n in names]
    cpu = [1e3 * roots[n]["cpu_seconds"] for n in names]
    left.bar([i - 0.2 for i in x], wall, 0.38, color=colours, label="wall time")
    left.bar(
        [i + 0.2 for i in x],
        cpu,
        0.38,
        color=colours,
        alpha=0.5,
        hatch="//",
        edgecolor="white",
        label="CPU time of the calling thread",
    )
    for i, n in enumerate(names):
        left.text(i - 0.2, wall[i], f"{roots[n]['ratio']:.2f}×", ha="center", va="bottom", fontsize=8)
        if roots[n]["cpu_ratio"] is not None:
            left.text(i + 0.2, cpu[i], f"{roots[n]['cpu_ratio']:.2f}×", ha="center", va="bottom", fontsize=8)
    left.set_xticks(list(x), [labels.get(n, n) for n in names])
    left.set_ylabel("ms per call")
    left.set_ylim(0, max(wall + cpu) * 1.25)
    left.set_title(
        "Root solve, 16 unknowns by MINPACK's hybrj:\njit(grad) against the forward solve\n", loc="left", fontsize=9.5
    )
    left.legend(
        handles=[
            Patch(color=LIGHT_GREY, label="wall time"),
            Patch(facecolor=LIGHT_GREY, alpha=0.5, hatch="//", edgecolor="white", label="CPU time, calling thread"),
        ],
        loc="upper left",
        frameon=False,
        fontsize=7.5,
    )
    seconds = [ode["jacrev_seconds_with_residuals"], ode["jacrev_seconds_without_residuals"]]
    runs = [ode["lsoda_runs_with_residuals"], ode["lsoda_runs_without_residuals"]]
    right.bar([0, 1], seconds, 0.6, color=[BLUE, ORANGE])
    for i in range(2):
        right.text(
            i,
            seconds[i],
            f"{seconds[i]:.3g} s\n{runs[i]} LSODA run{'s' if runs[i] != 1 else ''}",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    right.set_yscale("log")
    right.set_ylim(min(seconds) / 3, max(seconds) * 8)
    right.set_xticks([0, 1], ["residuals\n(sensitivities)", "no residuals\n(vjp re-solves)"])
    right.set_ylabel("s per jax.jacrev (log scale)")
    right.set_title(
        f"ODE, Lotka–Volterra by LSODA:\njax.jacrev {seconds[1] / seconds[0]:.0f}× faster\nwith residuals",
        loc="left",
        fontsize=9.5,
    )
    note = (
        f"Left: the mean of 20 calls, the median of {solvers['results']['repeats']} interleaved rounds; "
        "labels: ratio to the forward solve. Right: the median of interleaved repetitions of one jacrev of "
        f"the trajectory ({ode['points']} time points) in 6 parameters."
    )
    finish(
        fig,
        path,
        "Derivatives through external solvers: what residuals save",
        note,
        [solvers],
        ["solvers.json"],
        top=0.0,
    )


FIGURES = {
    "per_call.png": per_call_figure,
    "per_call_worker.png": lambda results, path: per_call_figure(results, path, mode="worker"),
    "vmap_cores.png": vmap_cores_figure,
    "vmap_batch.png": vmap_batch_figure,
    "solvers.png": solvers_figure,
}


def summary(results):
    """The figures' numbers as text (medians over the runs), for the captions of docs/performance.md."""
    over, old = load_runs(results, "overhead"), load_runs(results, "jaxbind131")
    for group in (over, old, [load(results, n) for n in ("numba", "thread_safe", "scaling", "solvers")]):
        for r in group:
            if r:
                run = r["run"]
                print(
                    f"{run['script']} {run['started_utc']} load {run['load_average_before'][0]:.2f}"
                    f"→{run['load_average_after'][0]:.2f}, jax {run['versions']['jax']}, "
                    f"jaxbind {run['versions'].get('jaxbind')}"
                )
    for mode in ("caller", "worker"):
        print(f"\nper call [{mode}], µs (median of the runs; lowest–highest):")
        for label, stem, key, _, _ in PER_CALL_ROWS:
            key = key.replace("[caller]", f"[{mode}]")
            cells = []
            for size in ("1", "1000", "1000000"):
                values = [
                    r["results"]["per_call_us"][size][key]
                    for r in (over if stem == "overhead" else old)
                    if key in r["results"]["per_call_us"].get(size, {})
                ]
                if values:
                    cells.append(f"{statistics.median(values):.3g} ({min(values):.3g}–{max(values):.3g})")
            print(f"  {label}: " + " | ".join(cells))
    print("\nvmap 64 x 1000, µs:")
    for label, stem, key, _ in BATCH_ROWS:
        values = [
            r["results"]["other_us"][key]
            for r in (over if stem == "overhead" else old)
            if key in r["results"].get("other_us", {})
        ]
        if values:
            print(f"  {label}: {statistics.median(values):.3g} ({min(values):.3g}–{max(values):.3g})")


def check(results):
    """Draw every figure into a temporary folder; each must be a PNG of the expected width."""
    with tempfile.TemporaryDirectory() as out:
        for name, draw in FIGURES.items():
            path = os.path.join(out, name)
            draw(results, path)
            with open(path, "rb") as handle:
                head = handle.read(24)
            assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{name} is not a PNG"
            width = int.from_bytes(head[16:20], "big")
            assert width == round(WIDTH * DPI), f"{name} is {width} px wide"
            print(f"ok: {name} ({os.path.getsize(path) // 1024} KiB, {width} px wide)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=RESULTS, help="folder of the results files (bench/results)")
    parser.add_argument("--out", default=OUT, help="folder of the PNGs (docs/_static/figures)")
    parser.add_argument("--check", action="store_true", help="draw into a temporary folder and check the files")
    parser.add_argument("--summary", action="store_true", help="print the figures' numbers, draw nothing")
    options = parser.parse_args()
    if options.summary:
        summary(options.results)
        return
    if options.check:
        check(options.results)
        return
    os.makedirs(options.out, exist_ok=True)
    for name, draw in FIGURES.items():
        path = os.path.join(options.out, name)
        draw(options.results, path)
        print(f"written: {os.path.relpath(os.path.abspath(path), ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
