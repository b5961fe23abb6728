"""The suite cannot hang: a test deadlocked inside XLA's custom call ends at its time limit with
every thread's stack printed, by each of the two limits in pyproject.toml.

``_deadlock_case.py`` (not collected by default) deadlocks a thread_safe walk: its threads wait in the
callback, the GIL released, for a barrier that never trips. It runs here in two pytest subprocesses,
side by side, with the repository's configuration and shorter limits:

- pytest-timeout, ``--timeout=20`` and the configured ``timeout_method = "thread"``: its timer thread
  prints every other thread's stack and exits (the "signal" method would wait for the main thread,
  blocked in C, and the run would hang);
- faulthandler, ``-o faulthandler_timeout=20`` with pytest-timeout off (the limit for a hang that
  holds the GIL) and the configured ``faulthandler_exit_on_timeout = true``: its watchdog dumps every
  thread and exits (without the exit the run would hang after the dump).

A run still going after ``OUTER`` s is killed and the test fails: it cannot pass without the limits.
"""

import os
import re
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # pyproject.toml: its [tool.pytest.ini_options]
CASE = os.path.join(HERE, "_deadlock_case.py")
LIMIT = 20  # seconds, the deadlocked test's
OUTER = 120  # seconds, the whole subprocess's (start-up, about 5 s, included)
TEST = "test_a_walk_whose_elements_wait_for_each_other_hangs"
CALLBACK = "wait_for_the_others"
RUNS = {
    "pytest-timeout": [f"--timeout={LIMIT}"],
    "faulthandler": ["--timeout=0", "-o", f"faulthandler_timeout={LIMIT}"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("deadlock_case")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_TIMEOUT")}
    start = time.monotonic()
    processes = {
        # (run from elsewhere, with the repository's configuration: in the repository the source
        # folder jaxbind/ would shadow the installed package)
        name: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pytest",
                CASE,
                "-p",
                "no:cacheprovider",
                "-q",
                "-c",
                os.path.join(ROOT, "pyproject.toml"),
                "--rootdir",
                ROOT,
                *options,
            ],
            cwd=elsewhere,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, options in RUNS.items()
    }
    results, late = {}, []
    try:
        for name, process in processes.items():
            try:
                out, _ = process.communicate(timeout=max(0.0, start + OUTER - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                out, _ = process.communicate()
                late.append(f"--- {name}: still running after {OUTER} s, killed; its output:\n{out[-6000:]}")
                continue
            results[name] = (process.returncode, time.monotonic() - start, out)
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.communicate()
    if late:
        pytest.fail("the deadlocked test was not ended by its limit:\n" + "\n".join(late), pytrace=False)
    return results


def _stacks(out, header):
    """``{thread: its stack}`` of each dump in ``out`` whose header lines match ``header``."""
    parts = re.split(header, out, flags=re.MULTILINE)
    return {parts[k]: parts[k + 1] for k in range(1, len(parts) - 1, 2)}


def _check_run(run, banner, stacks):
    returncode, seconds, out = run
    assert returncode not in (0, None), f"exit status {returncode}:\n{out[-6000:]}"
    assert LIMIT <= seconds < OUTER, (seconds, out[-6000:])
    assert re.search(banner, out, flags=re.MULTILINE), out[-6000:]
    # the main thread (running the test, waiting for XLA) and the walk's threads in the callback
    in_callback = [thread for thread, stack in stacks.items() if CALLBACK in stack]
    assert len(stacks) >= 2 and in_callback, (list(stacks), out[-6000:])
    return out


def test_pytest_timeout_ends_a_deadlocked_walk_with_every_threads_stack(runs):
    out = runs["pytest-timeout"][2]
    # (the thread method's banner: the signal method would end with a failed test instead)
    stacks = _stacks(out, r"^~+ Stack of (.+) ~+$")
    _check_run(runs["pytest-timeout"], r"^\++ Timeout \++$", stacks)
    main = [stack for thread, stack in stacks.items() if thread.startswith("MainThread")]
    assert main and TEST in main[0], (list(stacks), out[-6000:])


def test_faulthandler_ends_a_deadlocked_walk_with_every_threads_stack(runs):
    out = runs["faulthandler"][2]
    # (CPython 3.14 names the thread after its address when the system has a name for it:
    # "Current thread 0x... [python] (most recent call first):")
    stacks = _stacks(out, r"^((?:Current thread|Thread) 0x[0-9a-f]+)(?: \[[^\]\n]*\])? \(most recent call first\):$")
    _check_run(runs["faulthandler"], rf"^Timeout \(0:00:{LIMIT}\)!$", stacks)
    assert any(f"in {TEST}" in stack for stack in stacks.values()), (list(stacks), out[-6000:])
