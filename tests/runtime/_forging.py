"""Programs forged as an attacker forges them (shared by the tests of programs from elsewhere and
their child processes): a real ``jaxbind.export`` artifact whose one jaxbind call's description is
edited in its StableHLO text, parsed and serialized again with JAX's own MLIR tools."""

import base64
import dataclasses
import inspect
import json
import re

import jax
import jax.export  # (jax < 0.6 does not import it with jax)
import jax.numpy as jnp

import jaxbind

like = lambda *args, **kwargs: ((args[-1].shape, args[-1].dtype),)
_CALL = re.compile(r'jaxbind = "((?:[^"\\]|\\.)*)", site = (\d+) : i64')


def reader(seen):
    """A linear op named 'kwargs_reader' whose callbacks double their input and append to ``seen``
    the repr of every kwarg they read (a repr reads every part of a value)."""

    def doubling(out, args, kwargs_dump):
        seen.append(repr(jaxbind.load_kwargs(kwargs_dump)))
        out[0][...] = 2 * args[-1]

    return jaxbind.get_linear_call(doubling, doubling, like, like, name="kwargs_reader")


def exported(op, shape):
    return jaxbind.export(jax.jit(lambda v: op(v)[0]))(jax.ShapeDtypeStruct(shape, jnp.float32))


def description_of(program) -> dict:
    """The description of the one jaxbind call of an exported program."""
    ((text, _),) = _CALL.findall(program.mlir_module())
    return json.loads(text.replace("\\22", '"'))


def forged(program, description: dict) -> bytes:
    """``program`` serialized with its one jaxbind call's description replaced by ``description``
    (under the key that description's digest gives, as an attacker computes it)."""
    from jaxbind import _sites

    text = json.dumps(description, sort_keys=True, separators=(",", ":"))

    def edit(match):
        return f'jaxbind = "{text.replace(chr(34), chr(92) + "22")}", site = {_sites.key_of(text)} : i64'

    module_text, n = _CALL.subn(edit, program.mlir_module())
    assert n == 1
    return serialized_with(program, module_text)


def serialized_with(program, module_text: str) -> bytes:
    """``program`` serialized with its module replaced by ``module_text`` (MLIR's text form), written
    as bytecode by JAX's own tools, as a file from elsewhere would be."""
    from jax._src.export import _export
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    with mlir.make_ir_context():
        module = ir.Module.parse(module_text)
        n_params = len(inspect.signature(_export._module_to_bytecode).parameters)
        extra = (jax.config.jax_use_shardy_partitioner,) if n_params == 2 else ()
        blob = _export._module_to_bytecode(module, *extra)
    return bytes(dataclasses.replace(program, mlir_module_serialized=blob).serialize())


def with_kwargs(program, dump: bytes) -> bytes:
    """``program`` serialized with its kwargs bytes (a pickle) replaced by ``dump``."""
    description = description_of(program)
    description["kwargs"] = base64.b64encode(dump).decode()
    return forged(program, description)
