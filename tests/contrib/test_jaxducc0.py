"""jaxbind.contrib.jaxducc0: ducc0's transforms as ops with Python callbacks, against ducc0 called directly."""

import contextlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpy.testing import assert_allclose

import jaxbind

# (ducc0 publishes no wheel for free-threaded CPython: the module skips there, saying so.)
ducc0 = pytest.importorskip("ducc0", reason="ducc0 is not installed (it has no free-threaded wheel)")
from jaxbind.contrib import jaxducc0

pmp = pytest.mark.parametrize
FLOAT = (np.dtype(np.float32), np.dtype(np.float64))
COMPLEX = (np.dtype(np.complex64), np.dtype(np.complex128))
DTYPE_ID = lambda d: d.name


@contextlib.contextmanager
def _raises(cause, match):
    """An error of an op's abstract: of the type ``cause`` and a JaxbindError, naming the op."""
    with pytest.raises(cause, match=match) as info:
        yield
    assert isinstance(info.value, jaxbind.JaxbindError)
    assert isinstance(info.value.__cause__, cause), repr(info.value.__cause__)
    assert "jaxbind op 'jaxducc0." in str(info.value)


def _moved_loop(fn, x, axis):
    """fn applied to every slice of x along axis, results stacked along axis."""
    return np.stack([fn(np.take(x, i, axis=axis)) for i in range(x.shape[axis])], axis=axis)


# ---------------------------------------------------------------------------
# c2c and genuine_fht
# ---------------------------------------------------------------------------

FFT_CASES = [  # shape, kwargs
    ((12,), dict()),
    ((4, 6), dict(axes=(1,), forward=False, inorm=1)),
    ((3, 4, 5), dict(axes=(0, -1), inorm=2, nthreads=2)),
]


FFTS = [  # name, the op, ducc0's function, its dtypes, its cases (shape, kwargs)
    ("c2c", jaxducc0.c2c, ducc0.fft.c2c, COMPLEX, FFT_CASES),
    (
        "genuine_fht",
        jaxducc0.genuine_fht,
        ducc0.fft.genuine_fht,
        FLOAT,
        [FFT_CASES[0], ((3, 4, 5), dict(axes=(0, 2), inorm=1))],
    ),
]


@pmp(
    "op,ref,shape,kw,dtype",
    [
        pytest.param(op, ref, shape, kw, dtype, id=f"{name}-{'x'.join(map(str, shape))}-{dtype.name}")
        for name, op, ref, dtypes, cases in FFTS
        for shape, kw in cases
        for dtype in dtypes
    ],
)
def test_fft(op, ref, shape, kw, dtype, rand, tol, check_grads):
    x = rand(*shape, dtype=dtype)
    want = ref(x, **kw)
    (y,) = op(x, **kw)
    assert y.dtype == dtype and y.shape == shape
    assert_allclose(y, want, **tol)
    (yj,) = jax.jit(lambda v: op(v, **kw))(x)
    assert_allclose(yj, want, **tol)
    # The transpose is the same transform (the DFT and Hartley matrices are symmetric).
    ct = rand(*shape, dtype=dtype)
    (xt,) = jax.linear_transpose(lambda v: op(v, **kw)[0], x)(ct)
    assert_allclose(xt, ref(ct, **kw), **tol)
    jaxbind.testing.check_op(op, x, **kw)
    check_grads(lambda v: op(v, **kw)[0], (x,), order=2, modes=("fwd", "rev"))


def test_fht_is_fft_real_minus_imag(rand):
    x = rand(5, 6)
    (y,) = jaxducc0.genuine_fht(x)
    f = np.fft.fftn(x)
    assert_allclose(y, f.real - f.imag, rtol=1e-12, atol=1e-12)


FFT_OPS = [
    pytest.param(jaxducc0.c2c, ducc0.fft.c2c, np.complex128, id="c2c"),
    pytest.param(jaxducc0.genuine_fht, ducc0.fft.genuine_fht, np.float64, id="genuine_fht"),
]


