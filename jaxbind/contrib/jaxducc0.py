"""ducc0's transforms as jaxbind linear ops.

Every op here is linear in its (non-fixed) input, so it jit-compiles,
differentiates to any order (``jvp``, ``vjp``/``grad``, ``linear_transpose``)
and vmaps. The transposes follow JAX's convention (the plain transpose, no
complex conjugation).

- :data:`c2c`: complex FFT (``ducc0.fft.c2c``), batched natively under ``vmap``.
- :data:`genuine_fht`: Hartley transform (``ducc0.fft.genuine_fht``), batched
  natively under ``vmap``.
- :func:`get_healpix_sht`: spherical harmonic synthesis onto a HEALPix map
  (``ducc0.sht.synthesis``, transpose from ``ducc0.sht.adjoint_synthesis``) on
  real-packed :math:`a_{lm}` (see :func:`alm2realalm`), batched natively under
  ``vmap``; :func:`nalm`.
- :func:`get_wgridder`: the radio-interferometric degridder image -> visibilities
  (``ducc0.wgridder.experimental.dirty2vis``, transpose from ``vis2dirty``).

Like every jaxbind op, each returns the list of its outputs: ``y, = c2c(x)``.
Needs ``ducc0`` (``pip install 'jaxbind[ducc0]'``).
"""

import functools
import math
import operator

try:
    import ducc0
except ImportError as _err:
    raise ImportError(
        "jaxbind.contrib.jaxducc0 needs the ducc0 package, which is not installed: "
        "pip install 'jaxbind[ducc0]' (or pip install ducc0).",
        name="ducc0",
    ) from _err

import numpy as np

from .. import get_linear_call, load_kwargs

__all__ = [
    "alm2realalm", "c2c", "genuine_fht", "get_healpix_sht", "get_wgridder", "nalm", "realalm2alm",
]

_COMPLEX_OF = {np.dtype(np.float32): np.dtype(np.complex64), np.dtype(np.float64): np.dtype(np.complex128)}
_REAL_OF = {c: r for r, c in _COMPLEX_OF.items()}
_SQRT2 = math.sqrt(2.0)


# The errors of the abstracts below reach the caller with their own type (also
# a jaxbind.JaxbindError) and a message that names the op.


def _check_kwargs(kwargs, allowed):
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise TypeError(
            f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
            f"accepted: {', '.join(sorted(allowed))}."
        )


def _check_dtype(what, dtype, accepted):
    dtype = np.dtype(dtype)
    if dtype not in accepted:
        names = " or ".join(d.name for d in accepted)
        raise TypeError(f"{what} must be {names}, got {dtype.name}.")


# ---------------------------------------------------------------------------
# FFT and Hartley transform: one array in, one of the same shape and dtype out.
# Both matrices are symmetric (exp(s 2 pi i j k / n) and cas(2 pi j k / n) do
# not change when j and k are swapped, and a multi-axis transform is a
# product over the axes), so each op is its own transpose with the same
# keyword arguments. Under vmap, ducc0 transforms the non-batch axes of the
# whole batch in one call.
# ---------------------------------------------------------------------------


def _transform_axes(ndim, batch_axes, axes):
    """The axes of the (batched) array to transform.

    ``axes`` (None, an int or a sequence of ints, negative ones counted from
    the end) refers to the axes of one element, as the user sees it; the
    batch axes of ``batch_axes[0]`` are skipped.
    """
    skip = set(batch_axes[0]) if batch_axes is not None else set()
    core = [a for a in range(ndim) if a not in skip]
    if axes is None:
        return core
    try:
        wanted = [operator.index(axes)]
    except TypeError:
        try:
            wanted = [operator.index(a) for a in axes]
        except TypeError:
            raise TypeError(
                f"axes must be None, an int or a sequence of ints, got {axes!r}."
            ) from None
    chosen = []
    for a in wanted:
        if not -len(core) <= a < len(core):
            raise ValueError(f"axis {a} is out of range for an array of rank {len(core)}.")
        a %= len(core)
        if core[a] in chosen:
            raise ValueError(f"axis {a} is repeated in axes={axes!r}.")
        chosen.append(core[a])
    return chosen


def _check_inorm(inorm):
    if inorm not in (0, 1, 2):
        raise ValueError(f"inorm must be 0, 1 or 2, got {inorm!r}.")


