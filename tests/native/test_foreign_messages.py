"""A native kernel's message is foreign text: whatever bytes it writes reach the caller as a
readable error naming the op, and a failing element of a walk reports its own message only.
"""

import _kernels
import jax
import numpy as np
import pytest
from zoo import like_last

import jaxbind

LIB = _kernels.load()


def test_a_message_that_is_not_utf8_is_escaped_and_names_the_op():
    op = jaxbind.get_nonlinear_call(LIB.jb_fail_latin1, None, like_last, None)
    # Latin-1 é, a stray continuation byte, a character cut after its first byte: each a \xNN escape.
    expected = r"op 'jb_fail_latin1': native kernel failed: d\\xe9faut \\x80 de convergence \\xc3"
    with pytest.raises(RuntimeError, match=expected):
        jax.block_until_ready(jax.jit(lambda v: op(v)[0])(np.ones(2)))
    with pytest.raises(RuntimeError, match=expected):  # eager
        jax.block_until_ready(op(np.ones(2))[0])
    with pytest.raises(RuntimeError, match=expected):  # the walk
        jax.block_until_ready(jax.jit(jax.vmap(lambda v: op(v)[0]))(np.ones((8, 2))))


def test_valid_utf8_in_a_message_is_kept_as_it_is():
    # A Python callback's message in any script passes unchanged (it is valid UTF-8 already).
    def fails(out, args, kwargs_dump):
        raise ValueError("défaut de convergence: 残差 ≥ 1e-3 🚫")

    op = jaxbind.get_nonlinear_call(fails, None, like_last, None)
    with pytest.raises((RuntimeError, ValueError), match="défaut de convergence: 残差 ≥ 1e-3 🚫"):
        jax.block_until_ready(jax.jit(lambda v: op(v)[0])(np.ones(2)))


def test_a_message_with_lone_surrogates_is_escaped_not_lost():
    def fails(out, args, kwargs_dump):
        raise ValueError(b"bad byte \xff".decode("utf-8", "surrogateescape"))

    op = jaxbind.get_nonlinear_call(fails, None, like_last, None)
    with pytest.raises((RuntimeError, ValueError), match=r"op 'fails'.*bad byte \\udcff"):
        jax.block_until_ready(jax.jit(lambda v: op(v)[0])(np.ones(2)))


def test_a_silent_failure_in_a_walk_does_not_report_an_earlier_elements_note():
    op = jaxbind.get_nonlinear_call(LIB.jb_note_then_fail_silently, None, like_last, None)
    x = np.arange(12.0).reshape(6, 2)
    np.testing.assert_array_equal(jax.jit(jax.vmap(lambda v: op(v)[0]))(x), x)  # notes, no failure
    x[4, 0] = -1.0  # elements 0-3 succeed, each writing a note; element 4 fails without a message
    with pytest.raises(RuntimeError, match=r"op 'jb_note_then_fail_silently'.*returned 5 without a message") as err:
        jax.block_until_ready(jax.jit(jax.vmap(lambda v: op(v)[0]))(x))
    assert "a stale note" not in str(err.value)
