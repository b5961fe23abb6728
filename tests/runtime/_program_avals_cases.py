"""The cases of test_program_avals.py, each run in a process of its own (a crash fails the test).

``python _program_avals_cases.py CASE FOLDER``: a case prints ``DONE`` last when every assertion held.
The program an attacker makes is made in a process of its own (``make_*`` cases) and written to
FOLDER; the victim (``run_*`` cases) loads it with ``jax.export.deserialize``, as a file from
elsewhere is loaded.
"""

import ctypes
import json
import os
import shlex
import subprocess
import sys

import jax
import jax.export  # (jax < 0.6 does not import it with jax)
import jax.numpy as jnp
import numpy as np

import jaxbind
from jaxbind import _sites
from jaxbind._runtime import ASYNC_TARGET, TARGET

jax.config.update("jax_enable_x64", True)
HERE = os.path.dirname(os.path.abspath(__file__))
N = 100_000  # doubles the forged programs' kernels would write into a buffer of one
EXAMPLE = os.path.join(HERE, "..", "..", "docs", "examples", "scale.c")


def _scale_library(folder):
    """The docs' own native kernel (in f64[N], out f64[N]: y = factor * x), compiled with $CFLAGS."""
    path = os.path.join(folder, f"libscale-{os.getpid()}.so")
    flags = shlex.split(os.environ.get("CFLAGS", ""))
    command = ["cc", "-O2", "-shared", "-fPIC", *flags, "-I", jaxbind.get_include(), EXAMPLE, "-o", path]
    subprocess.run(command, check=True)
    return ctypes.CDLL(path)


def _same(x, **kwargs):
    return ((x.shape, x.dtype),)


def _one(x, **kwargs):  # another process's abstract for an op of the same name: out f64[1]
    return (((1,), x.dtype),)


_NAMES = {False: "scale", True: "scale_async"}


def _scale_op(folder, abstract, concurrent=False):
    lib = _scale_library(folder)
    kernel = jaxbind.native(lib.scale, concurrent=True, keepalive=lib) if concurrent else lib.scale
    return jaxbind.get_linear_call(kernel, kernel, abstract, abstract, name=_NAMES[concurrent])


def _save(folder, name, exported):
    with open(os.path.join(folder, name), "wb") as f:
        f.write(exported.serialize())


def _load(folder, name):
    with open(os.path.join(folder, name), "rb") as f:
        return jax.export.deserialize(bytearray(f.read()))


def _refused(program, *args):
    """The message of the error ``program(*args)`` fails with (it must fail)."""
    try:
        result = program(*args)
        jax.block_until_ready(result)
    except Exception as err:
        return str(err)
    raise AssertionError(f"the forged program ran and gave {np.asarray(result)[:4]}...")


def _description_of(name):
    """The description (parsed) of the one live site of op ``name``."""
    texts = [h.description for h in list(_sites._live.values()) if json.loads(h.description)["op"] == name]
    assert len(texts) == 1, texts
    return json.loads(texts[0])


def _encode(description):
    return json.dumps(description, sort_keys=True, separators=(",", ":"))


def _export_raw_call(target, text, operand, result):
    """A program that calls jaxbind's target directly with ``text`` and its key (what an attacker
    writes by hand): operand and result types of its choosing."""

    def program(x):
        return jax.ffi.ffi_call(target, result)(x, jaxbind=text, site=np.int64(_sites.key_of(text)))

    checks = [jax.export.DisabledSafetyCheck.custom_call(target)]
    return jax.export.export(jax.jit(program), disabled_checks=checks)(operand)


# ---- a program made by another process's op of the same name, with another abstract ----------


def make_other_abstract(folder):
    op = _scale_op(folder, _one)  # out f64[1] for in f64[N]
    exported = jaxbind.export(jax.jit(lambda x: op(x, factor=2.0)[0]))(jax.ShapeDtypeStruct((N,), jnp.float64))
    _save(folder, "other_abstract.bin", exported)
    print("DONE")


def run_other_abstract(folder):
    op = _scale_op(folder, _same)
    x = jnp.arange(float(N))
    message = _refused(_load(folder, "other_abstract.bin").call, x)
    assert "jaxbind op 'scale'" in message, message
    assert "expects output 0 as float64[1]" in message and f"gives float64[{N}]" in message, message
    # the op itself runs as its abstract says (the reference: NumPy)
    np.testing.assert_allclose(jax.jit(lambda v: op(v, factor=2.0)[0])(x), 2.0 * np.arange(float(N)))
    print("DONE")


# ---- a program whose buffers are not those its description names --------------------------------


def make_other_buffers(folder):
    """Descriptions a victim makes (an export of scale on f64[1]), called on buffers of f64[N] in,
    f64[1] out: the abstract agrees with the description, XLA's buffers do not."""
    for concurrent, target in ((False, TARGET), (True, ASYNC_TARGET)):
        op = _scale_op(folder, _same, concurrent)
        honest = jaxbind.export(jax.jit(lambda x: op(x)[0]))(jax.ShapeDtypeStruct((1,), jnp.float64))
        (text,) = [t.replace("\\22", '"') for t in _calls_in(honest)]
        forged = _export_raw_call(
            target, text, jax.ShapeDtypeStruct((N,), jnp.float64), jax.ShapeDtypeStruct((1,), jnp.float64)
        )
        _save(folder, f"other_buffers_{int(concurrent)}.bin", forged)
    print("DONE")


