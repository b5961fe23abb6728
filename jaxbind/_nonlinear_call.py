"""``get_nonlinear_call``, the public constructor of nonlinear ops: its arguments checked
(``_arguments``), the definition built, the op made."""

from __future__ import annotations

from collections.abc import Callable

from ._arguments import (
    as_callback,
    callback_parameters,
    check_callable,
    check_flags,
    check_n_residuals,
    check_no_setup_cache,
    check_thread_safe,
    declared_setup,
    inplace_pairs,
    named_callback,
)
from ._definition import CallbackKind, Family, OpDef, OpKind
from ._effects import check_effect, exclusive_for
from ._op import Op

__all__ = ["get_nonlinear_call"]


def get_nonlinear_call(
    f: Callable,
    f_derivative: tuple[Callable, Callable] | None,
    /,
    abstract: Callable,
    abstract_reverse: Callable | None,
    *,
    first_n_args_fixed: int = 0,
    func_can_batch: bool = False,
    name: str | None = None,
    vmap_method: str = "sequential",
    n_residuals: int = 0,
    thread_safe: bool = False,
    inplace: dict | None = None,
    setup: Callable | None = None,
    setup_cache: int | None = None,
    effect: str | None = None,
) -> Op:
    """Create a JAX op from a nonlinear function with its jvp and vjp.

    The op jit-compiles, vmaps and differentiates to first order (``jvp``,
    ``vjp``/``grad``, the jacobians); a second-order derivative raises an
    error naming the op. An op made with ``f_derivative=None`` has no
    derivatives at all.

    Parameters
    ----------
    f : callable or native kernel
        The function, ``f(out, args, kwargs_dump)``, as for
        :func:`jaxbind.get_linear_call`. With ``n_residuals=k`` it writes its
        outputs followed by ``k`` residual arrays. Positional-only.
    f_derivative : tuple of two callables or native kernels, or None
        ``(f_jvp, f_vjp)``, each with the signature of ``f``. ``f_jvp``
        receives ``(*primals, *tangents of the non-fixed arguments)`` and
        writes the output tangents; ``f_vjp`` receives ``(*primals, *output
        cotangents)`` and writes the cotangents of the non-fixed arguments.
        With residuals both receive them after the primals: ``(*primals,
        *residuals, *tangents)`` and ``(*primals, *residuals,
        *cotangents)``. Integer and bool outputs have no tangents: ``f_jvp``
        writes, and ``f_vjp`` receives, those of the inexact (float, complex)
        outputs only, in order. ``None`` makes an op without derivatives
        (``abstract_reverse`` is then ``None`` too): it jits and vmaps, and
        differentiating it raises a ``ValueError`` naming the op; give it
        derivatives with ``jax.custom_jvp``, ``jax.custom_vjp`` or
        ``jax.lax.custom_root``. Positional-only.
    abstract : callable
        Output shapes and dtypes of ``f`` and of ``f_jvp``: it is called
        with the arguments of each (and the call's keyword arguments) and
        describes all of ``f``'s outputs, as for
        :func:`jaxbind.get_linear_call`; jaxbind keeps the inexact ones for
        ``f_jvp``. With residuals it is called with the primals only and
        declares the outputs followed by the residuals; the tangents then
        take the outputs' shapes and dtypes.
    abstract_reverse : callable or None
        Output shapes and dtypes of ``f_vjp``, from the arguments ``f_vjp``
        receives. ``None`` exactly when ``f_derivative`` is ``None``.
    first_n_args_fixed : int, default 0
        The first arguments are not differentiated (a derivative with respect
        to one is an error naming it).
    func_can_batch : bool, default False
        The callbacks handle batching themselves (see
        :func:`jaxbind.get_linear_call`).
    name : str, optional
        The op's name in errors, jaxprs and the compiled program's metadata
        (default: the name of ``f``; see :func:`jaxbind.get_linear_call`).
    vmap_method : {"sequential", "expand_dims", "broadcast_all"}, default "sequential"
        How a vmapped op calls its callbacks (see
        :func:`jaxbind.get_linear_call`).
    n_residuals : int, default 0
        ``f`` writes this many residual arrays after its outputs (e.g. a
        solution, a factorization, any shapes and dtypes); calling the op
        returns the outputs only, and the residuals reach ``f_jvp`` and
        ``f_vjp`` after the primals, so that derivatives reuse the forward
        computation (``f`` runs once per primal point under jvp, grad, vmap
        and jit). Residuals are not differentiated. An abstract that declares
        ``n_residuals`` arrays or fewer (no output left) is an error naming
        the op when it is called.
    thread_safe : bool, default False
        The Python callbacks may run on several threads at once (see
        :func:`jaxbind.get_linear_call`).
    inplace : dict, optional
        ``{output index: argument index}``: output *i* is argument *j*
        updated in place (see :func:`jaxbind.get_linear_call`); the
        inverse of ``jax.ffi.ffi_call``'s ``input_output_aliases={argument:
        output}``.
    effect : {None, "io", "ordered"}, default None
        The op's side effects (a code with state: a ``SAVE`` variable, a
        simulator handle, a writer). None: pure, as every op without it.
        ``"io"``: its calls are never dropped (results unused) or merged
        (equal calls); ``"ordered"``: they also run in program order. Such an
        op runs one call at a time unless ``thread_safe=True``, refuses
        ``vmap`` when ordered, and has no derivatives (pass
        ``f_derivative=None``); see the callbacks guide.
    setup : callable, optional
        ``setup(args, kwargs) -> state``: makes what ``f`` and its
        derivatives need and should not make again (a factorization, a plan,
        an integrator handle). It receives the call's primal inputs, fixed ones
        included (read-only copies it may keep), and its kwargs (a dict);
        ``f``, ``f_jvp`` and ``f_vjp`` are then called as ``f(out, args,
        kwargs_dump, state)`` with the state made for the same primal inputs
        and kwargs: ``jit(value_and_grad)`` makes one for the forward and the
        vjp, ``jax.jacrev`` one for all its rows. It runs at most once per
        distinct (inputs' values, kwargs) while the op keeps that state; a
        state that is gone is made again, so results never depend on what was
        kept. Python callbacks only (a native kernel is refused). See the
        nonlinear guide.
    setup_cache : int, optional
        With ``setup`` only: the most states the op keeps (default 8; least
        recently used first out; freed with the op). A vmapped gradient over
        B distinct inputs makes B states in its forward walk and needs them in
        its vjp walk: keep at least B.

    Returns
    -------
    Op
        The op: ``op(*arrays, **kwargs)`` returns the list of outputs (the
        residuals excluded); see :class:`jaxbind.Op`. Derivatives are first
        order only.

    Raises
    ------
    TypeError
        If ``f``, ``f_jvp`` or ``f_vjp`` is neither a Python callable nor a
        native kernel (as for :func:`jaxbind.get_linear_call`); if
        ``abstract`` or ``abstract_reverse`` is not callable; if
        ``f_derivative`` is neither ``None`` nor a pair, or only one of its
        two entries is ``None``; if ``abstract_reverse`` is ``None`` while
        ``f_derivative`` is given, or given while ``f_derivative`` is
        ``None``; if ``n_residuals`` is not an integer; if ``func_can_batch``
        or ``thread_safe`` is not a bool, or ``name`` is not a string; if
        ``setup`` is given and is not callable, cannot be called as
        ``setup(args, kwargs)`` (where its signature says so), a callback is
        a native kernel, or a Python callback cannot take the fourth
        argument, ``state``; if ``setup_cache`` is given without ``setup``.
    ValueError
        If ``n_residuals`` is negative; if ``name`` is empty; if
        ``first_n_args_fixed`` is not a non-negative integer; if
        ``vmap_method`` is not one of its three values, or is not
        ``"sequential"`` with ``func_can_batch=True``; if a native kernel is a
        null pointer or needs a name (as for
        :func:`jaxbind.get_linear_call`); if ``setup_cache`` is not a
        positive integer.

    See Also
    --------
    get_linear_call : a linear or multilinear op, differentiable to any order.

    Examples
    --------
    ``y = sin(x)`` with its derivatives:

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> import jaxbind
    >>> def f(out, args, kwargs_dump):
    ...     np.sin(args[0], out=out[0])
    >>> def f_jvp(out, args, kwargs_dump):      # (x, dx)
    ...     np.multiply(np.cos(args[0]), args[1], out=out[0])
    >>> def f_vjp(out, args, kwargs_dump):      # (x, y_ct)
    ...     np.multiply(np.cos(args[0]), args[1], out=out[0])
    >>> def abstract(*args, **kwargs):
    ...     return ((args[0].shape, args[0].dtype),)
    >>> op = jaxbind.get_nonlinear_call(f, (f_jvp, f_vjp), abstract, abstract)
    >>> g = jax.grad(lambda x: jnp.sum(op(x)[0]))(jnp.linspace(0.0, 1.0, 5))
    """
    check_no_setup_cache(name, f, setup, setup_cache)  # (first: callbacks that take a state then name the cause)
    parameters = callback_parameters(setup)
    f, name = named_callback(f, name, parameters)
    check_callable(abstract, "abstract", name)
    first_n_args_fixed, func_can_batch, vmap_method = check_flags(name, first_n_args_fixed, func_can_batch, vmap_method)
    n_residuals = check_n_residuals(name, n_residuals)
    forward = Family(
        callbacks=(f,), abstracts=(abstract,), kinds=(CallbackKind.FORWARD,), labels=("forward",), linear=False
    )

    effect = check_effect(name, effect)
    if effect is not None and f_derivative is not None:
        raise ValueError(
            f"jaxbind op '{name}': an op with effect={effect!r} has no derivatives (each call changes its "
            "state, so a derivative that called it again would see another state): pass "
            "f_derivative=None and abstract_reverse=None, and differentiate in JAX if you must "
            "(jax.custom_vjp around the op)."
        )

    def nonlinear_op(families):
        thread_safe_ = check_thread_safe(name, thread_safe)
        flags = (first_n_args_fixed, func_can_batch, vmap_method, n_residuals, thread_safe_)
        declared = declared_setup(families, setup, setup_cache, name)
        definition = OpDef(
            OpKind.NONLINEAR,
            name,
            families,
            *flags,
            inplace=inplace_pairs(name, inplace),
            setup=declared,
            effect=effect,
            exclusive=exclusive_for(effect, thread_safe_),
        )
        return Op(definition)

    if f_derivative is None:
        if abstract_reverse is not None:
            raise TypeError(
                f"jaxbind op '{name}': f_derivative is None (an op without derivatives) but "
                "abstract_reverse is given; pass None for both, or give f_derivative=(f_jvp, f_vjp)."
            )
        return nonlinear_op((forward,))
    if not isinstance(f_derivative, (tuple, list)) or len(f_derivative) != 2:
        raise TypeError(
            f"jaxbind op '{name}': f_derivative must be a pair (f_jvp, f_vjp), or None for an op "
            f"without derivatives, got {f_derivative!r:.100}."
        )
    if any(d is None for d in f_derivative):
        missing = "f_jvp (f_derivative[0])" if f_derivative[0] is None else "f_vjp (f_derivative[1])"
        raise TypeError(
            f"jaxbind op '{name}': {missing} must be a Python callable or a native kernel, got None. "
            "Give both f_jvp and f_vjp, or pass f_derivative=None (and abstract_reverse=None) for an "
            "op without derivatives."
        )
    if abstract_reverse is None:
        raise TypeError(
            f"jaxbind op '{name}': abstract_reverse is None but f_derivative is given; it "
            "describes the outputs of f_vjp. (Pass None for both for an op without derivatives.)"
        )
    check_callable(abstract_reverse, "abstract_reverse", name)
    f_jvp = as_callback(f_derivative[0], "f_jvp (f_derivative[0])", name, parameters)
    f_vjp = as_callback(f_derivative[1], "f_vjp (f_derivative[1])", name, parameters)
    derivative = Family(
        callbacks=(f_vjp, f_jvp),
        abstracts=(abstract_reverse, abstract),
        kinds=(CallbackKind.VJP, CallbackKind.JVP),
        labels=("vjp callback", "jvp callback"),
        linear=True,
    )
    return nonlinear_op((forward, derivative))
