"""The result checks shared by the demos.

Each check prints one ``OK``/``FAIL`` line and records a failure instead of
raising, so that a demo runs all its checks; ``finish()`` then prints the
summary and exits non-zero if any check failed.  The demos import this module
as ``from _checks import ...``, which works because a script's folder is on
``sys.path``.  Running this file itself does nothing.
"""

import sys

import jax
import numpy as np

# Names of the failed checks.  A demo with a check of its own (not a value
# comparison or an expected error) may append to it.
failures = []


def check(name, got, want, rtol=1e-10, atol=1e-10):
    """Compare two arrays, or pytrees of arrays leaf by leaf: shape, dtype, values."""
    got_l = [np.asarray(g) for g in jax.tree_util.tree_leaves(got)]
    want_l = [np.asarray(r) for r in jax.tree_util.tree_leaves(want)]
    ok = len(got_l) == len(want_l)
    diffs = [] if ok else [float("nan")]  # max|diff| is nan where shapes differ
    for g, r in zip(got_l, want_l):
        if g.shape != r.shape:
            ok = False
            diffs.append(float("nan"))
            continue
        ok = ok and g.dtype == r.dtype and np.allclose(g, r, rtol=rtol, atol=atol)
        diffs.append(np.max(np.abs(g - r), initial=0.0))
    err = np.max(diffs, initial=0.0)
    print(f"{'OK  ' if ok else 'FAIL'} {name:50s} max|diff| = {err:.2e}")
    if not ok:
        failures.append(name)


def check_raises(name, fn, exc_type):
    """Check that ``fn()`` raises ``exc_type`` (any other exception propagates)."""
    try:
        fn()
    except exc_type as err:
        print(f"OK   {name:50s} raises {exc_type.__name__}: {str(err).splitlines()[0][:60]}...")
    else:
        print(f"FAIL {name:50s} did not raise {exc_type.__name__}")
        failures.append(name)


def op_check(name, op, *args, **kwargs):
    """Run ``jaxbind.testing.check_op`` on ``op`` at ``args``; an AssertionError is a failed check."""
    import jaxbind.testing

    try:
        summary = jaxbind.testing.check_op(op, *args, **kwargs)
    except AssertionError as err:
        print(f"FAIL {name:50s} {err}")
        failures.append(name)
        return None
    worst = max((c["error"] / c["tolerance"] for c in summary.checks if c["tolerance"]), default=0.0)
    print(f"OK   {name:50s} {len(summary.checks)} checks, worst error/tolerance = {worst:.2e}")
    return summary


def finish():
    """Print the summary line; exit with status 1 if any check failed."""
    if failures:
        print(f"{len(failures)} check(s) FAILED: {failures}")
        sys.exit(1)
    print("OK: all checks passed")
