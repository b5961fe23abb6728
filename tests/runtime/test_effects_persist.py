"""An ordered op's program outlives its process: through ``jaxbind.export`` and through JAX's persistent
compilation cache it keeps its calls in program order (issue 42). Each case runs ``_effects_job.py`` in
fresh processes and reads the JSON line each prints.
"""

import json
import os
import sys

import _subprocesses

import jaxbind

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_effects_job.py")
JAXBIND_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(jaxbind.__file__)))


def run_job(*args):
    env = _subprocesses.environment()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [JAXBIND_PARENT, env.get("PYTHONPATH")]))
    code, out, err = _subprocesses.run(
        [sys.executable, JOB, *map(str, args)], 240, f"_effects_job.py {' '.join(map(str, args))}", env=env
    )
    assert code == 0, out + err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


IN_ORDER = {"log_in_order": True, "results": True}


def test_an_exported_ordered_program_keeps_its_order_in_another_process(tmp_path):
    blob = tmp_path / "ordered.json"
    made = run_job("export", blob)
    assert made == {"python": {"ordered_effects": 1}, "native": {"ordered_effects": 1}}, made
    assert run_job("import", blob) == {"python": IN_ORDER, "native": IN_ORDER}


def test_an_ordered_program_from_the_persistent_cache_keeps_its_order(tmp_path):
    # An op with an effect runs synchronously, as JAX's io_callback: JAX caches such programs as it
    # caches its own (not before jax 0.11, from 0.11 on), and one loaded from the cache keeps its order.
    cache = tmp_path / "cache"
    cold = run_job("cache", cache)
    warm = run_job("cache", cache)
    assert cold["jax"] == {"hit": False}
    for kind in ("python", "native"):
        assert cold[kind] == {**IN_ORDER, "hit": False}, (kind, cold)
        assert warm[kind] == {**IN_ORDER, "hit": warm["jax"]["hit"]}, (kind, warm)
