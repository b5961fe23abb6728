"""Spherical harmonic synthesis on HEALPix on real-packed a_lm, its adjoint as the transpose."""

import functools
import operator

import ducc0
import numpy as np

from ... import get_linear_call, load_kwargs
from ._common import _COMPLEX_OF, _REAL_OF, _SQRT2, _check_dtype, _check_kwargs

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
    """Number of complex :math:`a_{lm}` ducc0 stores for ``lmax``, ``mmax`` (``0 <= mmax <= lmax``).

    Parameters
    ----------
    lmax : int
        The largest :math:`l`.
    mmax : int
        The largest :math:`m`, ``0 <= mmax <= lmax`` (not checked).

    Returns
    -------
    int
        ``(mmax + 1) (mmax + 2) / 2 + (mmax + 1) (lmax - mmax)``: the length of
        the last axis of ducc0's :math:`a_{lm}` arrays. The real-packed layout
        of :func:`alm2realalm` has ``2 * nalm(lmax, mmax) - lmax - 1`` entries.

    Raises
    ------
    TypeError
        If ``lmax`` or ``mmax`` is not an integer (``operator.index``).

    Examples
    --------
    >>> from jaxbind.contrib.jaxducc0 import nalm
    >>> nalm(2, 2)
    6
    """
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
    complex128 -> float64). With this scaling the Euclidean product of packed
    arrays is that of the real fields they describe, which makes ducc0's
    adjoint synthesis (repacked) the transpose of the synthesis op.

    Parameters
    ----------
    alm : array_like
        Complex :math:`a_{lm}` on the last axis (any leading axes), in ducc0's
        m-major order: the ``m = 0`` block (``l = 0..lmax``) first. Arrays that
        are not complex64 or complex128 are converted to complex128.
    lmax : int
        The largest :math:`l`.

    Returns
    -------
    numpy.ndarray
        The real-packed :math:`a_{lm}`, of shape ``alm.shape[:-1] + (2 *
        alm.shape[-1] - lmax - 1,)``: float32 for complex64 input, else
        float64.

    Raises
    ------
    TypeError
        If ``lmax`` is not an integer (``operator.index``). NumPy's own error
        propagates for an ``alm`` it cannot convert.

    See Also
    --------
    realalm2alm : the inverse.
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
    """Unpack the real layout of :func:`alm2realalm` into complex :math:`a_{lm}` (its inverse).

    NumPy in, NumPy out (float32 -> complex64, float64 -> complex128).

    Parameters
    ----------
    realalm : array_like
        Real-packed :math:`a_{lm}` on the last axis (any leading axes), as
        :func:`alm2realalm` makes them. Arrays that are not float32 or
        float64 are converted to float64.
    lmax : int
        The largest :math:`l`.

    Returns
    -------
    numpy.ndarray
        The complex :math:`a_{lm}` in ducc0's m-major order, of shape
        ``realalm.shape[:-1] + ((realalm.shape[-1] + lmax + 1) // 2,)``:
        complex64 for float32 input, else complex128; the ``m = 0`` entries
        have zero imaginary parts.

    Raises
    ------
    TypeError
        If ``lmax`` is not an integer (``operator.index``). NumPy's own error
        propagates for a ``realalm`` it cannot convert.

    See Also
    --------
    alm2realalm : the packing this inverts.
    """
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
    return dict(
        lmax=kw["lmax"], mmax=kw["mmax"], spin=kw["spin"], nthreads=kw["nthreads"], **_healpix_geometry(kw["nside"])
    )


def _ncomp(spin):
    return 1 if spin == 0 else 2


_SHT_KWARGS = ("nside", "lmax", "mmax", "spin", "nthreads")

