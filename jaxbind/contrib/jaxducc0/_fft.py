"""The complex FFT and the Hartley transform, each its own transpose, self-batched."""

import operator

import ducc0

from ... import get_linear_call, load_kwargs
from ._common import _COMPLEX_OF, _REAL_OF, _check_dtype, _check_kwargs

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
            raise TypeError(f"axes must be None, an int or a sequence of ints, got {axes!r}.") from None
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


def _symmetric_transform(name, dtypes, options=()):
    """A self-batched op computing ``ducc0.fft.<name>(x, axes, inorm, nthreads, *options)``, its own transpose.

    ``dtypes``: the input dtypes accepted; ``options``: ``(kwarg, default,
    convert)`` triples passed to ``transform`` beside the common ones.
    """
    allowed = ("axes", "inorm", "nthreads") + tuple(option for option, _, _ in options)

    def abstract(x, *, batch_axes=None, **kwargs):
        _check_kwargs(kwargs, allowed)
        _check_dtype("the input", x.dtype, dtypes)
        _check_inorm(kwargs.get("inorm", 0))
        _transform_axes(len(x.shape), batch_axes, kwargs.get("axes"))
        return _same_layout(x, batch_axes)

    def callback(out, args, kwargs_dump):
        (x,) = args
        kw = load_kwargs(kwargs_dump)
        getattr(ducc0.fft, name)(  # looked up per call, as a user patching ducc0 expects
            x,
            axes=_transform_axes(x.ndim, kw.get("batch_axes"), kw.get("axes")),
            inorm=kw.get("inorm", 0),
            nthreads=kw.get("nthreads", 1),
            out=out[0],
            **{option: convert(kw.get(option, default)) for option, default, convert in options},
        )

    callback.__name__ = abstract.__name__ = f"_{name}"
    return get_linear_call(callback, callback, abstract, abstract, func_can_batch=True, name=f"jaxducc0.{name}")


c2c = _symmetric_transform("c2c", tuple(_REAL_OF), options=(("forward", True, bool),))
c2c.__doc__ = """c2c(x, *, axes=None, forward=True, inorm=0, nthreads=1)

Complex FFT of ``x`` (``ducc0.fft.c2c``) as a linear jaxbind op.

``c2c(x, axes=None, forward=True, inorm=0, nthreads=1)`` returns ``[y]``, ``y``
of the shape and dtype of ``x`` (complex64 or complex128; cast real data to
complex first, in JAX, so that its cotangent is made real by JAX's cast).
The op jit-compiles, differentiates to any order and vmaps; it is its own
transpose (the DFT matrix is symmetric) and batches itself: under ``vmap``
one ducc0 call transforms the whole batch.

Parameters
----------
x : jax.Array
    The array to transform, complex64 or complex128 (positional).
axes : int or sequence of int, optional
    The axes to transform (None: all; an int or a sequence of ints,
    negative ones from the end). Under ``vmap`` they are the axes of one
    element; the batch is transformed in one ducc0 call.
forward : bool, default True
    Sign of the exponent, ``-`` if True (``jnp.fft.fftn``), ``+``
    otherwise (``n * jnp.fft.ifftn``).
inorm : {0, 1, 2}, default 0
    0 no normalization, 1 divide by ``sqrt(N)``, 2 by ``N`` (``N``
    the number of points transformed).
nthreads : int, default 1
    ducc0's threads (0: all hardware threads).

Returns
-------
list of jax.Array
    ``[y]``: the transform, of the shape and dtype of ``x``.

Raises
------
TypeError
    If ``x`` is not complex64 or complex128, ``axes`` is not None, an int or
    a sequence of ints, or a keyword argument other than those above is
    given. Raised while tracing, as a type derived from ``TypeError`` and
    :class:`jaxbind.JaxbindError`, naming the op.
ValueError
    If an axis is out of range or repeated, or ``inorm`` is not 0, 1 or 2
    (likewise derived from :class:`jaxbind.JaxbindError`).

Examples
--------
>>> import jax.numpy as jnp
>>> from jaxbind.contrib import jaxducc0
>>> y, = jaxducc0.c2c(jnp.ones(8, jnp.complex64), inorm=2)
"""


genuine_fht = _symmetric_transform("genuine_fht", tuple(_COMPLEX_OF))
genuine_fht.__doc__ = """genuine_fht(x, *, axes=None, inorm=0, nthreads=1)

Hartley transform of ``x`` (``ducc0.fft.genuine_fht``) as a linear jaxbind op.

``genuine_fht(x, axes=None, inorm=0, nthreads=1)`` returns ``[y]``, ``y`` of
the shape and dtype of ``x`` (float32 or float64): ``Re(F x) - Im(F x)`` with
``F`` the forward FFT over ``axes`` (the "genuine" multi-axis Hartley
transform, not the separable one). ``axes``, ``inorm`` and ``nthreads`` as for
:func:`c2c`; self-batched under ``vmap``. The op is its own transpose.

Parameters
----------
x : jax.Array
    The array to transform, float32 or float64 (positional).
axes : int or sequence of int, optional
    The axes to transform (None: all; negative ones from the end), those of
    one element under ``vmap``.
inorm : {0, 1, 2}, default 0
    0 no normalization, 1 divide by ``sqrt(N)``, 2 by ``N``.
nthreads : int, default 1
    ducc0's threads (0: all hardware threads).

Returns
-------
list of jax.Array
    ``[y]``: the transform, of the shape and dtype of ``x``.

Raises
------
TypeError
    If ``x`` is not float32 or float64, ``axes`` is not None, an int or a
    sequence of ints, or an unknown keyword argument is given (raised while
    tracing, also a :class:`jaxbind.JaxbindError`).
ValueError
    If an axis is out of range or repeated, or ``inorm`` is not 0, 1 or 2
    (also a :class:`jaxbind.JaxbindError`).
"""
