"""Ops with side effects on several threads and devices, and after a failing call (issue 42, item 3).

Each case runs ``_effects_sharded.py`` in a fresh process with 4 forced CPU devices and reads the JSON
line it prints; the script writes "done" to stderr when its work is over, so that what follows is what
the process printed at exit.
"""

import json
import os
import subprocess
import sys

import _subprocesses
import jax
import pytest

import jaxbind

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_effects_sharded.py")
JAXBIND_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(jaxbind.__file__)))
# From jax 0.12 on, a program after one whose ordered callback failed raises that failure once and
# replaces the errored token (jax 0.11.2 and older hand it to every later program: jax-ml/jax#37587).
JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:2])
JAX_REPLACES_A_FAILED_TOKEN = JAX_VERSION >= (0, 12)
# jaxlib 0.5's CPU client now and then fails a program over several devices (shard_map) with the
# failure of the program before it on one of them ("Error dispatching computation: <that failure>"),
# and every later program over those devices then fails so too (ten tries); JAX's own io_callback too
# (one run in ~150 of jax_37587's shard_map with an unordered call). Seen with jax 0.5.3, not with 0.10.2
# or 0.12.0.1 (0.6 to 0.9 not checked). There the test accepts that repeated failure, in shard_map only.
STALE_FAILURE = "Error dispatching computation"
JAX_MAY_REPEAT_A_FAILURE_ON_DEVICES = JAX_VERSION < (0, 6)


def stale(value, where="shard_map") -> bool:
    """Whether ``value`` is the failure of the call before, repeated by jaxlib 0.5 (see above)."""
    return (
        JAX_MAY_REPEAT_A_FAILURE_ON_DEVICES
        and where == "shard_map"
        and isinstance(value, str)
        and STALE_FAILURE in value
        and "got a 5" in value
    )


def run(*args):
    env = _subprocesses.environment()
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [JAXBIND_PARENT, env.get("PYTHONPATH")]))
    process = subprocess.Popen(
        [sys.executable, SCRIPT, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    ((out, err),) = _subprocesses.communicate_all([process], 300, f"_effects_sharded.py {' '.join(args)}")
    at_exit = err.split("done\n", 1)[1] if "done\n" in err else None
    result = json.loads(out.strip().splitlines()[-1]) if out.strip() else None
    return process.returncode, result, err, at_exit


def test_an_op_with_an_effect_never_runs_on_two_threads_at_once_unless_thread_safe():
    # Each call waits up to 0.2 s for a second one to come in: four independent calls in one program,
    # and one call per device under shard_map, would overlap if nothing kept them apart.
    code, result, err, at_exit = run("threads")
    assert code == 0 and result is not None, err[-4000:]
    for name, seen in result.items():
        assert seen["ok"], (name, seen)  # each result is the loop's for the order the calls ran in
        if name.endswith("_safe"):
            # thread_safe=True: the calls may overlap, and under shard_map (one thread per device) they do.
            assert seen["shard_map"] >= 2, (name, seen)
        else:
            assert seen["one_program"] == 1 and seen["shard_map"] == 1, (name, seen)
    assert at_exit == "", at_exit


def test_after_a_call_raises_the_next_runs_right_and_the_process_exits_cleanly():
    # On jaxlib 0.5 each shard_map case runs in a process of its own (a repeated failure, see above,
    # stays with the devices).
    if JAX_MAY_REPEAT_A_FAILURE_ON_DEVICES:
        cases = [(kind, effect, "shard_map") for kind in ("python", "native") for effect in ("io", "ordered")]
        runs = [("jit",), *cases]
    else:
        runs = [()]
    result = {}
    for words in runs:
        code, part, err, at_exit = run("raise", *words)
        assert code == 0 and part is not None, err[-4000:]
        assert at_exit == "", at_exit  # nothing printed at exit ("Exception ignored ..." before)
        result.update(part)
    assert len(result) == 8  # python/native x io/ordered x jit/shard_map
    for name, got in result.items():
        assert got["first_ok"], (name, got)
        assert got["error"] is not None and "got a 5" in got["error"], (name, got)
        # (jax.effects_barrier() right after the failure raises it again for io ops under shard_map, as it
        # does for jax's io_callback: the runtime token of the failed program; the next call replaces it.)
        if got["stale_error"] is not None:
            assert stale(got["stale_error"], "shard_map" if name.endswith("shard_map") else "jit"), (name, got)
            continue
        assert got["after_ok"], (name, got)  # the loop's result from the state the failure left


@pytest.mark.parametrize("impl", ["jaxbind", "jax"])
def test_jax_issue_37587_reproducer(impl):
    # shard_map over 4 CPU devices, an ordered io_callback that raises on a 5 (in the second call).
    code, result, err, at_exit = run("37587", impl)
    assert code == 0 and result is not None, err[-4000:]
    first, failed, *later = result["results"]
    assert first == [0.0, 2.0, 4.0, 6.0]
    assert isinstance(failed, str) and "got a 5" in failed, failed
    if impl == "jaxbind" and stale(later[0]):  # (jaxlib 0.5, now and then: see above; it stays)
        assert all(stale(v) for v in later), later
        assert at_exit == "", at_exit
    elif impl == "jaxbind":
        assert later == [[16.0, 18.0, 20.0, 22.0], [24.0, 26.0, 28.0, 30.0]], later
        assert set(range(16)) - {4, 6, 7} <= set(result["seen"])  # the later calls ran
        assert at_exit == "", at_exit
    elif JAX_REPLACES_A_FAILED_TOKEN:
        # JAX's io_callback from jax 0.12 on: the next ordered call still fails with the cached error, its
        # callback not called, and makes a new token (RuntimeTokenSet.get_token_input); the one after runs.
        assert isinstance(later[0], str) and "got a 5" in later[0], later
        assert later[1] == [24.0, 26.0, 28.0, 30.0], later
        assert not set(range(8, 12)) & set(result["seen"]), result["seen"]
        assert set(range(12, 16)) <= set(result["seen"]), result["seen"]
        assert at_exit == "", at_exit
    else:
        # JAX's io_callback (jax-ml/jax#37587): every later ordered call fails with the cached error, its
        # callback not called, and the error is printed again at exit.
        assert all(isinstance(v, str) and "got a 5" in v for v in later), later
        assert not set(range(8, 16)) & set(result["seen"]), result["seen"]
        assert "Exception ignored" in at_exit, at_exit


@pytest.mark.parametrize("where", ["jit", "shard_map"])
@pytest.mark.parametrize("effect", ["io", "ordered"])
@pytest.mark.parametrize("how", ["op", "io_callback"])
def test_a_failed_last_call_prints_nothing_at_exit(how, effect, where):
    # JAX's own io_callback prints "Exception ignored in atexit callback ... clean_up" (and for an ordered
    # one "... wait_for_tokens") here: its exit hooks wait on the failed program's token.
    code, result, err, at_exit = run("last", how, effect, where)
    assert code == 0 and result is not None, err[-4000:]
    if how == "io_callback":
        assert result["first"] == [0.0, 2.0, 4.0, 6.0], result
    elif where == "jit":  # (under shard_map, the four calls' totals depend on their order: checked above)
        assert result["first"] == [0.0, 1.0, 3.0, 6.0], result
    assert "got a 5" in result["error"], result
    assert at_exit == "", at_exit
