"""jaxbind ops on JAX's multi-device engine: shard_map, sharded jit, explicit sharding, and a
2-process ``jax.distributed`` job.

The device count is fixed when JAX starts, so the cases run in subprocesses with
``XLA_FLAGS=--xla_force_host_platform_device_count=N``: ``_multidevice_cases.py`` (4 devices; two
subprocesses side by side, one per core) and ``_distributed_worker.py`` (two processes of 2
devices each). Each case there compares against a jax.numpy reference; here each becomes a test.
"""

import json
import os
import socket
import subprocess
import sys

import _multidevice_cases
import _subprocesses
import pytest

import jaxbind

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)  # the shared helpers (_kernels.py)
# Seconds for a test's subprocesses, together: a hang fails with their stacks instead of blocking CI.
# Below the per-test limit (900 s, pyproject.toml); the cases take 120 s on 2 cores. Each child dumps
# its threads' stacks and exits by itself 60 s before (faulthandler, at the top of the scripts), so
# that one is also ended when this process is.
TIMEOUT = 720
DISTRIBUTED_TIMEOUT = 300  # the 2-process job takes 3 s


def _environment(devices, timeout=TIMEOUT):
    env = _subprocesses.environment()
    env["JAXBIND_TEST_CHILD_TIMEOUT"] = str(timeout - 60)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    # The jaxbind this test imported (installed, or a development tree) and the helpers here
    # and in tests/.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(jaxbind.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, TESTS, package_root, env.get("PYTHONPATH")]))
    env.pop("JAX_PLATFORMS", None)
    return env


def _json_of(processes, what, timeout=TIMEOUT):
    outputs = _subprocesses.communicate_all(processes, timeout, what)
    for k, (process, (_out, err)) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0, f"{what}, process {k}, exited with {process.returncode}:\n{err[-4000:]}"
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


@pytest.fixture(scope="module")
def case_results():
    n_shards = 2
    script = os.path.join(HERE, "_multidevice_cases.py")
    processes = [
        subprocess.Popen(
            [sys.executable, script, str(k), str(n_shards)],
            env=_environment(4),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in range(n_shards)
    ]
    results = {}
    for result in _json_of(processes, "the multi-device cases"):
        results.update(result)
    return results


@pytest.mark.parametrize("name", list(_multidevice_cases.CASES))
def test_case(case_results, name):
    result = case_results[name]
    assert result["ok"], f"{name}:\n{result['message']}"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_run_only_their_own_elements():
    """shard_map forward and grad, and vmap over a globally sharded batch of 16, in a
    2-process job (2 devices each): every process checks its shards against NumPy and
    calls the callback only for its own elements."""
    port = _free_port()
    script = os.path.join(HERE, "_distributed_worker.py")
    processes = [
        subprocess.Popen(
            [sys.executable, script, str(pid), str(port)],
            env=_environment(2, DISTRIBUTED_TIMEOUT),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in range(2)
    ]
    reports = _json_of(processes, "the 2-process job", DISTRIBUTED_TIMEOUT)
    for pid, report in enumerate(reports):
        assert report["local_devices"] == 2
        for check, error in report["results"].items():
            assert not error, f"process {pid}, {check}:\n{error}"
        # 16 rows over 4 devices, 2 per process: 8 elements here, 2 blocks of shard_map.
        assert report["calls"]["vmap_global_batch"] == 8, report["calls"]
        assert report["calls"]["shard_map_forward"] == 2, report["calls"]
        assert report["calls"]["shard_map_grad"] == 4, report["calls"]