# Under vmap the op batches itself: ducc0 transforms a stack of (ncomp, n)
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
    return moved.reshape((-1,) + moved.shape[len(axes) :])


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
    _sht_synthesis, _sht_adjoint, _sht_abstract, _sht_abstract_T, func_can_batch=True, name="jaxducc0.healpix_sht"
)
healpix_sht.__doc__ = """healpix_sht(x, *, nside, lmax, mmax, spin, nthreads)

HEALPix spherical harmonic synthesis as a linear jaxbind op.

``healpix_sht(x, nside=, lmax=, mmax=, spin=, nthreads=)`` returns ``[map]``;
:func:`get_healpix_sht` fixes the keyword arguments (and checks them: this op
does not check their values). The synthesis is ``ducc0.sht.synthesis`` onto
the RING-ordered HEALPix map from real-packed :math:`a_{lm}` (see
:func:`alm2realalm`); the transpose is ``ducc0.sht.adjoint_synthesis``,
repacked. The op jit-compiles, differentiates to any order and batches
itself under ``vmap`` (one ducc0 call for the whole batch).

Parameters
----------
x : jax.Array
    The real-packed :math:`a_{lm}`, of shape ``(ncomp, 2 * nalm(lmax, mmax) -
    lmax - 1)``, float32 or float64 (positional); ``ncomp`` is 1 for spin 0,
    else 2.
nside : int
    HEALPix resolution; the map has ``12 * nside**2`` pixels.
lmax : int
    Largest :math:`l` (inclusive).
mmax : int
    Largest :math:`m` (inclusive), ``0 <= mmax <= lmax``.
spin : int
    0 for a scalar field, > 0 for a spin field (two components).
nthreads : int
    ducc0's threads (0: all hardware threads).

Returns
-------
list of jax.Array
    ``[map]``, of shape ``(ncomp, 12 * nside**2)`` and the dtype of ``x``.

Raises
------
TypeError
    If ``x`` is not float32 or float64, or a keyword argument other than
    those above is given (raised while tracing, also a
    :class:`jaxbind.JaxbindError`).
ValueError
    If ``x`` does not have the shape above (also a
    :class:`jaxbind.JaxbindError`).
KeyError
    If one of ``nside``, ``lmax``, ``mmax``, ``spin`` is missing (while
    tracing, also a :class:`jaxbind.JaxbindError`); a missing ``nthreads``
    fails the call itself (a ``jax.errors.JaxRuntimeError``).
"""


def get_healpix_sht(nside, lmax, mmax, spin, nthreads=1):
    """Spherical harmonic synthesis onto a RING-ordered HEALPix map, as a JAX function.

    Parameters
    ----------
    nside : int
        HEALPix resolution; the map has ``12 * nside**2`` pixels.
    lmax : int
        Largest :math:`l` (inclusive).
    mmax : int
        Largest :math:`m` (inclusive), ``0 <= mmax <= lmax``.
    spin : int
        0 for a scalar field (one map), > 0 for a spin field (two maps, from
        the gradient and curl :math:`a_{lm}`); ``spin <= lmax``.
    nthreads : int, default 1
        ducc0's threads (0: all hardware threads).

    Returns
    -------
    functools.partial
        ``sht(x)`` returning ``[map]``: ``x`` the real-packed :math:`a_{lm}` of shape
        ``(ncomp, 2 * nalm(lmax, mmax) - lmax - 1)`` (float32 or float64; see
        :func:`alm2realalm`), ``map`` of shape ``(ncomp, 12 * nside**2)`` and the
        dtype of ``x``, with ``ncomp`` 1 for spin 0 and 2 otherwise. It is linear,
        with ``ducc0.sht.adjoint_synthesis`` (repacked) as its transpose; it
        jit-compiles, differentiates and vmaps (a vmapped call is one ducc0
        call for the whole batch). ``sht.func`` is the underlying
        op (:func:`healpix_sht`), ``sht.keywords`` its keyword arguments, so
        ``jaxbind.testing.check_op(sht.func, x, **sht.keywords)`` checks it.

    Raises
    ------
    TypeError
        If an argument is not an integer (``operator.index``).
    ValueError
        If ``nside < 1``, not ``0 <= mmax <= lmax``, not ``0 <= spin <=
        lmax``, or ``nthreads < 0``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from jaxbind.contrib import jaxducc0
    >>> sht = jaxducc0.get_healpix_sht(nside=4, lmax=8, mmax=8, spin=0)
    >>> n = 2 * jaxducc0.nalm(8, 8) - 8 - 1
    >>> m, = sht(jnp.ones((1, n)))
    >>> m.shape
    (1, 192)
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