def _same_layout(x, batch_axes):
    """Output like the input, batch axes where the input has them."""
    if batch_axes is None:
        return ((x.shape, x.dtype),)
    return ((x.shape, x.dtype, batch_axes[0][-1]),)


_C2C_KWARGS = ("axes", "forward", "inorm", "nthreads")


def _c2c_abstract(x, *, batch_axes=None, **kwargs):
    _check_kwargs(kwargs, _C2C_KWARGS)
    _check_dtype("the input", x.dtype, tuple(_REAL_OF))
    _check_inorm(kwargs.get("inorm", 0))
    _transform_axes(len(x.shape), batch_axes, kwargs.get("axes"))
    return _same_layout(x, batch_axes)


def _c2c(out, args, kwargs_dump):
    (x,) = args
    kw = load_kwargs(kwargs_dump)
    ducc0.fft.c2c(
        x,
        axes=_transform_axes(x.ndim, kw.get("batch_axes"), kw.get("axes")),
        forward=bool(kw.get("forward", True)),
        inorm=kw.get("inorm", 0),
        nthreads=kw.get("nthreads", 1),
        out=out[0],
    )


c2c = get_linear_call(_c2c, _c2c, _c2c_abstract, _c2c_abstract, func_can_batch=True, name="jaxducc0.c2c")
c2c.__doc__ = """Complex FFT of ``x`` (``ducc0.fft.c2c``) as a linear jaxbind op.

``c2c(x, axes=None, forward=True, inorm=0, nthreads=1)`` returns ``[y]``, ``y``
of the shape and dtype of ``x`` (complex64 or complex128; cast real data to
complex first, in JAX, so that its cotangent is made real by JAX's cast).

- ``axes``: the axes to transform (None: all; an int or a sequence of ints,
  negative ones from the end). Under ``vmap`` they are the axes of one
  element; the batch is transformed in one ducc0 call.
- ``forward``: sign of the exponent, ``-`` if True (``jnp.fft.fftn``), ``+``
  otherwise (``n * jnp.fft.ifftn``).
- ``inorm``: 0 no normalization, 1 divide by ``sqrt(N)``, 2 by ``N`` (``N``
  the number of points transformed).
- ``nthreads``: ducc0's threads (0: all hardware threads).

The op is its own transpose (the DFT matrix is symmetric).
"""


_FHT_KWARGS = ("axes", "inorm", "nthreads")


def _fht_abstract(x, *, batch_axes=None, **kwargs):
    _check_kwargs(kwargs, _FHT_KWARGS)
    _check_dtype("the input", x.dtype, tuple(_COMPLEX_OF))
    _check_inorm(kwargs.get("inorm", 0))
    _transform_axes(len(x.shape), batch_axes, kwargs.get("axes"))
    return _same_layout(x, batch_axes)


def _fht(out, args, kwargs_dump):
    (x,) = args
    kw = load_kwargs(kwargs_dump)
    ducc0.fft.genuine_fht(
        x,
        axes=_transform_axes(x.ndim, kw.get("batch_axes"), kw.get("axes")),
        inorm=kw.get("inorm", 0),
        nthreads=kw.get("nthreads", 1),
        out=out[0],
    )


genuine_fht = get_linear_call(
    _fht, _fht, _fht_abstract, _fht_abstract, func_can_batch=True, name="jaxducc0.genuine_fht"
)
genuine_fht.__doc__ = """Hartley transform of ``x`` (``ducc0.fft.genuine_fht``) as a linear jaxbind op.

``genuine_fht(x, axes=None, inorm=0, nthreads=1)`` returns ``[y]``, ``y`` of
the shape and dtype of ``x`` (float32 or float64): ``Re(F x) - Im(F x)`` with
``F`` the forward FFT over ``axes`` (the "genuine" multi-axis Hartley
transform, not the separable one). ``axes``, ``inorm`` and ``nthreads`` as for
:data:`c2c`; natively batched under ``vmap``. The op is its own transpose.
"""


# ---------------------------------------------------------------------------
# Spherical harmonic synthesis on HEALPix.
#
# The a_lm of a real map are complex with a_l0 real, stored by ducc0 m-major:
# the m = 0 block (l = 0..lmax) first, then m = 1, 2, ..., mmax. The op takes
# them packed into a real array: the real parts of the m = 0 block, then for
# every a_lm with m > 0 the pair (sqrt(2) Re a_lm, sqrt(2) Im a_lm). With this
# scaling the Euclidean product of packed arrays is the product of the
# corresponding real fields, so adjoint synthesis followed by packing is the
# transpose of unpacking followed by synthesis.
# ---------------------------------------------------------------------------