def _calls_in(exported):
    import re

    return re.findall(r'jaxbind = "((?:[^"\\]|\\.)*)"', exported.mlir_module())


def run_other_buffers(folder):
    x = jnp.arange(float(N))
    for concurrent in (False, True):
        op = _scale_op(folder, _same, concurrent)
        program = _load(folder, f"other_buffers_{int(concurrent)}.bin")
        message = _refused(program.call, x)
        assert f"jaxbind op '{_NAMES[concurrent]}'" in message, message
        assert f"passes input 0 as float64[{N}], but its call site has float64[1]" in message, message
        # and with the op's site live, made by this process's own call of that description
        np.testing.assert_allclose(jax.export.deserialize(_honest(op).serialize()).call(jnp.ones(1)), [2.0])
        assert "passes input 0" in _refused(program.call, x)
    print("DONE")


def _honest(op):
    return jaxbind.export(jax.jit(lambda x: op(x)[0]))(jax.ShapeDtypeStruct((1,), jnp.float64))


def run_live_site_other_buffers(folder):
    """A Python callback's live site, its own description copied (index and all) into a call on
    other buffers: the program passes the instantiate check (same text) and fails at the call."""
    seen = []

    def double(out, args, kwargs_dump):
        seen.append(args[0].shape)
        out[0][...] = 2 * args[0]

    op = jaxbind.get_nonlinear_call(double, None, _same, None, name="twice")
    live = jax.jit(lambda v: op(v)[0])
    np.testing.assert_allclose(live(jnp.ones(4)), np.full(4, 2.0))
    text = _encode(_description_of("twice"))
    forged = _export_raw_call(
        TARGET, text, jax.ShapeDtypeStruct((9,), jnp.float64), jax.ShapeDtypeStruct((4,), jnp.float64)
    )
    message = _refused(jax.export.deserialize(forged.serialize()).call, jnp.ones(9))
    assert "jaxbind op 'twice'" in message and "passes input 0 as float64[9]" in message, message
    assert seen == [(4,)]
    print("DONE")


# ---- real exports edited: a vmapped walk's and a self-batched call's avals, a def, a name ---------


def _forging():
    sys.path[:0] = [HERE, os.path.dirname(HERE)]  # (test_forged_programs' helpers, and _shared)
    import test_forged_programs

    return test_forged_programs


def _doubling(seen):
    def double(out, args, kwargs_dump):
        seen.append(args[-1].shape)
        out[0][...] = 2 * args[-1]

    return double


def _self_batched(seen):
    def double(out, args, kwargs_dump):
        seen.append(args[-1].shape)
        out[0][...] = 2 * args[-1]

    def abstract(x, batch_axes=None, **kwargs):
        axis = () if batch_axes is None else (batch_axes[0][-1],)
        return ((x.shape, x.dtype, *axis),)

    return double, abstract


def run_batched_avals(folder):
    """Real exports of vmapped calls, their output avals edited: refused, naming the op and the output."""
    f = _forging()
    seen = []
    walked = jaxbind.get_nonlinear_call(_doubling(seen), None, _same, None, name="walked")
    double, abstract = _self_batched(seen)
    batched = jaxbind.get_nonlinear_call(double, None, abstract, None, func_can_batch=True, name="batched")
    x = jnp.arange(12.0).reshape(3, 4)
    for op in (walked, batched):
        exported = jaxbind.export(jax.jit(jax.vmap(lambda v: op(v)[0])))(jax.ShapeDtypeStruct((3, 4), jnp.float64))
        np.testing.assert_allclose(jax.export.deserialize(exported.serialize()).call(x), 2 * np.asarray(x))
        ((text, _),) = f._calls(exported)
        description = json.loads(text)
        name = description["op"]
        assert description["in"] == [[[3, 4], "float64"]] and description["out"] == [[[3, 4], "float64"]]
        for out, shown in (([[[3, 1], "float64"]], "float64[3, 1]"), ([[[3, 4], "float32"]], "float32[3, 4]")):
            forged = f._encode(dict(description, out=out))
            message = _refused(f._forged(exported, description=forged, key=_sites.key_of(forged)).call, x)
            assert f"jaxbind op '{name}'" in message and f"expects output 0 as {shown}" in message, message
            assert "gives float64[3, 4]" in message, message
    # a walk's masks for another number of inputs than it describes
    exported = jaxbind.export(jax.jit(jax.vmap(lambda v: walked(v)[0])))(jax.ShapeDtypeStruct((3, 4), jnp.float64))
    description = json.loads(f._calls(exported)[0][0])
    forged = f._encode(dict(description, batch={"walk": [[1], [1]]}))
    message = _refused(f._forged(exported, description=forged, key=_sites.key_of(forged)).call, x)
    assert "jaxbind op 'walked'" in message and "batch masks that do not fit" in message, message
    assert len(seen) == 3 + 1  # the three honest walk elements and the one self-batched call, nothing forged
    print("DONE")


