"""The exception that marks a failure of a user's function or of a program made elsewhere."""

from __future__ import annotations

__all__ = ["JaxbindError"]


class JaxbindError(RuntimeError):
    """A user-supplied function (an abstract) failed while an op was traced.

    The exception raised then is also of the abstract's own built-in exception
    type (a subclass of both), so ``except ValueError`` catches it too.

    Parameters
    ----------
    *args : object
        The exception's arguments, as for ``RuntimeError``; jaxbind passes
        one, the message (naming the op). User code catches this exception
        rather than raising it.

    Notes
    -----
    It is raised:

    - When an op is called (eagerly, or traced under ``jax.jit``,
      ``jax.grad``, ``jax.vmap``, ...) and its ``abstract`` (or another
      abstract function of it) raises a built-in exception: the exception
      raised is then of a type derived from both the built-in one and
      ``JaxbindError``, whose message names the op (``jaxbind op 'name': its
      abstract function raised ValueError: ...``) and whose ``__cause__`` is
      the original exception. Both ``except ValueError`` (say) and ``except
      jaxbind.JaxbindError`` catch it. An exception type of the user's own is
      raised itself instead, with a note naming the op.
    - When a program made elsewhere (deserialized after
      :func:`jaxbind.export`) is first called and cannot be resolved here: it
      names an op this process does not define, or several of that name, or
      one of another structure; it was made by a jaxbind with another call
      description schema; or its description or keyword arguments cannot be
      read. It reaches the caller through the failing call (a
      ``jax.errors.JaxRuntimeError`` naming the op).
    - In cases that indicate a jaxbind bug or an altered program (a call-site
      key collision, transposing a nonlinear callback).
    """
