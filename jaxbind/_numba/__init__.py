"""numba kernels: native kernels written in Python (numba's nopython subset).

``numba_kernel(fn)`` turns ``fn(out, args, kwargs)`` into a :class:`NativeKernel`
that jaxbind calls like a C kernel: no Python and no GIL on the call path, the
parallel walk under vmap. What runs when XLA calls it, all compiled:

1. an *entry* (the address ``address_for`` gives a call site; one per kwarg
   signature): it reads the call's arity, dtypes and ranks and finds them in
   its table;
2. the *variant* compiled for them (a ``numba.cfunc``): it makes the arrays
   (``numba.carray`` over the data pointers) and the kwargs (a namedtuple) from
   the call struct and calls ``fn`` through numba's calling convention, so that
   an exception ``fn`` raises comes back as a status, and its message is
   written to the call's error buffer (the GIL taken for that only).

The signature is looked up at run time because a call site cannot know it: in a
vmap walk the kernel sees one element of each batched array, while the site's
avals are those of the whole batch, and jaxbind keeps one site for calls that
differ only in their avals. A signature met for the first time is compiled then,
by a hook that takes the GIL (a ctypes callback); after that the table answers.

numba is imported on first use only: ``import jaxbind`` does not pay for it.

The modules, from the public face down:

- ``_kernel``: :func:`numba_kernel` and the :class:`NumbaKernel` it makes;
- ``_checks``: numba itself, and what a kernel may be and take (forms, dtypes, kwargs);
- ``_program``: one function's compiled state, its entries and variants;
- ``_entry``: an entry, its table of signatures and the trampoline that gives it an address;
- ``_variant``: a variant, the generated code that makes ``fn``'s arguments from the call;
- ``_codegen``: the intrinsics, the guard and the generic entry the generated code is made of;
- ``_callbacks``: the Python the compiled code calls (the hook, the error reporter), the exit flag;
- ``_call_struct``: the call struct of ``jaxbind.h`` mirrored with ctypes.
"""

from ._kernel import NumbaKernel, numba_kernel

__all__ = ["NumbaKernel", "numba_kernel"]