@pmp("op,ref,dtype", FFT_OPS)
@pmp("in_axis,out_axis", [(0, 0), (1, 2), (2, 0)])
@pmp("axes", [None, 0, (-1,)])
def test_fft_vmap(op, ref, dtype, in_axis, out_axis, axes, rand):
    xb = rand(3, 4, 5, dtype=dtype)  # elements of shape (4, 5) after removing in_axis
    kw = {} if axes is None else dict(axes=axes)
    ref_kw = {} if axes is None else dict(axes=np.atleast_1d(axes).tolist())  # ducc0 wants a sequence
    got = jax.vmap(lambda v: op(v, **kw)[0], in_axes=in_axis, out_axes=out_axis)(xb)
    want = np.moveaxis(_moved_loop(lambda v: ref(v, **ref_kw), xb, in_axis), in_axis, out_axis)
    assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # The transpose under vmap (a per-element vjp).
    ct = rand(*got.shape, dtype=dtype)
    _, vjp = jax.vjp(jax.vmap(lambda v: op(v, **kw)[0], in_axes=in_axis, out_axes=out_axis), xb)
    (xt,) = vjp(ct)
    # A linear op's vjp is its transpose (no conjugation): the same transform.
    want_t = _moved_loop(lambda c: ref(c, **ref_kw), np.moveaxis(ct, out_axis, in_axis), in_axis)
    assert_allclose(xt, want_t, rtol=1e-12, atol=1e-12)


@pmp("op,ref,dtype", FFT_OPS)
def test_fft_nested_vmap_jit(op, ref, dtype, rand):
    xbb = rand(2, 4, 3, 5, dtype=dtype)  # levels at axes 2 (inner vmap) and 0 (outer)
    f = jax.jit(jax.vmap(jax.vmap(lambda v: op(v, axes=1)[0], in_axes=1, out_axes=0), in_axes=0, out_axes=2))
    got = f(xbb)
    want = np.empty((3, 4, 2, 5), dtype)
    for i in range(2):
        for j in range(3):
            want[j, :, i] = ref(xbb[i, :, j], axes=(1,))
    assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pmp("op,name,dtype", [(jaxducc0.c2c, "c2c", np.complex128), (jaxducc0.genuine_fht, "genuine_fht", np.float64)])
def test_fft_vmap_is_one_ducc0_call(op, name, dtype, rand, monkeypatch):
    """Self-batching: a vmapped (and a vmapped, transposed) op is one ducc0 call for the whole batch."""
    xb = rand(6, 4, 5, dtype=dtype)
    f = jax.jit(jax.vmap(lambda v: op(v)[0]))
    g = jax.jit(jax.vmap(jax.grad(lambda v: jnp.sum(jnp.abs(op(v)[0]) ** 2))))
    f(xb).block_until_ready(), g(xb).block_until_ready()  # compile first
    calls = []
    inner = getattr(ducc0.fft, name)
    monkeypatch.setattr(ducc0.fft, name, lambda *a, **k: (calls.append(a[0].shape), inner(*a, **k))[1])
    f(xb).block_until_ready()
    assert calls == [(6, 4, 5)]
    calls.clear()
    g(xb).block_until_ready()
    assert calls == [(6, 4, 5)] * 2  # forward and transpose


def test_fft_errors(rand):
    with _raises(TypeError, "complex64 or complex128"):
        jaxducc0.c2c(rand(4))
    with _raises(TypeError, "float32 or float64"):
        jaxducc0.genuine_fht(rand(4, dtype=np.complex128))
    with _raises(ValueError, "out of range"):
        jaxducc0.c2c(rand(4, 3, dtype=np.complex128), axes=(2,))
    with _raises(ValueError, "repeated"):
        jaxducc0.c2c(rand(4, 3, dtype=np.complex128), axes=(1, -1))
    with _raises(ValueError, "inorm"):
        jaxducc0.genuine_fht(rand(4), inorm=3)
    with _raises(TypeError, "'out'"):
        jaxducc0.c2c(rand(4, dtype=np.complex128), out=None)
    # Under vmap the axes are those of one element: axis 1 of a (4, 3) element exists, axis 2 does not.
    xb = rand(2, 4, 3, dtype=np.complex128)
    jax.vmap(lambda v: jaxducc0.c2c(v, axes=1)[0])(xb)
    with _raises(ValueError, "out of range"):
        jax.vmap(lambda v: jaxducc0.c2c(v, axes=2)[0])(xb)


# ---------------------------------------------------------------------------
# HEALPix SHT
# ---------------------------------------------------------------------------


