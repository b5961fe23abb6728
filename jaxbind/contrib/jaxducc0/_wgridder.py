"""The radio-interferometric w-gridder: image to visibilities, vis2dirty as the transpose."""

import functools
import operator

import ducc0
import numpy as np

from ... import get_linear_call, load_kwargs
from ._common import _COMPLEX_OF, _REAL_OF, _check_dtype

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
            f"the image must have shape (npix_x, npix_y) = {(kw['npix_x'], kw['npix_y'])}, got {tuple(dirty.shape)}."
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
    ducc0.wgridder.experimental.vis2dirty(uvw=_as_f64(uvw), freq=_as_f64(freq), vis=np.conj(vis), dirty=out[0], **kw)


wgridder = get_linear_call(
    _dirty2vis, _vis2dirty, _dirty2vis_abstract, _vis2dirty_abstract, first_n_args_fixed=2, name="jaxducc0.wgridder"
)
wgridder.__doc__ = """wgridder(uvw, freq, dirty, *, pixsize_x, pixsize_y, npix_x, npix_y, epsilon, **kwargs)

ducc0's w-gridder (image -> visibilities) as a linear jaxbind op.

``wgridder(uvw, freq, dirty, **kwargs)`` returns ``[vis]``; :func:`get_wgridder`
fixes the keyword arguments. The op is ``ducc0.wgridder.experimental.dirty2vis``,
linear in ``dirty``; its transpose is ``vis2dirty`` of the conjugated
cotangent (JAX's convention for a real-to-complex map). ``uvw`` and ``freq``
are fixed arguments (computed in float64; asking for their derivative is an
error). Under ``vmap`` the batch is walked, one ducc0 call per element.

Parameters
----------
uvw : jax.Array
    The baselines' coordinates, shape ``(nrow, 3)``, real floats (metres).
freq : jax.Array
    The channels' frequencies, shape ``(nchan,)``, real floats (Hz).
dirty : jax.Array
    The image, shape ``(npix_x, npix_y)``, float32 or float64.
pixsize_x : float
    Pixel size along the first image axis, in radians (required by ducc0).
pixsize_y : float
    Pixel size along the second image axis, in radians (required by ducc0).
npix_x : int
    The image's first dimension (required).
npix_y : int
    The image's second dimension (required).
epsilon : float
    The requested accuracy (required by ducc0).
**kwargs
    Further keyword arguments of ``dirty2vis`` and ``vis2dirty``
    (``do_wgridding``, ``nthreads``, ``verbosity``, ``flip_v``, ``center_x``,
    ``wgt``, ``mask``, ...), with ducc0's defaults; ``vis2dirty``'s own
    (``double_precision_accumulation``) reach it alone.

Returns
-------
list of jax.Array
    ``[vis]``: the visibilities, shape ``(nrow, nchan)``, complex64 for a
    float32 image, else complex128.

Raises
------
TypeError
    If ``dirty`` is not float32 or float64, or ``uvw`` or ``freq`` is not of
    a real float dtype (raised while tracing, also a
    :class:`jaxbind.JaxbindError`).
ValueError
    If ``uvw`` is not of shape ``(nrow, 3)``, ``freq`` is not 1-d, or
    ``dirty`` is not of shape ``(npix_x, npix_y)`` (also a
    :class:`jaxbind.JaxbindError`).
KeyError
    If ``npix_x`` or ``npix_y`` is missing (also a
    :class:`jaxbind.JaxbindError`). Keyword arguments ducc0 refuses or lacks
    fail the call itself (a ``jax.errors.JaxRuntimeError`` carrying ducc0's
    message).
"""


def get_wgridder(
    *, pixsize_x, pixsize_y, npix_x, npix_y, epsilon, do_wgridding, nthreads=1, flip_v=False, verbosity=0, **kwargs
):
    """Radio-interferometric (w-)gridding (``ducc0.wgridder.experimental``) as a JAX function.

    Every argument is keyword-only. The values are converted (``float``,
    ``operator.index``, ``bool``) but otherwise checked by ducc0, when the
    function is called.

    Parameters
    ----------
    pixsize_x : float
        Pixel size of the image along its first axis, in radians.
    pixsize_y : float
        Pixel size along its second axis, in radians.
    npix_x : int
        The image's first dimension (even and at least 32, as ducc0 requires).
    npix_y : int
        The image's second dimension (even and at least 32).
    epsilon : float
        Requested accuracy (> 2e-13; > 1e-5 for a float32 image).
    do_wgridding : bool
        Whether to take the w coordinate into account (else w = 0).
    nthreads : int, default 1
        ducc0's threads (0: all hardware threads).
    flip_v : bool, default False
        Multiply the v coordinates by -1.
    verbosity : int, default 0
        0 silent, 1 diagnostics from ducc0.
    **kwargs
        Further keyword arguments of ``dirty2vis``/``vis2dirty``
        (``center_x``, ``center_y``, ``flip_u``, ``flip_w``, ``divide_by_n``,
        ``sigma_min``, ``sigma_max``, ``wgt``, ``mask``, ...); ones that only
        ``vis2dirty`` takes (``double_precision_accumulation``) reach it alone.

    Returns
    -------
    functools.partial
        ``grid(uvw, freq, image)`` returning ``[vis]``: ``uvw`` of shape
        ``(nrow, 3)`` (metres), ``freq`` of shape ``(nchan,)`` (Hz), ``image`` of
        shape ``(npix_x, npix_y)`` (float32 or float64); ``vis`` of shape
        ``(nrow, nchan)``, complex64 or complex128 after the image. It is the
        degridding ``dirty2vis``, linear in ``image``, whose transpose is
        ``vis2dirty`` (of the conjugated cotangent, JAX's convention for a
        real-to-complex map). ``uvw`` and ``freq`` are fixed arguments (computed
        in float64; not differentiable: asking for their derivative is an
        error). ``grid.func`` is the underlying op (:func:`wgridder`),
        ``grid.keywords`` its keyword arguments.

    Raises
    ------
    TypeError
        If ``kwargs`` holds one of the op's array arguments (``uvw``,
        ``freq``, ``dirty``, ``vis``), or ``npix_x``, ``npix_y``, ``nthreads``
        or ``verbosity`` is not an integer, or ``pixsize_x``, ``pixsize_y`` or
        ``epsilon`` is not a number (``float`` raises).
    ValueError
        If ``pixsize_x``, ``pixsize_y`` or ``epsilon`` is a string that
        ``float`` cannot parse.
    """
    clash = sorted(set(kwargs) & set(_WGRIDDER_RESERVED))
    if clash:
        raise TypeError(f"get_wgridder: {', '.join(map(repr, clash))} are the op's arguments, not keyword arguments.")
    return functools.partial(
        wgridder,
        pixsize_x=float(pixsize_x),
        pixsize_y=float(pixsize_y),
        npix_x=operator.index(npix_x),
        npix_y=operator.index(npix_y),
        epsilon=float(epsilon),
        do_wgridding=bool(do_wgridding),
        nthreads=operator.index(nthreads),
        flip_v=bool(flip_v),
        verbosity=operator.index(verbosity),
        **kwargs,
    )
