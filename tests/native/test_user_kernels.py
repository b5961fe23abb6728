"""Native kernels in the forms a user writes them: compiled by the user against the public
header (a kernel running without the GIL), an address, a PyCapsule, a CFUNCTYPE, a numba
cfunc; concurrent kernels; the test kernels' own dtype checks. The op kinds under every
transformation, Python callbacks beside native kernels, are in ``transforms/test_zoo.py``."""

import ctypes
import shutil
import subprocess
import threading

import _kernels
import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from zoo import FACTOR, TIGHT, like_first, like_last, loss_of, reference_scale

import jaxbind

LIB = _kernels.load()
# ---------------------------------------------------------------------------
# 9. A kernel written and compiled by the user against the public header
# ---------------------------------------------------------------------------

USER_KERNELS = r"""
#define _POSIX_C_SOURCE 199309L
#include <time.h>
#include <jaxbind.h>

int64_t axpb_calls = 0; /* how many times the kernels ran, read from Python */

static int float64_only(const jaxbind_call *call, const char *who) {
  if (call->abi_version < JAXBIND_ABI_VERSION || call->struct_size < (int64_t)sizeof(jaxbind_call))
    return jaxbind_fail(call, "%s: ABI %lld, struct of %lld bytes", who,
                        (long long)call->abi_version, (long long)call->struct_size);
  for (int64_t i = 0; i < call->n_in; ++i) {
    if (call->in[i].dtype != JAXBIND_FLOAT64)
      return jaxbind_fail(call, "%s: input %lld has dtype code %lld, only float64 (%d) is supported",
                          who, (long long)i, (long long)call->in[i].dtype, JAXBIND_FLOAT64);
  }
  return 0;
}

/* y = a x + b, with float kwargs a and b. */
int axpb(const jaxbind_call *call) {
  __atomic_fetch_add(&axpb_calls, 1, __ATOMIC_RELAXED);
  if (float64_only(call, "axpb")) return 1;
  const double a = jaxbind_kwarg_float(call, "a", 1.0), b = jaxbind_kwarg_float(call, "b", 0.0);
  const double *x = call->in[0].data;
  double *y = call->out[0].data;
  for (int64_t i = 0, n = jaxbind_size(&call->in[0]); i < n; ++i) y[i] = a * x[i] + b;
  return 0;
}

/* dy = a t for the last input t: the jvp (x, t) and vjp (x, ct) of axpb, and
 * the linear map x -> a x, which is its own transpose. */
int axpb_linear_part(const jaxbind_call *call) {
  if (float64_only(call, "axpb_linear_part")) return 1;
  const double a = jaxbind_kwarg_float(call, "a", 1.0);
  const jaxbind_array *t = &call->in[call->n_in - 1];
  const double *u = t->data;
  double *y = call->out[0].data;
  for (int64_t i = 0, n = jaxbind_size(t); i < n; ++i) y[i] = a * u[i];
  return 0;
}

/* func_can_batch: inputs (offset, a scalar; x, batched anywhere), out[0] =
 * a x + offset over the whole batch in one call; out[1] (int64, its first 8
 * entries) = [batch_levels, entries of batch_axes, those entries, -2...]. */
int axpb_batched(const jaxbind_call *call) {
  __atomic_fetch_add(&axpb_calls, 1, __ATOMIC_RELAXED);
  if (float64_only(call, "axpb_batched")) return 1;
  if (call->n_in != 2 || call->n_out != 2 || call->in[0].rank != 0 || call->out[1].dtype != JAXBIND_INT64)
    return jaxbind_fail(call, "axpb_batched: unexpected signature");
  const jaxbind_kwarg *levels = jaxbind_find_kwarg(call, "batch_levels");
  const jaxbind_kwarg *axes = jaxbind_find_kwarg(call, "batch_axes");
  if (!levels || levels->type != JAXBIND_KW_INT || !axes || axes->type != JAXBIND_KW_INT_ARRAY)
    return jaxbind_fail(call, "axpb_batched: no batch kwargs");
  int64_t *report = call->out[1].data;
  for (int k = 0; k < 8; ++k) report[k] = -2;
  report[0] = levels->int_value;
  report[1] = axes->size;
  for (int64_t k = 0; k < axes->size && k < 6; ++k) report[2 + k] = axes->int_array[k];
  const double a = jaxbind_kwarg_float(call, "a", 1.0), offset = *(const double *)call->in[0].data;
  const double *x = call->in[1].data;
  double *y = call->out[0].data;
  for (int64_t i = 0, n = jaxbind_size(&call->in[1]); i < n; ++i) y[i] = a * x[i] + offset;
  return 0;
}

/* A handshake with a Python thread that holds the GIL (see the GIL test). */
static int gil_entered = 0, gil_go = 0, gil_done = 0;

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int wait_for(int *flag, double timeout) {
  const double end = seconds() + timeout;
  while (!__atomic_load_n(flag, __ATOMIC_ACQUIRE)) {
    if (seconds() > end) return 0;
  }
  return 1;
}

void gil_reset(void) {
  __atomic_store_n(&gil_entered, 0, __ATOMIC_RELEASE);
  __atomic_store_n(&gil_go, 0, __ATOMIC_RELEASE);
  __atomic_store_n(&gil_done, 0, __ATOMIC_RELEASE);
}

int gil_wait_entered(double timeout) { return wait_for(&gil_entered, timeout); }

int gil_go_and_wait_done(double timeout) {
  __atomic_store_n(&gil_go, 1, __ATOMIC_RELEASE);
  return wait_for(&gil_done, timeout);
}

/* out = 2 in (float64), once the test says go. */
int gil_kernel(const jaxbind_call *call) {
  __atomic_store_n(&gil_entered, 1, __ATOMIC_RELEASE);
  if (!wait_for(&gil_go, 10.0)) return jaxbind_fail(call, "gil_kernel: no go within 10 s");
  const double *x = call->in[0].data;
  double *y = call->out[0].data;
  for (int64_t i = 0, n = jaxbind_size(&call->in[0]); i < n; ++i) y[i] = 2.0 * x[i];
  __atomic_store_n(&gil_done, 1, __ATOMIC_RELEASE);
  return 0;
}
"""