def nalm(lmax, mmax):
    """Number of complex :math:`a_{lm}` ducc0 stores for ``lmax``, ``mmax`` (``0 <= mmax <= lmax``)."""
    lmax, mmax = operator.index(lmax), operator.index(mmax)
    return ((mmax + 1) * (mmax + 2)) // 2 + (mmax + 1) * (lmax - mmax)


def _nreal(lmax, mmax):
    return 2 * nalm(lmax, mmax) - lmax - 1


def alm2realalm(alm, lmax):
    """Pack complex :math:`a_{lm}` (last axis, ducc0's m-major order) into the real layout of the SHT op.

    The result has ``2 * alm.shape[-1] - lmax - 1`` entries on its last axis:
    ``Re a_l0`` for ``l = 0..lmax``, then ``sqrt(2) Re a_lm, sqrt(2) Im a_lm``
    for each ``m > 0`` entry. The imaginary parts of ``a_l0`` are dropped (they
    are zero for a real map). NumPy in, NumPy out (complex64 -> float32,
    complex128 -> float64).
    """
    alm = np.asarray(alm)
    if alm.dtype not in _REAL_OF:
        alm = alm.astype(np.complex128)
    lmax = operator.index(lmax)
    n = alm.shape[-1]
    out = np.empty(alm.shape[:-1] + (2 * n - lmax - 1,), _REAL_OF[alm.dtype])
    _pack(alm, lmax, out)
    return out


def realalm2alm(realalm, lmax):
    """Unpack the real layout of :func:`alm2realalm` into complex :math:`a_{lm}` (its inverse)."""
    realalm = np.asarray(realalm)
    if realalm.dtype not in _COMPLEX_OF:
        realalm = realalm.astype(np.float64)
    lmax = operator.index(lmax)
    n = (realalm.shape[-1] + lmax + 1) // 2
    out = np.empty(realalm.shape[:-1] + (n,), _COMPLEX_OF[realalm.dtype])
    _unpack(realalm, lmax, out)
    return out


def _pack(alm, lmax, out):
    out[..., : lmax + 1] = alm[..., : lmax + 1].real
    rest = alm[..., lmax + 1 :]
    out[..., lmax + 1 :: 2] = rest.real * _SQRT2
    out[..., lmax + 2 :: 2] = rest.imag * _SQRT2


def _unpack(realalm, lmax, out):
    out[..., : lmax + 1] = realalm[..., : lmax + 1]
    out[..., lmax + 1 :].real = realalm[..., lmax + 1 :: 2]
    out[..., lmax + 1 :].imag = realalm[..., lmax + 2 :: 2]
    out[..., lmax + 1 :] *= 1.0 / _SQRT2


@functools.lru_cache(maxsize=32)
def _healpix_geometry(nside):
    """theta, phi0, nphi and ringstart of the RING-ordered HEALPix map with ``nside``."""
    info = ducc0.healpix.Healpix_Base(nside, "RING").sht_info()
    for v in info.values():
        v.flags.writeable = False
    return info


def _sht_params(kw):
    return dict(lmax=kw["lmax"], mmax=kw["mmax"], spin=kw["spin"], nthreads=kw["nthreads"],
                **_healpix_geometry(kw["nside"]))


def _ncomp(spin):
    return 1 if spin == 0 else 2


_SHT_KWARGS = ("nside", "lmax", "mmax", "spin", "nthreads")

# Under vmap the op batches natively: ducc0 transforms a stack of (ncomp, n)
# arrays in one call, sharing its work across the stack. Outputs keep the batch
# axes where the input has them (both sides have rank 2 per element).


def _element_shape(x, batch_axes):
    skip = set(batch_axes[0]) if batch_axes is not None else set()
    return tuple(n for i, n in enumerate(x.shape) if i not in skip)


def _batched_like(x, batch_axes, element_shape, dtype):
    """(shape, dtype[, newest batch axis]) of an output laid out like ``x``."""
    if batch_axes is None:
        return ((tuple(element_shape), dtype),)
    axes, core = batch_axes[0], iter(element_shape)
    shape = tuple(n if i in axes else next(core) for i, n in enumerate(x.shape))
    return ((shape, dtype, axes[-1]),)