def _random_alm(rng, lmax, mmax, spin, dtype):
    """Genuinely complex a_lm of a real field: a_l0 real, entries with l < spin zero."""
    ncomp = 1 if spin == 0 else 2
    n = jaxducc0.nalm(lmax, mmax)
    alm = rng.standard_normal((ncomp, n)) + 1j * rng.standard_normal((ncomp, n))
    alm[:, : lmax + 1].imag = 0
    ofs = 0
    for m in range(mmax + 1):  # m-major: the block of m holds l = m..lmax
        for ell in range(m, lmax + 1):
            if ell < spin:
                alm[:, ofs + ell - m] = 0
        ofs += lmax + 1 - m
    return alm.astype(np.result_type(dtype, np.complex64))


def test_nalm():
    for lmax in range(6):
        for mmax in range(lmax + 1):
            count = sum(lmax + 1 - m for m in range(mmax + 1))
            assert jaxducc0.nalm(lmax, mmax) == count
    assert jaxducc0.nalm(5, 5) == 21


def test_realalm_packing(rng):
    lmax, mmax = 4, 3
    alm = _random_alm(rng, lmax, mmax, 0, np.float64)
    r = jaxducc0.alm2realalm(alm, lmax)
    assert r.shape == (1, 2 * jaxducc0.nalm(lmax, mmax) - lmax - 1) and r.dtype == np.float64
    assert_allclose(r[0, : lmax + 1], alm[0, : lmax + 1].real)
    assert_allclose(r[0, lmax + 1 :: 2], np.sqrt(2) * alm[0, lmax + 1 :].real)
    assert_allclose(r[0, lmax + 2 :: 2], np.sqrt(2) * alm[0, lmax + 1 :].imag)
    assert_allclose(jaxducc0.realalm2alm(r, lmax), alm, rtol=1e-15, atol=1e-15)
    # The scaling makes the packed dot product the dot product of the real fields.
    b = _random_alm(rng, lmax, mmax, 0, np.float64)
    field_dot = np.sum(alm[0, : lmax + 1].real * b[0, : lmax + 1].real) + 2 * np.sum(
        (alm[0, lmax + 1 :] * b[0, lmax + 1 :].conj()).real
    )
    assert_allclose(np.dot(r[0], jaxducc0.alm2realalm(b, lmax)[0]), field_dot, rtol=1e-13)
    assert jaxducc0.alm2realalm(alm.astype(np.complex64), lmax).dtype == np.float32


SHT_CASES = [  # nside, lmax, mmax, spin
    (2, 5, 5, 0),
    (4, 6, 3, 2),
]


@pmp("dtype", FLOAT, ids=DTYPE_ID)
@pmp("nside,lmax,mmax,spin", SHT_CASES)
def test_healpix_sht(nside, lmax, mmax, spin, dtype, rng, rand, tol, check_grads):
    geometry = ducc0.healpix.Healpix_Base(nside, "RING").sht_info()
    alm = _random_alm(rng, lmax, mmax, spin, dtype)
    x = jaxducc0.alm2realalm(alm, lmax)
    sht = jaxducc0.get_healpix_sht(nside, lmax, mmax, spin)
    want = ducc0.sht.synthesis(alm=alm, lmax=lmax, mmax=mmax, spin=spin, **geometry)
    (m,) = sht(x)
    assert m.shape == (alm.shape[0], 12 * nside**2) and m.dtype == dtype
    single = dtype == np.float32
    map_tol = dict(rtol=1e-5, atol=1e-5) if single else tol
    assert_allclose(m, want, **map_tol)
    assert_allclose(jax.jit(lambda v: sht(v)[0])(x), want, **map_tol)
    # The transpose is ducc0's adjoint synthesis, repacked.
    ct = rand(*m.shape, dtype=dtype)
    (xt,) = jax.linear_transpose(lambda v: sht(v)[0], x)(ct)
    adj = ducc0.sht.adjoint_synthesis(map=ct, lmax=lmax, mmax=mmax, spin=spin, **geometry)
    assert_allclose(xt, jaxducc0.alm2realalm(adj, lmax), **map_tol)
    jaxbind.testing.check_op(sht.func, x, **sht.keywords)
    check_grads(lambda v: sht(v)[0], (x,), order=2, modes=("fwd", "rev"))


