"""Child processes of the tests, each waited for with a time limit below the per-test one
(``timeout`` in pyproject.toml): a child that outlives it is stopped, and the test fails with what
every child printed so far, its threads' stacks included.

Stopping is SIGABRT first: a child started with :func:`environment` has faulthandler enabled
(``PYTHONFAULTHANDLER=1``), which prints every thread's stack on that signal without needing the GIL
(core files are turned off for the child first); SIGKILL if it is still there ``GRACE`` s later.
"""

import os
import signal
import subprocess
import time

import pytest

GRACE = 20  # seconds a stopped child has to print its stacks and end


def environment(env=None):
    """``env`` (default: this process's) with faulthandler enabled in the child."""
    return {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}


def _abort(process):
    if process.poll() is not None:
        return
    try:
        import resource

        resource.prlimit(process.pid, resource.RLIMIT_CORE, (0, 0))  # no core file of a JAX process
    except (ImportError, AttributeError, OSError, ValueError):
        pass
    try:
        process.send_signal(signal.SIGABRT)
    except ProcessLookupError:
        pass


def _rest_of(process):
    try:
        return process.communicate(timeout=GRACE)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.communicate()


def communicate_all(processes, timeout, what):
    """``[(stdout, stderr), ...]`` of ``processes`` (started with ``stdout=PIPE, stderr=PIPE,
    text=True``), which must all have ended ``timeout`` s from now; otherwise every one still
    running is stopped and the test fails with every child's output."""
    deadline = time.monotonic() + timeout
    outputs, report = [], []
    try:
        try:
            for process in processes:
                outputs.append(process.communicate(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for process in processes:
                _abort(process)
            for k, process in enumerate(processes):
                out, err = outputs[k] if k < len(outputs) else _rest_of(process)
                report.append(
                    f"--- {what}, process {k} (exit status {process.returncode}), stdout:\n"
                    f"{(out or '')[-3000:]}\n--- its stderr:\n{(err or '')[-10000:]}"
                )
    finally:
        for process in processes:  # on any other exception too: none is left behind
            if process.poll() is None:
                process.kill()
                process.communicate()
    if report:
        pytest.fail(
            f"{what}: still running after {timeout:.0f} s, stopped (SIGABRT, then SIGKILL)."
            " Their output so far:\n" + "\n".join(report),
            pytrace=False,
        )
    return outputs


def run(command, timeout, what, **kwargs):
    """``subprocess.run(command, capture_output=True, text=True, **kwargs)`` within ``timeout`` s
    (as :func:`communicate_all`), faulthandler enabled in the child: ``(returncode, stdout, stderr)``."""
    kwargs["env"] = environment(kwargs.get("env"))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    ((out, err),) = communicate_all([process], timeout, what)
    return process.returncode, out, err