def _to_stack(a, batch_axes):
    """View ``a`` as a (batch, *element) stack (a copy if need be), batch levels in order."""
    if batch_axes is None:
        return a[None]
    axes = batch_axes[0]
    moved = np.moveaxis(a, axes, range(len(axes)))
    return moved.reshape((-1,) + moved.shape[len(axes):])


def _from_stack(out, stack, batch_axes):
    """Write a (batch, *element) stack into the batched ``out``: the inverse of :func:`_to_stack`."""
    axes = batch_axes[0]
    moved = np.moveaxis(out, axes, range(len(axes)))  # a view of out
    moved[...] = stack.reshape(moved.shape)


def _sht_shapes(kw):
    ncomp = _ncomp(kw["spin"])
    return (ncomp, _nreal(kw["lmax"], kw["mmax"])), (ncomp, 12 * kw["nside"] ** 2)


def _sht_abstract(x, *, batch_axes=None, **kw):
    _check_kwargs(kw, _SHT_KWARGS)
    _check_dtype("the real-packed alm", x.dtype, tuple(_COMPLEX_OF))
    alm_shape, map_shape = _sht_shapes(kw)
    got = _element_shape(x, batch_axes)
    if got != alm_shape:
        raise ValueError(
            f"the real-packed alm must have shape {alm_shape} (ncomp, "
            f"2 * nalm(lmax, mmax) - lmax - 1) for spin={kw['spin']}, lmax={kw['lmax']}, "
            f"mmax={kw['mmax']}; got {got}."
        )
    return _batched_like(x, batch_axes, map_shape, x.dtype)


def _sht_abstract_T(m, *, batch_axes=None, **kw):
    _check_kwargs(kw, _SHT_KWARGS)
    _check_dtype("the map cotangent", m.dtype, tuple(_COMPLEX_OF))
    alm_shape, map_shape = _sht_shapes(kw)
    got = _element_shape(m, batch_axes)
    if got != map_shape:
        raise ValueError(f"the map cotangent must have shape {map_shape}; got {got}.")
    return _batched_like(m, batch_axes, alm_shape, m.dtype)


def _sht_synthesis(out, args, kwargs_dump):
    (x,) = args
    kw = load_kwargs(kwargs_dump)
    batch_axes = kw.pop("batch_axes", None)
    if out[0].size == 0:
        return
    xs = _to_stack(x, batch_axes)
    alm = np.empty(xs.shape[:-1] + (nalm(kw["lmax"], kw["mmax"]),), _COMPLEX_OF[x.dtype])
    _unpack(xs, kw["lmax"], alm)
    if batch_axes is None:
        ducc0.sht.synthesis(alm=alm[0], map=out[0], **_sht_params(kw))
    else:
        _from_stack(out[0], ducc0.sht.synthesis(alm=alm, **_sht_params(kw)), batch_axes)


def _sht_adjoint(out, args, kwargs_dump):
    (m,) = args
    kw = load_kwargs(kwargs_dump)
    batch_axes = kw.pop("batch_axes", None)
    if out[0].size == 0:
        return
    ms = m if batch_axes is None else _to_stack(m, batch_axes)
    alm = ducc0.sht.adjoint_synthesis(map=ms, **_sht_params(kw))
    if batch_axes is None:
        _pack(alm, kw["lmax"], out[0])
    else:
        packed = np.empty(alm.shape[:-1] + (2 * alm.shape[-1] - kw["lmax"] - 1,), out[0].dtype)
        _pack(alm, kw["lmax"], packed)
        _from_stack(out[0], packed, batch_axes)


healpix_sht = get_linear_call(
    _sht_synthesis, _sht_adjoint, _sht_abstract, _sht_abstract_T, func_can_batch=True,
    name="jaxducc0.healpix_sht",
)
healpix_sht.__doc__ = """HEALPix spherical harmonic synthesis as a linear jaxbind op.

``healpix_sht(x, nside=, lmax=, mmax=, spin=, nthreads=)`` returns ``[map]``;
:func:`get_healpix_sht` fixes the keyword arguments.
"""


