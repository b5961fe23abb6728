"""The vmap figures of bench/figures.py: a walk over the cores, and the ways of batching a Python callback."""

from __future__ import annotations

from _figure_style import (
    BLUE,
    DARK_BLUE,
    GREEN,
    GREY,
    LIGHT_BLUE,
    LIGHT_GREY,
    LIGHT_ORANGE,
    ORANGE,
    WIDTH,
    finish,
    load,
    load_runs,
    number,
    plt,
    spread,
    top_legend,
)
from matplotlib.patches import Patch


def _cores_rows(numba, scaling, safe) -> list:
    """(label, ratio, detail, colour) of each vmapped walk against its reference, from the results there are."""
    rows = []
    if numba:
        for r in numba["results"]["every_core"]:
            kind = "numba kernel" if r["kernel"].startswith("numba") else "C kernel"
            rows.append(
                (
                    f"{kind}, ~{r['per_element_us']:.0f} µs per element\n(numba_kernels.py)",
                    r["ratio"],
                    f"{r['vmap_us'] / 1e3:.1f} ms vs {r['loop_us'] / 1e3:.1f} ms",
                    GREEN if kind == "numba kernel" else DARK_BLUE,
                )
            )
    if scaling:
        for r in scaling["results"]["every_core"]:
            label = (
                f"C kernel, ~{r['loop_us'] / r['elements']:.0f} µs per element"
                if "jb_busy" in r["case"]
                else "C kernel, < 1 µs per element (4 numbers)"
            )
            detail = (
                f"{r['vmap_us'] / 1e3:.1f} ms vs {r['loop_us'] / 1e3:.1f} ms"
                if r["loop_us"] > 1000
                else f"{r['vmap_us']:.1f} µs vs {r['loop_us']:.1f} µs"
            )
            rows.append((f"{label}\n(scaling.py)", r["ratio"], detail, DARK_BLUE))
    if safe:
        for label, r in safe["results"].items():
            short = (
                "Python callback, NumPy on 10⁵ numbers\n(releases the GIL; thread_safe.py)"
                if "releases" in label
                else "Python callback, Python loop\n(holds the GIL; thread_safe.py)"
            )
            rows.append(
                (short, r["ratio"], f"{number(r['thread_safe_ms'])} ms vs {number(r['one_thread_ms'])} ms", BLUE)
            )
    return rows


def vmap_cores_figure(results, path):
    numba, scaling, safe = load(results, "numba"), load(results, "scaling"), load(results, "thread_safe")
    rows = _cores_rows(numba, scaling, safe)
    if not rows:
        raise SystemExit(f"no numba.json, scaling.json or thread_safe.json in {results}")
    fig, ax = plt.subplots(figsize=(WIDTH, 0.6 * len(rows) + 2.6))
    y = list(range(len(rows)))[::-1]
    ax.barh(y, [r[1] for r in rows], height=0.6, color=[r[3] for r in rows])
    for yi, (_, ratio, detail, _) in zip(y, rows):
        ax.text(
            ratio + 0.02,
            yi,
            f"{ratio:.2f}   ({detail})",
            va="center",
            fontsize=8,
            bbox=dict(facecolor="white", edgecolor="none", pad=0.6, alpha=0.85),
        )
    ax.set_yticks(y, [r[0] for r in rows], fontsize=8.5)
    top = max(1.6, max(r[1] for r in rows) + 0.95)
    ax.set_xlim(0, top)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.axvline(0.5, color="black", linewidth=0.8, linestyle="--")
    ax.text(1.0, len(rows) - 0.45, " 1: no gain", fontsize=7.5, va="bottom")
    ax.text(0.5, len(rows) - 0.45, "2 cores' ideal ", fontsize=7.5, va="bottom", ha="right")
    ax.set_xlabel("time of the vmapped call / time of the reference (lower is faster)")
    ax.set_ylim(-0.6, len(rows) - 0.1)
    top_legend(
        fig,
        [Patch(color=DARK_BLUE), Patch(color=GREEN), Patch(color=BLUE)],
        [
            "C kernel: vmap / 64 single calls in a fori_loop",
            "numba kernel: vmap / 64 single calls in a fori_loop",
            "Python callback: thread_safe=True / the one-thread walk",
        ],
        ncol=1,
    )
    note = (
        "Each time: one whole jitted call, the median of interleaved repetitions after a warm-up "
        "(bench/_timing.py); in brackets: the vmapped call against its reference."
    )
    runs = [r for r in (numba, scaling, safe) if r]
    finish(
        fig,
        path,
        "vmap over 64 elements: one call whose walk spreads over the cores",
        note,
        runs,
        [n for n, r in (("numba.json", numba), ("scaling.json", scaling), ("thread_safe.json", safe)) if r],
        top=0.5,
    )


