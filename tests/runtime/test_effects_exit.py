"""Interpreter exit with ops that have side effects (the exit cases of test_lifetime.py, for effects):
ordered calls still pending when the script ends, ``sys.exit`` while an effect callback runs on an XLA
worker thread, and a script whose ordered calls failed before it ended. Each script writes every call
to a file as the call runs, so that what ran is read after the process has gone.
"""

import os
import sys
import textwrap

import _subprocesses
import pytest

import jaxbind

JAXBIND_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(jaxbind.__file__)))

SCRIPT = textwrap.dedent("""
    import sys, time
    import jax, jax.numpy as jnp, numpy as np
    import jaxbind
    jax.config.update("jax_enable_x64", True)
    how, effect, record = sys.argv[1], sys.argv[2], sys.argv[3]

    def write_down(out, args, kwargs_dump):
        time.sleep(0.05)  # releases the GIL: the main thread goes on towards exit
        x = float(args[0][0])
        with open(record, "a") as f:
            f.write(f"{x:g}\\n")
        if x == 5:
            raise ValueError("got a 5")
        out[0][...] = 2 * args[0]

    like = lambda x, **kwargs: ((x.shape, x.dtype),)
    op = jaxbind.get_nonlinear_call(write_down, None, like, None, effect=effect, name="write_down")

    @jax.jit
    def program(x, y):  # other work beside the op: XLA runs the program on a worker thread
        return op(x)[0], jnp.sin(y) @ jnp.cos(y).T

    y = jnp.ones((300, 300))
    assert float(program(jnp.zeros(1), y)[0][0]) == 0.0
    if how == "failed":
        for start in (4.0, 5.0):
            try:
                jax.block_until_ready(program(jnp.full(1, start), y))
            except Exception as err:
                assert "got a 5" in str(err), err
        assert float(program(jnp.full(1, 6.0), y)[0][0]) == 12.0  # the next call runs
        shape = jax.ShapeDtypeStruct((1,), jnp.float64)
        fails_on_5 = lambda v: v if float(v[0]) != 5 else 1 / 0
        ordered = jax.jit(lambda v: jaxbind.io_callback(fails_on_5, shape, v, ordered=True))
        try:
            jax.block_until_ready(ordered(jnp.full(1, 5.0)))
        except Exception as err:
            assert "division by zero" in str(err), err
        assert float(ordered(jnp.full(1, 7.0))[0]) == 7.0
    else:
        pending = [program(jnp.full(1, float(k)), y) for k in (1, 2, 3, 4, 6, 7, 8, 9)]  # not waited for
    print("exiting", flush=True)
    print("done", file=sys.stderr, flush=True)
    if how == "sys.exit":
        sys.exit(0)
""")


@pytest.mark.parametrize("effect", ["io", "ordered"])
@pytest.mark.parametrize("how", ["end of script", "sys.exit", "failed"])
def test_exit_with_effect_calls_pending_or_failed_is_clean(tmp_path, how, effect):
    script, record = tmp_path / "exit_with_effects.py", tmp_path / "calls.txt"
    script.write_text(SCRIPT)
    env = _subprocesses.environment()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [JAXBIND_PARENT, env.get("PYTHONPATH")]))
    code, out, err = _subprocesses.run(
        [sys.executable, str(script), how, effect, str(record)], 120, "the exit script", env=env
    )
    assert code == 0 and "exiting" in out, err[-3000:]
    at_exit = err.split("done\n", 1)[1]
    assert at_exit == "", at_exit  # no "Exception ignored", no "Fatal Python error"
    calls = [float(line) for line in record.read_text().split()]
    if how == "failed":
        assert calls == [0.0, 4.0, 5.0, 6.0], calls
    else:
        # The calls dispatched before exit all ran before the process ended, ordered ones in program order.
        assert sorted(calls) == [0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 7.0, 8.0, 9.0], calls
        if effect == "ordered":
            assert calls == sorted(calls), calls