def get_healpix_sht(nside, lmax, mmax, spin, nthreads=1):
    """Spherical harmonic synthesis onto a RING-ordered HEALPix map, as a JAX function.

    Args:
      nside: HEALPix resolution; the map has ``12 * nside**2`` pixels.
      lmax, mmax: largest :math:`l` and :math:`m` (inclusive), ``0 <= mmax <= lmax``.
      spin: 0 for a scalar field (one map), > 0 for a spin field (two maps, from
        the gradient and curl :math:`a_{lm}`).
      nthreads: ducc0's threads (0: all hardware threads).

    Returns:
      ``sht(x)`` returning ``[map]``: ``x`` the real-packed :math:`a_{lm}` of shape
      ``(ncomp, 2 * nalm(lmax, mmax) - lmax - 1)`` (float32 or float64; see
      :func:`alm2realalm`), ``map`` of shape ``(ncomp, 12 * nside**2)`` and the
      dtype of ``x``, with ``ncomp`` 1 for spin 0 and 2 otherwise. It is linear,
      with ``ducc0.sht.adjoint_synthesis`` (repacked) as its transpose; it
      jit-compiles, differentiates and vmaps (a vmapped call is one ducc0
      call for the whole batch). ``sht.func`` is the underlying
      op, ``sht.keywords`` its keyword arguments.
    """
    nside, lmax, mmax, spin, nthreads = map(operator.index, (nside, lmax, mmax, spin, nthreads))
    if nside < 1:
        raise ValueError(f"get_healpix_sht: nside must be >= 1, got {nside}.")
    if not 0 <= mmax <= lmax:
        raise ValueError(f"get_healpix_sht: need 0 <= mmax <= lmax, got lmax={lmax}, mmax={mmax}.")
    if not 0 <= spin <= lmax:
        raise ValueError(f"get_healpix_sht: need 0 <= spin <= lmax, got spin={spin}, lmax={lmax}.")
    if nthreads < 0:
        raise ValueError(f"get_healpix_sht: nthreads must be >= 0, got {nthreads}.")
    return functools.partial(healpix_sht, nside=nside, lmax=lmax, mmax=mmax, spin=spin, nthreads=nthreads)


# ---------------------------------------------------------------------------
# The w-gridder: dirty image (real, npix_x x npix_y) -> visibilities (complex,
# nrow x nchan), linear in the image; uvw and freq are fixed arguments.
#
# dirty2vis is vis = A d with a complex matrix A and a real d; ducc0's
# vis2dirty is its adjoint, d = Re(A^H v). JAX's transpose of a real -> complex
# linear map is Re(A^T c) = Re(A^H conj(c)): vis2dirty of the conjugated
# cotangent.
# ---------------------------------------------------------------------------

# vis2dirty's arguments that dirty2vis does not take.
_VIS2DIRTY_ONLY = ("npix_x", "npix_y", "double_precision_accumulation")
_WGRIDDER_RESERVED = ("uvw", "freq", "dirty", "vis")


def _as_f64(a):
    return np.ascontiguousarray(a, dtype=np.float64)


def _check_coords(uvw, freq):
    if len(uvw.shape) != 2 or uvw.shape[1] != 3:
        raise ValueError(f"uvw must have shape (nrow, 3), got {tuple(uvw.shape)}.")
    if len(freq.shape) != 1:
        raise ValueError(f"freq must be 1-d (nchan,), got shape {tuple(freq.shape)}.")
    for what, a in (("uvw", uvw), ("freq", freq)):
        if not np.issubdtype(np.dtype(a.dtype), np.floating):
            raise TypeError(f"{what} must be real floats, got {np.dtype(a.dtype).name}.")


def _dirty2vis_abstract(uvw, freq, dirty, **kw):
    _check_coords(uvw, freq)
    _check_dtype("the image", dirty.dtype, tuple(_COMPLEX_OF))
    if tuple(dirty.shape) != (kw["npix_x"], kw["npix_y"]):
        raise ValueError(
            f"the image must have shape (npix_x, npix_y) = "
            f"{(kw['npix_x'], kw['npix_y'])}, got {tuple(dirty.shape)}."
        )
    return (((uvw.shape[0], freq.shape[0]), _COMPLEX_OF[np.dtype(dirty.dtype)]),)