def run_pure_callback_by_name(folder):
    """A traced jaxbind.pure_callback's description, put in a real export of another op."""
    f = _forging()
    ran = []

    def secret(v):
        ran.append(np.asarray(v).copy())
        return np.asarray(v) * 10

    spec = jax.ShapeDtypeStruct((4,), jnp.float32)
    x = jnp.arange(4.0, dtype=jnp.float32)
    traced = jax.jit(lambda v: jaxbind.pure_callback(secret, spec, v))  # (kept: its site stays live)
    np.testing.assert_allclose(traced(x), 10 * np.arange(4.0))
    victim = _description_of(f"pure_callback({secret.__qualname__})")
    del victim["index"]  # as an exported program names an op: by name alone
    text = f._encode(victim)
    exported = f._exported(f._nonsense, (4,))
    message = _refused(f._forged(exported, description=text, key=_sites.key_of(text)).call, x + 1)
    assert f"jaxbind op 'pure_callback({secret.__qualname__})'" in message, message
    assert "jaxbind.pure_callback" in message and "jaxbind.export refuses" in message, message
    assert len(ran) == 1 and np.array_equal(ran[0], np.arange(4.0, dtype=np.float32))
    print("DONE")


def run_def_with_inplace(folder):
    """A real export whose op structure is edited to add inplace: refused, naming the field."""
    f = _forging()
    exported = f._exported(f._nonsense, (4,))
    description = json.loads(f._calls(exported)[0][0])
    assert "inplace" not in description["def"]
    for edit, words in (
        ({"inplace": [[0, 0]]}, "inplace ([[0, 0]] there, absent here)"),
        ({"callbacks": [2, 2]}, "callbacks ([2, 2] there, [2] here)"),
    ):
        text = f._encode(dict(description, **{"def": {**description["def"], **edit}}))
        message = _refused(
            f._forged(exported, description=text, key=_sites.key_of(text)).call, jnp.ones(4, jnp.float32)
        )
        assert f"jaxbind op 'nonsense': the program was made with a different op of this name: {words}." in message, (
            message
        )
    trimmed = {k: v for k, v in description["def"].items() if k != "residuals"}
    text = f._encode(dict(description, **{"def": trimmed}))
    message = _refused(f._forged(exported, description=text, key=_sites.key_of(text)).call, jnp.ones(4, jnp.float32))
    assert "residuals (absent there, 0 here)" in message, message
    print("DONE")


def run_padded_export(folder):
    """A vmapped walk split unevenly over 4 devices (a padded batch, with its validity operand):
    exported, it runs elsewhere as made; its avals or its padding edited, it is refused."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    assert jax.device_count() == 4, "run with XLA_FLAGS=--xla_force_host_platform_device_count=4"
    f = _forging()
    seen = []
    op = jaxbind.get_nonlinear_call(_doubling(seen), None, _same, None, name="split")
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = NamedSharding(mesh, P("d"))
    walked = jax.vmap(lambda v: op(v)[0])
    program = jax.jit(lambda a: walked(jax.lax.with_sharding_constraint(a, rows)))  # (uneven: not device_put)
    exported = jaxbind.export(program)(jax.ShapeDtypeStruct((10, 3), jnp.float64))
    ((text, _),) = f._calls(exported)
    description = json.loads(text)
    assert description["padded"] is True and description["in"] == [[[10, 3], "float64"]], description
    x = jnp.arange(30.0).reshape(10, 3)
    everywhere = NamedSharding(mesh, P())  # (a program exported for 4 devices is called on 4)

    def on_devices(loaded):
        return jax.jit(loaded.call, in_shardings=everywhere)

    loaded = jax.export.deserialize(exported.serialize())
    np.testing.assert_allclose(on_devices(loaded)(x), 2 * np.arange(30.0).reshape(10, 3))  # resolved here
    assert len(seen) == 10  # the real rows only
    edits = [
        ({"out": [[[10, 1], "float64"]]}, "expects output 0 as float64[10, 1]"),
        ({"padded": False}, "passes 2 input(s) and 1 output(s), but its call site has 1 and 1"),
    ]
    if tuple(int(part) for part in jax.__version__.split(".")[:2]) < (0, 6):
        # jax 0.5.3 gives the second forged program of this sharded shape the first one's refusal
        # (both refused, the second in the first's words): its words are checked on newer JAX only
        edits = edits[:1]
    for edit, words in edits:
        forged = f._encode(dict(description, **edit))
        message = _refused(on_devices(f._forged(exported, description=forged, key=_sites.key_of(forged))), x)
        assert "jaxbind op 'split'" in message and words in message, message
    assert len(seen) == 10
    print("DONE")


CASES = {f.__name__: f for f in list(globals().values()) if callable(f) and f.__name__.startswith(("make_", "run_"))}

if __name__ == "__main__":
    CASES[sys.argv[1]](sys.argv[2])
