"""A pytest plugin that counts how often the tests reach JAX's callbacks, and through whose.

    PYTHONPATH=compat pytest -p callback_count <tests>

It loads ``jax_swap`` first (so ``JAXBIND_SWAP`` decides, as there), then wraps whatever
``jax.pure_callback`` and ``jax.experimental.io_callback`` are at that moment, at every place
``jax_swap`` sets them. For each it counts the calls (each time a traced program, or an eager
call, asks for a callback) and the runs (each time the host callback itself is called), per test
file (a call counts for the test tracing it, a run for the test running then), and prints them at
the end of the session with the module the calls went to (``jaxbind.…`` with the swap,
``jax._src.callback`` without). ``JAXBIND_COUNT_PER_TEST=1`` lists the tests too.
Each call wraps its callback afresh (a wrapper lives as long as the program that holds it, as
the callback would).
"""

import collections
import functools
import os
import threading

import jax
import jax._src.callback
import jax.experimental
import jax_swap

_lock = threading.Lock()
_current = ["(outside tests)"]
_calls = collections.Counter()  # (kind, test nodeid) -> calls
_runs = collections.Counter()  # (kind, test nodeid) -> host runs


def _counting_callback(kind, callback):
    def run(*args, **kwargs):
        with _lock:
            _runs[kind, _current[0]] += 1
        return callback(*args, **kwargs)

    try:
        functools.update_wrapper(run, callback)
    except (AttributeError, TypeError):
        pass
    return run


def _counting(kind, impl):
    @functools.wraps(impl)
    def counted(callback, *args, **kwargs):
        with _lock:
            _calls[kind, _current[0]] += 1
        return impl(_counting_callback(kind, callback), *args, **kwargs)

    counted.counted_impl = impl
    return counted


IMPLS = {"pure_callback": jax.pure_callback, "io_callback": jax.experimental.io_callback}
jax.pure_callback = _counting("pure_callback", IMPLS["pure_callback"])
jax.experimental.io_callback = _counting("io_callback", IMPLS["io_callback"])
jax._src.callback.io_callback = jax.experimental.io_callback


def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.nodeid


def _file(nodeid):
    return nodeid.split("::", 1)[0]


def summary_lines():
    """The counts so far, as printed at the end of a session."""
    lines = [f"swap: {'on' if jax_swap.SWAPPED else 'off (JAXBIND_SWAP=0)'}; jax {jax.__version__}"]
    for kind, impl in IMPLS.items():
        keys = sorted({key for key in _calls if key[0] == kind} | {key for key in _runs if key[0] == kind})
        calls = sum(_calls[key] for key in keys)
        runs = sum(_runs[key] for key in keys)
        lines.append(f"{kind} -> {impl.__module__}.{impl.__qualname__}: {calls} calls, {runs} runs")
        per_file = collections.defaultdict(lambda: [0, 0, 0])
        for key in keys:
            entry = per_file[_file(key[1])]
            entry[0] += _calls[key]
            entry[1] += _runs[key]
            entry[2] += 1
        for name, (c, r, n) in sorted(per_file.items()):
            lines.append(f"  {name}: {c} calls, {r} runs, in {n} tests")
        if os.environ.get("JAXBIND_COUNT_PER_TEST") == "1":
            lines.extend(f"    {key[1]}: {_calls[key]} calls, {_runs[key]} runs" for key in keys)
    return lines


def pytest_terminal_summary(terminalreporter):
    terminalreporter.section("callback counts")
    for line in summary_lines():
        terminalreporter.write_line(line)