def _vis2dirty_abstract(uvw, freq, vis, **kw):
    _check_coords(uvw, freq)
    _check_dtype("the visibility cotangent", vis.dtype, tuple(_REAL_OF))
    if tuple(vis.shape) != (uvw.shape[0], freq.shape[0]):
        raise ValueError(
            f"the visibility cotangent must have shape (nrow, nchan) = "
            f"{(uvw.shape[0], freq.shape[0])}, got {tuple(vis.shape)}."
        )
    return (((kw["npix_x"], kw["npix_y"]), _REAL_OF[np.dtype(vis.dtype)]),)


def _dirty2vis(out, args, kwargs_dump):
    uvw, freq, dirty = args
    kw = {k: v for k, v in load_kwargs(kwargs_dump).items() if k not in _VIS2DIRTY_ONLY}
    ducc0.wgridder.experimental.dirty2vis(uvw=_as_f64(uvw), freq=_as_f64(freq), dirty=dirty, vis=out[0], **kw)


def _vis2dirty(out, args, kwargs_dump):
    uvw, freq, vis = args
    kw = load_kwargs(kwargs_dump)
    ducc0.wgridder.experimental.vis2dirty(
        uvw=_as_f64(uvw), freq=_as_f64(freq), vis=np.conj(vis), dirty=out[0], **kw
    )


wgridder = get_linear_call(
    _dirty2vis, _vis2dirty, _dirty2vis_abstract, _vis2dirty_abstract, first_n_args_fixed=2,
    name="jaxducc0.wgridder",
)
wgridder.__doc__ = """ducc0's w-gridder (image -> visibilities) as a linear jaxbind op.

``wgridder(uvw, freq, dirty, **kwargs)`` returns ``[vis]``; :func:`get_wgridder`
fixes the keyword arguments.
"""


def get_wgridder(
    *, pixsize_x, pixsize_y, npix_x, npix_y, epsilon, do_wgridding, nthreads=1, flip_v=False,
    verbosity=0, **kwargs,
):
    """Radio-interferometric (w-)gridding (``ducc0.wgridder.experimental``) as a JAX function.

    Args:
      pixsize_x, pixsize_y: pixel sizes of the image, in radians.
      npix_x, npix_y: the image's shape (each even and at least 32, as ducc0 requires).
      epsilon: requested accuracy (> 2e-13; > 1e-5 for a float32 image).
      do_wgridding: whether to take the w coordinate into account (else w = 0).
      nthreads: ducc0's threads (0: all hardware threads).
      flip_v: multiply the v coordinates by -1.
      verbosity: 0 silent, 1 diagnostics from ducc0.
      **kwargs: further keyword arguments of ``dirty2vis``/``vis2dirty``
        (``center_x``, ``center_y``, ``flip_u``, ``flip_w``, ``divide_by_n``,
        ``sigma_min``, ``sigma_max``, ``wgt``, ``mask``, ...); ones that only
        ``vis2dirty`` takes (``double_precision_accumulation``) reach it alone.

    Returns:
      ``grid(uvw, freq, image)`` returning ``[vis]``: ``uvw`` of shape
      ``(nrow, 3)`` (metres), ``freq`` of shape ``(nchan,)`` (Hz), ``image`` of
      shape ``(npix_x, npix_y)`` (float32 or float64); ``vis`` of shape
      ``(nrow, nchan)``, complex64 or complex128 after the image. It is the
      degridding ``dirty2vis``, linear in ``image``, whose transpose is
      ``vis2dirty`` (of the conjugated cotangent, JAX's convention for a
      real-to-complex map). ``uvw`` and ``freq`` are fixed arguments (computed
      in float64; not differentiable: asking for their derivative is an
      error). ``grid.func`` is the underlying op, ``grid.keywords`` its keyword
      arguments.
    """
    clash = sorted(set(kwargs) & set(_WGRIDDER_RESERVED))
    if clash:
        raise TypeError(
            f"get_wgridder: {', '.join(map(repr, clash))} are the op's arguments, not keyword arguments."
        )
    return functools.partial(
        wgridder,
        pixsize_x=float(pixsize_x), pixsize_y=float(pixsize_y),
        npix_x=operator.index(npix_x), npix_y=operator.index(npix_y),
        epsilon=float(epsilon), do_wgridding=bool(do_wgridding), nthreads=operator.index(nthreads),
        flip_v=bool(flip_v), verbosity=operator.index(verbosity), **kwargs,
    )