# ---------------------------------------------------------------------------
# vmap over 64 x 1000: the ways of batching a Python callback
# ---------------------------------------------------------------------------

BATCH_ROWS = [
    # label, file stem, key in other_us, colour
    (
        "jax.pure_callback, vmap_method='sequential'",
        "overhead",
        "vmap 64x1000: pure_callback vmap_method=sequential",
        GREY,
    ),
    (
        "jax.pure_callback, vmap_method='expand_dims'",
        "overhead",
        "vmap 64x1000: pure_callback vmap_method=expand_dims",
        LIGHT_GREY,
    ),
    (
        "jax.pure_callback, vmap_method='broadcast_all'",
        "overhead",
        "vmap 64x1000: pure_callback vmap_method=broadcast_all",
        LIGHT_GREY,
    ),
    ("JAXbind 1.3.1, without func_can_batch", "jaxbind131", "vmap 64x1000: JAXbind 1.3.1 (no func_can_batch)", ORANGE),
    ("JAXbind 1.3.1, func_can_batch", "jaxbind131", "vmap 64x1000: JAXbind 1.3.1 func_can_batch", LIGHT_ORANGE),
    (
        "jaxbind, 64 single calls (64 × per call)",
        "overhead",
        "vmap 64x1000: 64 single calls of jaxbind python",
        LIGHT_BLUE,
    ),
    ("jaxbind, without func_can_batch (one walk)", "overhead", "vmap 64x1000: jaxbind walk (no func_can_batch)", BLUE),
    ("jaxbind, func_can_batch", "overhead", "vmap 64x1000: jaxbind func_can_batch", DARK_BLUE),
]


def vmap_batch_figure(results, path):
    runs = {"overhead": load_runs(results, "overhead"), "jaxbind131": load_runs(results, "jaxbind131")}
    rows = []
    for label, stem, key, colour in BATCH_ROWS:
        values = [r["results"]["other_us"][key] for r in runs[stem] if key in r["results"].get("other_us", {})]
        values = [v for v in values if v == v]  # NaN when its run had no per-call row of 1000
        if values:
            rows.append((label, *spread(values), colour))
    fig, ax = plt.subplots(figsize=(WIDTH, 0.42 * len(rows) + 2.2))
    y = list(range(len(rows)))[::-1]
    for yi, (_label, m, low, high, colour) in zip(y, rows):
        ax.barh(yi, m, height=0.62, color=colour)
        ax.errorbar(m, yi, xerr=[[low], [high]], fmt="none", ecolor="black", elinewidth=0.8, capsize=1.5)
        ax.text(m + high, yi, f"  {number(m)} µs", va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(ax.get_xlim()[0], ax.get_xlim()[1] * 4)
    ax.set_yticks(y, [r[0] for r in rows], fontsize=8.5)
    ax.set_xlabel("time per jitted vmapped call, µs (log scale)")
    ax.grid(axis="x", which="major", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    note = (
        "Each: the median of timed batches of Python-level calls of the jitted vmapped function, except "
        "jaxbind's 64 single calls: 64 × its per-call cost on 1,000 numbers (per_call.png). "
        f"Bars: median of {len(runs['overhead'])} runs taking turns, whiskers: lowest and highest run."
    )
    finish(
        fig,
        path,
        "vmap of y = 2 x (a NumPy callback) over a 64 × 1000 batch",
        note,
        runs["overhead"] + runs["jaxbind131"],
        ["overhead-*.json", "jaxbind131-*.json"],
        top=0.0,
    )
