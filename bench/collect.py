"""Run the benchmarks the documentation's figures are drawn from, and keep their results.

Run:  python bench/collect.py [--jaxbind131-python /work/venv-jaxbind131/bin/python] [--quick] [--pairs 3]
                              [--only overhead,numba,thread_safe,scaling,solvers,setup] [--out bench/results]
then: python bench/figures.py

Each benchmark runs as its own process, one after the other, from a temporary directory
(this repository's ``jaxbind/`` folder would shadow the installed package). The comparison
with JAXbind 1.3.1 alternates processes: ``overhead.py``, ``jaxbind131.py``, ``overhead.py``,
``jaxbind131.py``, ... (``--pairs`` of each, 3 by default; ``jaxbind131.py`` in the venv its
docstring describes), so both see the same machine at the same time. Every results file is
``bench/results/NAME.json``:

    {"run": {what ran, when (UTC), for how long, the load average before and after,
             the versions of Python, jax, jaxlib, numpy, numba, jaxbind in that process},
     "results": what the benchmark script wrote with --json}

``--only`` reruns some of them and leaves the other files as they are; a group's files are
replaced only when every run of the group succeeded. ``--only io_callback`` runs
``io_callback.py`` (no figure draws it, so it is not in the default list).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

VERSIONS = """
import json, platform, sys
from importlib import metadata
versions = {"python": platform.python_version(), "machine": platform.machine(),
            "processor": platform.processor()}
for name in ("jax", "jaxlib", "numpy", "numba", "scipy", "jaxbind"):
    try:
        versions[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        pass
print(json.dumps(versions))
"""


def versions_of(python):
    return json.loads(
        subprocess.run(
            [python, "-c", VERSIONS], cwd=tempfile.gettempdir(), capture_output=True, text=True, check=True
        ).stdout
    )


def run_one(name, python, script, extra, workdir):
    """Run ``script`` with ``--json`` into ``workdir``; its results wrapped with the run's facts."""
    target = os.path.join(workdir, f"{name}.json")
    command = [python, os.path.join(HERE, script), "--json", target, *extra]
    started = datetime.datetime.now(datetime.UTC)
    load_before = os.getloadavg()
    clock = time.perf_counter()
    print(f"[{started:%H:%M:%S}] {name}: {' '.join(command[1:])} (load {load_before[0]:.2f})", flush=True)
    completed = subprocess.run(command, cwd=tempfile.gettempdir(), capture_output=True, text=True)
    seconds = time.perf_counter() - clock
    load_after = os.getloadavg()
    if completed.returncode != 0:
        sys.stderr.write(completed.stdout + completed.stderr)
        raise SystemExit(f"{name} failed ({completed.returncode})")
    with open(target) as handle:
        results = json.load(handle)
    run = {
        "script": f"bench/{script}",
        "arguments": extra,
        "started_utc": started.isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "versions": versions_of(python),
        "printed": completed.stdout,
    }
    print(f"    {seconds:.0f} s, load {load_after[0]:.2f} after", flush=True)
    return {"run": run, "results": results}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--jaxbind131-python",
        default="/work/venv-jaxbind131/bin/python",
        help="the Python of a venv with jaxbind==1.3.1 (see bench/jaxbind131.py)",
    )
    parser.add_argument("--quick", action="store_true", help="the benchmarks' --quick modes (not for the figures)")
    parser.add_argument("--only", default="overhead,numba,thread_safe,scaling,solvers,setup")
    parser.add_argument(
        "--pairs", type=int, default=3, help="how many times overhead.py and jaxbind131.py each run, taking turns"
    )
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    options = parser.parse_args()
    quick = ["--quick"] if options.quick else []
    me = sys.executable
    groups = {
        # name: [(file name, python, script, extra arguments), ...]
        "overhead": [
            run
            for k in range(1, options.pairs + 1)
            for run in (
                (f"overhead-{k}", me, "overhead.py", quick),
                (f"jaxbind131-{k}", options.jaxbind131_python, "jaxbind131.py", quick),
            )
        ],
        "numba": [("numba", me, "numba_kernels.py", quick)],
        "thread_safe": [("thread_safe", me, "thread_safe.py", quick)],
        "scaling": [("scaling", me, "scaling.py", quick)],
        "solvers": [("solvers", me, "solvers.py", quick)],
        "setup": [("setup", me, "setup_state.py", quick)],
        "io_callback": [("io_callback", me, "io_callback.py", quick)],
    }
    wanted = [g for g in options.only.split(",") if g]
    unknown = set(wanted) - set(groups)
    if unknown:
        parser.error(f"unknown groups {sorted(unknown)}; known: {', '.join(groups)}")
    os.makedirs(options.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        for group in wanted:
            done = {
                name: run_one(name, python, script, extra, workdir) for name, python, script, extra in groups[group]
            }
            if group == "overhead":  # no stale runs of an earlier, longer series
                for stem in ("overhead", "jaxbind131"):
                    k = options.pairs + 1
                    while os.path.exists(stale := os.path.join(options.out, f"{stem}-{k}.json")):
                        os.remove(stale)
                        k += 1
            for name, wrapped in done.items():
                with open(os.path.join(options.out, f"{name}.json"), "w") as handle:
                    json.dump(wrapped, handle, indent=1)
                    handle.write("\n")
    print(f"written: {options.out}")


if __name__ == "__main__":
    main()
