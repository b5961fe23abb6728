"""``get_linear_call``, the public constructor of linear and multilinear ops: its arguments checked
(``_arguments``), the definition built, the op made."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ._arguments import (
    as_callback,
    callback_parameters,
    check_callable,
    check_flags,
    check_no_setup_cache,
    check_thread_safe,
    declared_setup,
    drop_fixed_places,
    inplace_pairs,
    named_callback,
)
from ._definition import CallbackKind, Family, OpDef, OpKind
from ._effects import check_effect, exclusive_for
from ._op import Op

__all__ = ["get_linear_call"]


def get_linear_call(
    f: Callable,
    f_T: Callable | Sequence[Callable],
    /,
    abstract: Callable,
    abstract_T: Callable | Sequence[Callable],
    *,
    first_n_args_fixed: int = 0,
    func_can_batch: bool = False,
    name: str | None = None,
    vmap_method: str = "sequential",
    thread_safe: bool = False,
    inplace: dict | None = None,
    setup: Callable | None = None,
    setup_cache: int | None = None,
    effect: str | None = None,
) -> Op:
    """Create a JAX op from a linear (or multilinear) function and its transpose(s).

    The op computes ``y = f(*fixed, *x)``, linear in the non-fixed arguments
    ``x`` jointly (or, with a tuple of transposes, in each of them
    separately: a multilinear op). It jit-compiles, differentiates to any
    order (``jvp``, ``vjp``/``grad``, ``linear_transpose``) and vmaps; XLA
    calls ``f`` and ``f_T`` through jaxbind's compiled trampoline, on NumPy
    arrays that view XLA's buffers without copying.

    Parameters
    ----------
    f : callable or native kernel
        The forward function, ``f(out, args, kwargs_dump)``. ``args`` is the
        tuple of input arrays (read-only views), ``out`` the tuple of output
        arrays (writable): ``f`` writes every output and returns ``None``
        (returning a value is an error). ``kwargs_dump`` holds the call's
        keyword arguments; :func:`jaxbind.load_kwargs` gives them back as a
        dict. Do not keep references to ``args`` or ``out`` after returning
        (they view memory XLA reuses); store copies. A native kernel (a
        ctypes function, a ``numba.cfunc``, a ``PyCapsule``, the result of
        :func:`jaxbind.native` or :func:`jaxbind.numba_kernel`) is accepted
        here and for every other callback. Positional-only.
    f_T : callable or native kernel, or tuple of them
        The transpose, with the signature of ``f``. It receives ``(*fixed
        args, *output cotangents)`` and writes the cotangents of the linear
        arguments. JAX's convention: the linear transpose, not the adjoint
        (no complex conjugation). A tuple ``(f_T0, ..., f_Tn)`` with one
        transpose per linear argument makes a multilinear op: ``f_Ti``
        receives every argument except the ``i``-th, in order, then the output
        cotangents, and writes the one cotangent of argument ``i``. JAXbind's
        form, indexed by argument position with ``None`` in the places of the
        fixed arguments (``f_T=(None, f_T1)`` with ``first_n_args_fixed=1``),
        is accepted too. Positional-only.
    abstract : callable
        ``abstract(*args, **kwargs)``: receives objects with ``.shape`` and
        ``.dtype`` (one per array argument) and the call's keyword arguments,
        and returns a tuple with one ``(shape, dtype)`` per output of ``f``
        (with ``func_can_batch``, a third entry: the output's batch axis). A
        shape is a sequence of non-negative Python or NumPy integers (a float
        or a bool is an error, not rounded). No numbers are computed.
    abstract_T : callable or tuple of callables
        The same for ``f_T``, from the arguments ``f_T`` receives; it
        declares exactly one cotangent per linear argument the transpose
        computes. A tuple matching ``f_T`` for a multilinear op.
    first_n_args_fixed : int, default 0
        The first arguments are parameters, not differentiated (``f`` need
        not be linear in them). Asking for a derivative with respect to one
        is an error naming the argument.
    func_can_batch : bool, default False
        The callbacks handle batching themselves: they and the abstracts
        receive the keyword argument ``batch_axes``, ``None`` when not
        batched, else a tuple with, per input, the tuple of its batch axes
        (vmapping at axis ``a`` shifts existing batch axes ``>= a`` by one and
        appends ``a``). The abstracts then return the output's new batch axis
        as a third entry per output (anywhere; jaxbind moves a transpose's
        cotangents into place). An input is mapped at every vmap level or at
        none: jaxbind broadcasts a fixed input that one level maps and another
        does not, and non-fixed inputs a level does not map. An abstract whose
        declared output does not hold every batch level at the axis it names
        is a ``ValueError`` raised while tracing. Only
        ``vmap_method="sequential"`` goes with it.
    name : str, optional
        The op's name (a non-empty string; default: ``f.__name__``). It is in
        every error (``jaxbind op 'name': ...``), in jaxprs and in the
        compiled program (the frontend attribute ``jaxbind_op`` and the op
        metadata ``op_name``). Give one when callbacks come from a factory
        and share a ``__name__``. Ops that differ only in name are different
        ops (they do not share compiled code).
    vmap_method : {"sequential", "expand_dims", "broadcast_all"}, default "sequential"
        How a vmapped op (without ``func_can_batch``) hands its batch to the
        callbacks, with the values and meaning of ``jax.pure_callback``'s:
        ``"sequential"``, one custom call whose handler calls the callback once
        per batch element; ``"expand_dims"``, one call in which every vmap
        level is a leading axis of every input, outermost first, of size 1
        where the input is not mapped; ``"broadcast_all"``, one call with
        inputs broadcast to the full batch. The abstracts still describe one
        element, and every output gets all batch levels in front. The method
        applies to every callback of the op (transposes, ``f_jvp``,
        ``f_vjp``): a linear input that a level does not map gets its
        cotangent summed over that level. Under ``"expand_dims"`` the callback
        must line up each input's element rank itself (a scalar parameter
        beside a vector arrives as ``(batch...,)`` and needs ``v[..., None]``);
        :func:`jaxbind.testing.check_op` catches the mistake.
    thread_safe : bool, default False
        The Python callbacks may run on several threads at once. A vmapped
        call walked element by element (``"sequential"``) then spreads its
        elements over XLA's intra-op threads, each taking the GIL: bodies that
        release it (NumPy on large arrays, SciPy, numba's ``nogil``
        functions) run in parallel. The first two elements are timed, and a
        walk whose remaining elements would take less than ~0.1 ms in all
        stays on one thread; a walk that no helper thread could join (the
        body held the GIL throughout) makes the call site's next 16 walks
        stay on the calling thread. Off by default: the callbacks must not
        rely on running alone. Native kernels are walked in parallel
        whatever this says.
    inplace : dict, optional
        ``{output index: argument index}`` (arguments counted with the fixed
        ones): output *i* is argument *j* updated in place. The callback
        finds ``out[i]`` already holding argument *j*'s values and writes
        its result there; XLA passes the argument's own buffer when nothing
        else needs it (a donated argument, a loop carry, a dead
        intermediate) and a copy otherwise, so an argument used later is
        never changed. ``args[j]`` and ``out[i]`` may then be the same
        memory: read each element before writing it. Output and argument
        need the same shape and dtype. Only the forward call is in place;
        the derivative and transpose callbacks run out of place. Under
        ``vmap`` each element's output is that element's argument (an
        unmapped argument is broadcast first). The mapping runs from
        output to argument: ``jax.ffi.ffi_call``'s
        ``input_output_aliases={argument: output}`` is
        ``inplace={output: argument}`` here.
    effect : {None, "io", "ordered"}, default None
        The op's side effects, as for :func:`jaxbind.get_nonlinear_call`: an
        op with one is never dropped or merged (and with ``"ordered"`` runs in
        program order), runs one call at a time unless ``thread_safe=True``,
        and cannot be differentiated or transposed (its transposes are then
        never called).
    setup : callable, optional
        ``setup(args, kwargs) -> state``: makes what the callbacks need and
        should not make again at every call (a factorization, a plan, a
        solver handle). It receives the call's fixed arguments (read-only
        copies it may keep) and kwargs (a dict); every callback is then called
        as ``f(out, args, kwargs_dump, state)`` with the state made for the
        same fixed arguments and kwargs, the transpose included. It runs at
        most once per distinct (fixed arguments' values, kwargs) while the op
        keeps that state; a state that is gone is made again, so results never
        depend on what was kept. Python callbacks only (a native kernel is
        refused). See the linear guide.
    setup_cache : int, optional
        With ``setup`` only: the most states the op keeps (default 8; least
        recently used first out; freed with the op). A vmapped call over B
        distinct fixed arguments makes B states: keep at least B to reuse
        them in its transpose.

    Returns
    -------
    Op
        The op. ``op(*arrays, **kwargs)`` returns the list of outputs; see
        :class:`jaxbind.Op` for calling it.

    Raises
    ------
    TypeError
        If ``f`` or a transpose is neither a Python callable nor a native
        kernel (a bare integer address must be wrapped with
        :func:`jaxbind.native`; a ctypes function or ``numba.cfunc`` declared
        with another signature than ``int kernel(const jaxbind_call *)`` is
        refused), if ``abstract`` or an ``abstract_T`` is not callable, if
        ``func_can_batch`` or ``thread_safe`` is not a bool, or if ``name`` is
        not a string; if ``setup`` is given and is not callable, cannot be
        called as ``setup(args, kwargs)`` (where its signature says so), a
        callback is a native kernel, or a Python callback cannot take the
        fourth argument, ``state``; if ``setup_cache`` is given without
        ``setup``.
    ValueError
        If ``name`` is empty; if ``first_n_args_fixed`` is not a non-negative
        integer; if ``vmap_method`` is not one of its three values, or is not
        ``"sequential"`` with ``func_can_batch=True``; if ``f_T`` and
        ``abstract_T`` are not both single functions or both tuples of the
        same length; if ``f_T`` is an empty tuple, or has ``None`` elsewhere
        than at the first ``first_n_args_fixed`` places; if a native kernel is
        a null pointer, or has no name of its own while the op would be named
        after it (pass ``name=``); if ``setup_cache`` is not a positive
        integer.

    See Also
    --------
    get_nonlinear_call : an op that is not linear, with its jvp and vjp.

    Notes
    -----
    Outputs of integer or bool dtype are not differentiable: their tangents
    are symbolic zeros, and a transpose receives zeros of their own dtype as
    their cotangents.

    Errors in using the op (a bad call, or an abstract that fails or returns
    something invalid) are raised when it is called or traced; see
    :class:`jaxbind.Op`.

    Examples
    --------
    A scaling, its own transpose:

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> import jaxbind
    >>> def scale(out, args, kwargs_dump):
    ...     factor = jaxbind.load_kwargs(kwargs_dump)["factor"]
    ...     np.multiply(args[0], factor, out=out[0])
    >>> def abstract(x, *, factor):
    ...     return ((x.shape, x.dtype),)
    >>> op = jaxbind.get_linear_call(scale, scale, abstract, abstract)
    >>> y, = op(jnp.arange(3.0), factor=2.0)
    >>> g = jax.grad(lambda x: jnp.sum(op(x, factor=2.0)[0] ** 2))(jnp.arange(3.0))
    """
    check_no_setup_cache(name, f, setup, setup_cache)  # (first: callbacks that take a state then name the cause)
    parameters = callback_parameters(setup)
    f, name = named_callback(f, name, parameters)
    check_callable(abstract, "abstract", name)
    first_n_args_fixed, func_can_batch, vmap_method = check_flags(name, first_n_args_fixed, func_can_batch, vmap_method)
    if isinstance(f_T, (tuple, list)):
        if not isinstance(abstract_T, (tuple, list)) or len(abstract_T) != len(f_T):
            raise ValueError(
                f"jaxbind op '{name}': f_T is a tuple of {len(f_T)} transposes (a multilinear op), "
                f"so abstract_T must be a tuple of as many abstract functions, got {abstract_T!r:.100}."
            )
        f_T, abstract_T = drop_fixed_places(name, tuple(f_T), tuple(abstract_T), first_n_args_fixed)
        if not f_T:
            raise ValueError(f"jaxbind op '{name}': f_T is an empty tuple; give one transpose per linear argument.")
        f_T = tuple(as_callback(t, f"f_T[{i}]", name, parameters) for i, t in enumerate(f_T))
        for i, a in enumerate(abstract_T):
            check_callable(a, f"abstract_T[{i}]", name)
        family = Family(
            callbacks=tuple(f_T) + (f,),
            abstracts=tuple(abstract_T) + (abstract,),
            kinds=(CallbackKind.TRANSPOSE,) * len(f_T) + (CallbackKind.FORWARD,),
            labels=tuple(f"transpose {i} callback" for i in range(len(f_T))) + ("forward",),
            linear=True,
        )
        kind = OpKind.MULTILINEAR
    else:
        if isinstance(abstract_T, (tuple, list)):
            raise ValueError(
                f"jaxbind op '{name}': abstract_T is a tuple but f_T is a single function; "
                "pass tuples for both (a multilinear op) or single functions for both."
            )
        f_T = as_callback(f_T, "f_T", name, parameters)
        check_callable(abstract_T, "abstract_T", name)
        family = Family(
            callbacks=(f_T, f),
            abstracts=(abstract_T, abstract),
            kinds=(CallbackKind.TRANSPOSE, CallbackKind.FORWARD),
            labels=("transpose callback", "forward"),
            linear=True,
        )
        kind = OpKind.LINEAR
    thread_safe = check_thread_safe(name, thread_safe)
    effect = check_effect(name, effect)
    return Op(
        OpDef(
            kind,
            name,
            (family,),
            first_n_args_fixed,
            func_can_batch,
            vmap_method,
            thread_safe=thread_safe,
            inplace=inplace_pairs(name, inplace),
            setup=declared_setup((family,), setup, setup_cache, name),
            effect=effect,
            exclusive=exclusive_for(effect, thread_safe),
        )
    )