def test_healpix_sht_vmap_and_grad(rng):
    """As a correlated-field model uses it: one SHT per entry of another axis, under jit and grad."""
    nside, lmax, mmax = 2, 4, 4
    sht = jaxducc0.get_healpix_sht(nside, lmax, mmax, 0, nthreads=1)
    geometry = ducc0.healpix.Healpix_Base(nside, "RING").sht_info()
    xb = rng.standard_normal((2 * jaxducc0.nalm(lmax, mmax) - lmax - 1, 3))  # SHT along axis 0

    def field(x):
        return jax.vmap(lambda v: sht(v[jnp.newaxis])[0][0], in_axes=1, out_axes=1)(x)

    got = jax.jit(field)(xb)
    want = np.stack(
        [
            ducc0.sht.synthesis(
                alm=jaxducc0.realalm2alm(xb[:, i][None], lmax), lmax=lmax, mmax=mmax, spin=0, **geometry
            )[0]
            for i in range(3)
        ],
        axis=1,
    )
    assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    g = jax.jit(jax.grad(lambda x: jnp.sum(field(x) ** 2)))(xb)
    want_g = np.stack(
        [
            2
            * jaxducc0.alm2realalm(
                ducc0.sht.adjoint_synthesis(map=want[:, i][None], lmax=lmax, mmax=mmax, spin=0, **geometry), lmax
            )[0]
            for i in range(3)
        ],
        axis=1,
    )
    assert_allclose(g, want_g, rtol=1e-12, atol=1e-12)


@pmp("spin", [0, 1])
def test_healpix_sht_nested_vmap_is_one_ducc0_call(spin, rng, monkeypatch):
    nside, lmax, mmax = 2, 4, 3
    ncomp = 1 if spin == 0 else 2
    sht = jaxducc0.get_healpix_sht(nside, lmax, mmax, spin)
    geometry = ducc0.healpix.Healpix_Base(nside, "RING").sht_info()
    n = 2 * jaxducc0.nalm(lmax, mmax) - lmax - 1
    xb = rng.standard_normal((3, ncomp, 4, n))  # elements (ncomp, n); levels at axes 2 (inner) and 0
    f = jax.jit(jax.vmap(jax.vmap(lambda v: sht(v)[0], in_axes=1, out_axes=2), in_axes=0, out_axes=1))
    ct = rng.standard_normal((ncomp, 3, 12 * nside**2, 4))
    want = np.empty(ct.shape)
    want_t = np.empty(xb.shape)
    for i in range(3):
        for j in range(4):
            alm = jaxducc0.realalm2alm(xb[i, :, j], lmax)
            want[:, i, :, j] = ducc0.sht.synthesis(alm=alm, lmax=lmax, mmax=mmax, spin=spin, **geometry)
            adj = ducc0.sht.adjoint_synthesis(
                map=np.ascontiguousarray(ct[:, i, :, j]), lmax=lmax, mmax=mmax, spin=spin, **geometry
            )
            want_t[i, :, j] = jaxducc0.alm2realalm(adj, lmax)
    vjp = jax.jit(lambda x, c: jax.vjp(f, x)[1](c)[0])
    f(xb).block_until_ready(), vjp(xb, ct).block_until_ready()  # compile first
    calls = []
    for name in ("synthesis", "adjoint_synthesis"):
        inner = getattr(ducc0.sht, name)
        monkeypatch.setattr(
            ducc0.sht,
            name,
            lambda inner=inner, name=name, **k: (
                calls.append((name, (k.get("alm") if name == "synthesis" else k.get("map")).shape)),
                inner(**k),
            )[1],
        )
    got = f(xb)
    assert calls == [("synthesis", (12, ncomp, jaxducc0.nalm(lmax, mmax)))]
    assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    calls.clear()
    got_t = vjp(xb, ct)
    assert calls == [("adjoint_synthesis", (12, ncomp, 12 * nside**2))]
    assert_allclose(got_t, want_t, rtol=1e-12, atol=1e-12)


def test_healpix_sht_errors(rand):
    sht = jaxducc0.get_healpix_sht(2, 4, 4, 0)
    with _raises(ValueError, r"shape \(1, 25\)"):
        sht(rand(1, 24))
    with _raises(TypeError, "float32 or float64"):
        sht(rand(1, 25, dtype=np.complex128))
    with pytest.raises(ValueError, match="mmax <= lmax"):
        jaxducc0.get_healpix_sht(2, 3, 4, 0)
    with pytest.raises(ValueError, match="nside"):
        jaxducc0.get_healpix_sht(0, 3, 3, 0)
    with pytest.raises(ValueError, match="spin"):
        jaxducc0.get_healpix_sht(2, 1, 1, 2)


# ---------------------------------------------------------------------------
# wgridder
# ---------------------------------------------------------------------------

SPEED_OF_LIGHT = 299792458.0