@pytest.fixture(scope="module")
def user_lib(tmp_path_factory):
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler (cc) found to build a user kernel")
    folder = tmp_path_factory.mktemp("user_kernel")
    source, library = folder / "axpb.c", folder / "libaxpb.so"
    source.write_text(USER_KERNELS)
    subprocess.run(
        [
            compiler,
            "-shared",
            "-fPIC",
            "-O2",
            "-Wall",
            "-Werror",
            f"-I{jaxbind.get_include()}",
            str(source),
            "-o",
            str(library),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return ctypes.CDLL(str(library))


def calls_of(lib):
    return ctypes.c_int64.in_dll(lib, "axpb_calls").value


def test_native_kernel_runs_while_another_thread_holds_the_gil(user_lib):
    # A Python thread runs a compiled op whose kernel waits for a go. Once the
    # kernel has started, the main thread enters C through ctypes.PyDLL, which
    # keeps the GIL, gives the go and waits for the kernel to finish: that can
    # only happen if the kernel runs without the GIL.
    holding_gil = ctypes.PyDLL(user_lib._name)
    holding_gil.gil_go_and_wait_done.argtypes = [ctypes.c_double]
    user_lib.gil_wait_entered.argtypes = [ctypes.c_double]
    op = jaxbind.get_nonlinear_call(
        user_lib.gil_kernel, (user_lib.gil_kernel, user_lib.gil_kernel), like_first, like_first, first_n_args_fixed=1
    )
    x = np.arange(4.0)
    compiled = jax.jit(lambda v: op(v)[0]).lower(x).compile()  # compiling runs no kernel
    user_lib.gil_reset()
    result = {}

    def run():
        try:
            result["y"] = np.asarray(compiled(x))
        except Exception as err:  # reported below
            result["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    entered = user_lib.gil_wait_entered(10.0)  # a CDLL call: the GIL is released here
    finished = holding_gil.gil_go_and_wait_done(10.0) if entered else 0  # the GIL is held here
    thread.join()
    assert entered == 1, "the kernel did not start"
    assert finished == 1, "the kernel could not finish while the main thread held the GIL"
    assert "error" not in result, result.get("error")
    np.testing.assert_allclose(result["y"], 2 * x)


A, B = 1.5, -0.25


def test_user_kernel_affine_nonlinear_op(user_lib, rand):
    op = jaxbind.get_nonlinear_call(
        user_lib.axpb, (user_lib.axpb_linear_part, user_lib.axpb_linear_part), like_first, like_first
    )
    f = lambda v: op(v, a=A, b=B)[0]
    x = rand(3, 4)
    np.testing.assert_allclose(jax.jit(f)(x), A * x + B, **TIGHT)
    loss = lambda g: lambda v: jnp.sum(jnp.sin(g(v)))
    np.testing.assert_allclose(jax.jit(jax.grad(loss(f)))(x), jax.grad(loss(lambda v: A * v + B))(x), **TIGHT)
    jax.test_util.check_grads(f, (x,), order=1, modes=("fwd", "rev"))
    xs = rand(5, 3)
    before = calls_of(user_lib)
    np.testing.assert_allclose(jax.jit(jax.vmap(f, in_axes=1))(xs), (A * xs + B).T, **TIGHT)
    assert calls_of(user_lib) - before == 3  # walked by jaxbind: one call per element
    got = jax.vmap(jax.grad(loss(f)))(xs)
    np.testing.assert_allclose(got, jax.vmap(jax.grad(loss(lambda v: A * v + B)))(xs), **TIGHT)


def test_user_kernel_linear_part_and_its_transpose(user_lib, rand):
    op = jaxbind.get_linear_call(user_lib.axpb_linear_part, user_lib.axpb_linear_part, like_last, like_last)
    f = lambda v: op(v, a=A)[0]
    x, ct = rand(4, 2), rand(4, 2)
    np.testing.assert_allclose(jax.jit(f)(x), A * x, **TIGHT)
    np.testing.assert_allclose(jax.linear_transpose(f, x)(ct)[0], A * ct, **TIGHT)
    np.testing.assert_allclose(jax.vmap(jax.grad(lambda v: jnp.sum(f(v) ** 2)))(x), 2 * A * A * x, **TIGHT)
    jax.test_util.check_grads(f, (x,), order=2, modes=("fwd", "rev"))


def test_user_kernel_reports_dtype_error(user_lib):
    op = jaxbind.get_nonlinear_call(
        user_lib.axpb, (user_lib.axpb_linear_part, user_lib.axpb_linear_part), like_first, like_first
    )
    with pytest.raises(
        RuntimeError, match=r"op 'axpb'.*axpb: input 0 has dtype code 11, only float64 \(12\) is supported"
    ):
        jax.block_until_ready(jax.jit(lambda v: op(v, a=A, b=B)[0])(np.ones(3, np.float32)))
    np.testing.assert_allclose(op(np.ones(3), a=A, b=B)[0], np.full(3, A + B))


def axpb_batched_abstract(offset, x, *, batch_axes, a=1.0):
    if batch_axes is None:
        return ((x.shape, x.dtype), ((8,), np.int64))
    x_axes = batch_axes[1]
    assert batch_axes[0] == ()  # the fixed scalar is mapped at no level
    sizes = tuple(x.shape[axis] for axis in x_axes)
    return ((x.shape, x.dtype, x_axes[-1]), (sizes + (8,), np.int64, len(sizes) - 1))


def test_user_kernel_sees_batch_levels_and_axes(user_lib, rand):
    op = jaxbind.get_nonlinear_call(
        user_lib.axpb_batched,
        (user_lib.axpb_batched, user_lib.axpb_batched),
        axpb_batched_abstract,
        axpb_batched_abstract,
        first_n_args_fixed=2,
        func_can_batch=True,
    )
    offset = np.float64(0.5)
    f = lambda o, v: op(o, v, a=A)
    x = rand(3, 4)

    y, report = jax.jit(f)(offset, x)
    np.testing.assert_allclose(y, A * x + offset, **TIGHT)
    np.testing.assert_array_equal(report, [0, 0, -2, -2, -2, -2, -2, -2])

    before = calls_of(user_lib)
    y, report = jax.jit(jax.vmap(f, in_axes=(None, 1)))(offset, x)
    assert calls_of(user_lib) - before == 1  # the whole batch in one call
    np.testing.assert_allclose(y, (A * x + offset).T, **TIGHT)
    # one level; flat batch_axes [offset: -1, x: 1]
    np.testing.assert_array_equal(report[0], [1, 2, -1, 1, -2, -2, -2, -2])

    xs = rand(2, 3, 4)
    g = jax.vmap(jax.vmap(f, in_axes=(None, 1)), in_axes=(None, 0))
    before = calls_of(user_lib)
    y, report = jax.jit(g)(offset, xs)
    assert calls_of(user_lib) - before == 1
    np.testing.assert_allclose(y, np.swapaxes(A * xs + offset, 1, 2), **TIGHT)
    # two levels, the inner vmap first: x's axes (2, 0) in the full array
    np.testing.assert_array_equal(report[0, 0], [2, 4, -1, -1, 2, 0, -2, -2])


# ---------------------------------------------------------------------------
# 10. Other forms of the same kernel: an address, a PyCapsule, a CFUNCTYPE
# ---------------------------------------------------------------------------

SCALE_ADDRESS = ctypes.cast(LIB.jb_scale, ctypes.c_void_p).value


def make_capsule(address, name=b"jaxbind_kernel"):
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(address, name, None)


def kernel_forms():
    return {
        "ctypes": LIB.jb_scale,
        "native": jaxbind.native(SCALE_ADDRESS),
        "native_named": jaxbind.native(SCALE_ADDRESS, name="scale_by_address", keepalive=LIB),
        "capsule": make_capsule(SCALE_ADDRESS),
        "capsule_unnamed": make_capsule(SCALE_ADDRESS, None),
        "cfunctype": ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(SCALE_ADDRESS),
    }


@pytest.mark.parametrize("form", sorted(kernel_forms()))
def test_kernel_forms_give_the_same_results(form, rand):
    kernel = kernel_forms()[form]
    op = jaxbind.get_linear_call(kernel, kernel, like_last, like_last)
    x = rand(3, 2, dtype=np.complex128)
    f = lambda v: op(v, factor=FACTOR)[0]
    np.testing.assert_allclose(jax.jit(f)(x), FACTOR * x, **TIGHT)
    np.testing.assert_allclose(jax.vmap(f, in_axes=1)(x), FACTOR * x.T, **TIGHT)
    np.testing.assert_allclose(jax.grad(loss_of(f))(x), jax.grad(loss_of(reference_scale))(x), **TIGHT)


def test_kernel_form_names():
    assert jaxbind.get_linear_call(LIB.jb_scale, LIB.jb_scale, like_last, like_last).name == "jb_scale"
    named = jaxbind.native(SCALE_ADDRESS, name="scale_by_address")
    op = jaxbind.get_linear_call(named, named, like_last, like_last)
    assert op.name == "scale_by_address"
    unnamed = jaxbind.get_linear_call(jaxbind.native(SCALE_ADDRESS), LIB.jb_scale, like_last, like_last)
    assert unnamed.name == "jb_scale"  # the exported symbol at the address (dladdr)
    fails = jaxbind.native(ctypes.cast(LIB.jb_fail, ctypes.c_void_p).value, name="my_failing_kernel")
    bad = jaxbind.get_linear_call(
        fails, fails, like_first, like_first
    )  # (not equal to an op of LIB.jb_fail, named 'jb_fail')
    with pytest.raises(RuntimeError, match=r"op 'my_failing_kernel'.*on purpose"):
        jax.block_until_ready(bad(np.ones(2))[0])
    with pytest.raises(RuntimeError, match=r"op 'my_failing_kernel'.*on purpose"):
        jax.block_until_ready(jax.jit(lambda v: bad(v)[0])(np.ones(2)))


def test_same_address_under_another_name_is_another_op():
    # Equal ops share compiled code, so kernels are equal by address *and*
    # name: an error always names the op that was called, eager or jitted.
    def abstract(x, **kwargs):  # a fresh abstract: no other test's op is equal to these
        return ((x.shape, x.dtype),)

    address = ctypes.cast(LIB.jb_fail, ctypes.c_void_p).value
    first = jaxbind.get_linear_call(LIB.jb_fail, LIB.jb_fail, abstract, abstract)
    second = jaxbind.get_linear_call(
        jaxbind.native(address, name="second"), jaxbind.native(address, name="second"), abstract, abstract
    )
    assert first != second and first.name == "jb_fail" and second.name == "second"
    for call in (lambda op, v: op(v)[0], lambda op, v: jax.jit(lambda u: op(u)[0])(v)):
        with pytest.raises(RuntimeError, match=r"op 'jb_fail'"):
            jax.block_until_ready(call(first, np.ones(2)))
        with pytest.raises(RuntimeError, match=r"op 'second'"):
            jax.block_until_ready(call(second, np.ones(2)))


def test_equal_kernels_make_equal_ops():
    forms = kernel_forms()
    address = jaxbind.native(SCALE_ADDRESS)
    assert address == jaxbind.native(SCALE_ADDRESS) and hash(address) == hash(jaxbind.native(SCALE_ADDRESS))
    # an address without a name takes the exported symbol's: the same kernel as named so by hand
    named = jaxbind.native(SCALE_ADDRESS, name="jb_scale")
    assert address.__name__ == "jb_scale" and named == address and hash(named) == hash(address)
    assert jaxbind.native(SCALE_ADDRESS, name="other") != address
    assert jaxbind.native(SCALE_ADDRESS) != jaxbind.native(ctypes.cast(LIB.jb_fail, ctypes.c_void_p).value)

    def op_of(f, f_T, **flags):
        return jaxbind.get_linear_call(f, f_T, like_last, like_last, **flags)

    # every form of the address is named after its symbol: one kernel, equal ops
    same = [op_of(LIB.jb_scale, LIB.jb_scale), op_of(named, named), op_of(LIB.jb_scale, named)]
    same += [op_of(forms[k], forms[k]) for k in ("native", "capsule", "capsule_unnamed", "cfunctype")]
    same.append(op_of(forms["native"], forms["capsule"]))
    for op in same:
        assert op == same[0] and hash(op) == hash(same[0])
    other_name = jaxbind.native(SCALE_ADDRESS, name="scale_by_address")
    assert op_of(other_name, other_name) != same[0]
    assert op_of(LIB.jb_scale, LIB.jb_fail) != same[0]
    assert op_of(LIB.jb_scale, LIB.jb_scale, func_can_batch=True) != same[0]
    assert op_of(LIB.jb_scale, LIB.jb_scale, first_n_args_fixed=1) != same[0]


# ---------------------------------------------------------------------------
# 11. A numba cfunc reading the call struct as int64 fields
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def numba_scale():
    """A numba cfunc: out[0] = factor * in[last] (float64; kwarg "factor", default 3).

    All fields of jaxbind_call, jaxbind_array and jaxbind_kwarg are 8 bytes, so
    the kernel reads them as int64 arrays and turns addresses into typed
    arrays with a small inttoptr intrinsic.
    """
    numba = pytest.importorskip("numba")
    from numba import carray, types
    from numba.extending import intrinsic

    def pointer_to(element):
        @intrinsic
        def as_pointer(typingctx, address):
            def codegen(context, builder, signature, args):
                return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

            return types.CPointer(element)(types.int64), codegen

        return as_pointer

    i64_ptr, f64_ptr, u8_ptr = pointer_to(types.int64), pointer_to(types.float64), pointer_to(types.uint8)
    factor_name = np.frombuffer(b"factor\0", np.uint8)
    message = np.frombuffer(b"numba kernel: float64 only\0", np.uint8)

    @numba.njit
    def has_name(address, expected):
        chars = carray(u8_ptr(address), expected.size)
        for k in range(expected.size):
            if chars[k] != expected[k]:
                return False
        return True

    @numba.cfunc(types.int32(types.CPointer(types.int64)), nopython=True)
    def numba_scale(call_address):
        call = carray(call_address, 10)  # struct_size, abi, n_out, out, n_in, in, n_kw, kw, error, error_size
        x = carray(i64_ptr(call[5] + 32 * (call[4] - 1)), 4)  # data, shape, rank, dtype
        y = carray(i64_ptr(call[3]), 4)
        if x[3] != 12 or y[3] != 12:
            error = carray(u8_ptr(call[8]), call[9])
            for k in range(min(message.size, call[9])):
                error[k] = message[k]
            return 1
        shape = carray(i64_ptr(x[1]), x[2])
        n = 1
        for d in range(x[2]):
            n *= shape[d]
        factor = 3.0
        kwargs = carray(i64_ptr(call[7]), 8 * call[6])  # name, type, size, int, float, str, ints, floats
        kwargs_f = carray(f64_ptr(call[7]), 8 * call[6])
        for k in range(call[6]):
            if has_name(kwargs[8 * k], factor_name):
                if kwargs[8 * k + 1] == 2:
                    factor = kwargs_f[8 * k + 4]
                elif kwargs[8 * k + 1] == 1:
                    factor = float(kwargs[8 * k + 3])
        xs = carray(f64_ptr(x[0]), n)
        ys = carray(f64_ptr(y[0]), n)
        for i in range(n):
            ys[i] = factor * xs[i]
        return 0

    return numba_scale


def test_numba_cfunc_kernel(numba_scale, rand):
    op = jaxbind.get_linear_call(numba_scale, numba_scale, like_last, like_last)
    assert op.name == "numba_scale"
    x = rand(3, 4)
    np.testing.assert_allclose(op(x)[0], 3 * x, **TIGHT)
    f = lambda v: op(v, factor=FACTOR)[0]
    np.testing.assert_allclose(jax.jit(f)(x), FACTOR * x, **TIGHT)
    np.testing.assert_allclose(op(x, factor=-2)[0], -2 * x, **TIGHT)  # an int kwarg
    np.testing.assert_allclose(jax.grad(loss_of(f))(x), jax.grad(loss_of(reference_scale))(x), **TIGHT)
    np.testing.assert_allclose(jax.vmap(f, in_axes=1)(x), FACTOR * x.T, **TIGHT)
    jax.test_util.check_grads(f, (x,), order=2, modes=("fwd", "rev"))
    # the same cfunc as an address with its name: an equal op
    same = jaxbind.native(numba_scale.address, name="numba_scale")
    assert jaxbind.get_linear_call(same, same, like_last, like_last) == op


def test_numba_cfunc_kernel_error(numba_scale):
    op = jaxbind.get_linear_call(numba_scale, numba_scale, like_last, like_last)
    with pytest.raises(RuntimeError, match=r"op 'numba_scale'.*numba kernel: float64 only"):
        jax.block_until_ready(jax.jit(lambda v: op(v)[0])(np.ones(3, np.float32)))


# ---------------------------------------------------------------------------
# Concurrent kernels: run on XLA's thread pool while XLA goes on
# ---------------------------------------------------------------------------


def concurrent_scale_op():
    kernel = jaxbind.native(LIB.jb_scale, concurrent=True)
    return jaxbind.get_linear_call(kernel, kernel, like_last, like_last)


def test_concurrent_kernel_under_every_transformation(rng):
    op = concurrent_scale_op()
    x = rng.standard_normal((4, 3))
    f = lambda v: op(v, factor=3.0)[0]
    np.testing.assert_allclose(jax.jit(f)(x), 3 * x)
    np.testing.assert_allclose(jax.grad(lambda v: jnp.sum(f(v) ** 2))(x), 18 * x)
    np.testing.assert_allclose(jax.jit(jax.vmap(f, in_axes=1))(x), 3 * x.T)
    text = jax.jit(f).lower(x).as_text()
    assert "jaxbind_dispatch_async" in text


def test_concurrent_kernel_error_names_the_op():
    kernel = jaxbind.native(LIB.jb_fail, concurrent=True)
    op = jaxbind.get_linear_call(kernel, kernel, like_last, like_last)
    with pytest.raises(RuntimeError, match=r"op 'jb_fail'.*kernel failed on purpose \(code=5\)"):
        jax.block_until_ready(jax.jit(lambda v: op(v, code=5)[0])(np.ones(2)))
    np.testing.assert_allclose(jax.jit(lambda v: concurrent_scale_op()(v)[0])(np.ones(2)), 2 * np.ones(2))


def test_concurrent_and_plain_kernels_are_different_ops():
    plain = jaxbind.native(LIB.jb_scale)
    concurrent = jaxbind.native(LIB.jb_scale, concurrent=True)
    assert plain != concurrent and concurrent == jaxbind.native(LIB.jb_scale, concurrent=True)
    assert concurrent.__name__ == "jb_scale"


def test_independent_concurrent_chains_give_right_results():
    # Two independent chains of calls in a program XLA runs as a dataflow graph.
    kernel = jaxbind.native(LIB.jb_busy, concurrent=True)
    busy = jaxbind.get_linear_call(kernel, kernel, like_last, like_last)

    def chain(a):
        for _ in range(5):
            a = busy(a, iterations=3000)[0]
        return a

    x = np.linspace(0.0, 1.0, 1000)
    a, b = jax.jit(lambda u, v: (chain(u), chain(v)))(x, x + 1)
    step = np.sin(np.arange(3000.0)).sum() / 3000
    np.testing.assert_allclose(a, x + 5 * step, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(b, x + 1 + 5 * step, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", ["jb_xsin", "jb_busy", "jb_double", "jb_triple_and_sum"])
def test_test_kernels_refuse_a_dtype_they_do_not_handle(kernel):
    # A kernel that assumes float64 and gets float32 would read and write past
    # the ends of the buffers: it checks and fails instead.
    def abstract(x):
        outs = ((x.shape, x.dtype),)
        return outs + (((), x.dtype),) if kernel == "jb_triple_and_sum" else outs

    op = jaxbind.get_nonlinear_call(getattr(LIB, kernel), (LIB.jb_empty, LIB.jb_empty), abstract, abstract)
    with pytest.raises(RuntimeError, match=rf"op '{kernel}'.*(float64|dtype code 11)"):
        jax.block_until_ready(op(jnp.ones(3, jnp.float32)))