def _wgridder_setup(rng, nrow=24, nchan=2):
    npix_x, npix_y = 32, 48
    fov = 0.05
    pixsize_x, pixsize_y = fov / npix_x, fov / npix_y
    f0 = 1e9
    freq = f0 + np.arange(nchan) * (f0 / nchan)
    uvw = (rng.random((nrow, 3)) - 0.5) / (pixsize_x * f0 / SPEED_OF_LIGHT)
    uvw[:, 2] /= 20
    params = dict(pixsize_x=pixsize_x, pixsize_y=pixsize_y, npix_x=npix_x, npix_y=npix_y, do_wgridding=True)
    return uvw, freq, params


@pmp("dtype", FLOAT, ids=DTYPE_ID)
def test_wgridder(dtype, rng, rand, check_grads):
    uvw, freq, params = _wgridder_setup(rng)
    epsilon = 1e-4 if dtype == np.float32 else 1e-9
    grid = jaxducc0.get_wgridder(epsilon=epsilon, **params)
    direct = dict(params, epsilon=epsilon)
    del direct["npix_x"], direct["npix_y"]
    dirty = rand(params["npix_x"], params["npix_y"], dtype=dtype)
    want = ducc0.wgridder.experimental.dirty2vis(uvw=uvw, freq=freq, dirty=dirty, **direct)
    (vis,) = grid(uvw, freq, dirty)
    cdtype = np.result_type(dtype, np.complex64)
    assert vis.shape == (uvw.shape[0], freq.shape[0]) and vis.dtype == cdtype
    assert_allclose(vis, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    assert_allclose(jax.jit(lambda d: grid(uvw, freq, d)[0])(dirty), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    # The transpose: ducc0's vis2dirty of the conjugated cotangent.
    ct = rand(*vis.shape, dtype=cdtype)
    (dt,) = jax.linear_transpose(lambda d: grid(uvw, freq, d)[0], dirty)(ct)
    want_t = ducc0.wgridder.experimental.vis2dirty(
        uvw=uvw, freq=freq, vis=ct.conj(), npix_x=params["npix_x"], npix_y=params["npix_y"], **direct
    )
    assert dt.dtype == dtype
    assert_allclose(dt, want_t, rtol=1e-6, atol=1e-6 * np.abs(want_t).max())
    jaxbind.testing.check_op(grid.func, uvw, freq, dirty, **grid.keywords)
    check_grads(lambda d: grid(uvw, freq, d)[0], (dirty,), order=2, modes=("fwd", "rev"))


def test_wgridder_vmap_and_fixed_args(rng, rand):
    uvw, freq, params = _wgridder_setup(rng, nrow=10, nchan=1)
    grid = jaxducc0.get_wgridder(epsilon=1e-7, flip_v=True, center_x=0.001, **params)
    direct = {k: v for k, v in grid.keywords.items() if k not in ("npix_x", "npix_y")}
    images = rand(3, params["npix_x"], params["npix_y"])
    got = jax.jit(jax.vmap(lambda d: grid(uvw, freq, d)[0]))(images)
    want = np.stack([ducc0.wgridder.experimental.dirty2vis(uvw=uvw, freq=freq, dirty=d, **direct) for d in images])
    assert_allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())
    with pytest.raises(ValueError, match="argument 0 is one of the first_n_args_fixed"):
        jax.grad(lambda u: jnp.sum(jnp.abs(grid(u, freq, images[0])[0])))(uvw)
    with _raises(ValueError, r"\(npix_x, npix_y\)"):
        grid(uvw, freq, images[0].T)
    with pytest.raises(TypeError, match="'vis'"):
        jaxducc0.get_wgridder(epsilon=1e-7, vis=None, **params)


# ---------------------------------------------------------------------------
# Without ducc0
# ---------------------------------------------------------------------------


def test_import_error_without_ducc0(tmp_path):
    code = textwrap.dedent(
        """
        import sys
        sys.modules["ducc0"] = None          # as if ducc0 were not installed
        import jaxbind.contrib
        from jaxbind.contrib import *        # noqa: F403  (needs no ducc0 either)
        try:
            import jaxbind.contrib.jaxducc0
        except ImportError as err:
            print("ImportError:", err, "| name:", err.name)
        else:
            print("imported")
        """
    )
    # Run from an empty folder, so that the installed package is imported.
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout.strip()
    assert out.startswith("ImportError:"), out
    assert "pip install ducc0" in out
    assert out.endswith("name: ducc0")
