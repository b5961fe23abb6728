"""One process of a 2-process ``jax.distributed`` job on 127.0.0.1 (see test_multidevice.py).

``python tests/_distributed_worker.py PROCESS_ID PORT`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=2``: 4 CPU devices in all. Prints a JSON
object ``{check: error message or ""}`` and the number of callback calls this process made.
"""

import faulthandler
import json
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Hung: print every thread's stack and exit, before test_multidevice.py's limit kills this process.
faulthandler.dump_traceback_later(float(os.environ.get("JAXBIND_TEST_CHILD_TIMEOUT", 240)), exit=True)
process_id, port = int(sys.argv[1]), int(sys.argv[2])
jax.config.update("jax_enable_x64", True)
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id, initialization_timeout=60)

from _shared import shard_map

import jaxbind

CALLS = []


def scale(out, args, kwargs_dump):
    CALLS.append(args[0].shape)
    np.multiply(args[0], 2.0, out=out[0])


def like(x, **kwargs):
    return ((x.shape, x.dtype),)


op = jaxbind.get_linear_call(scale, scale, like, like)
mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
sharding = NamedSharding(mesh, P("d"))
reference = np.random.default_rng(0).standard_normal((16, 3))  # the same in both processes
x = jax.make_array_from_callback(reference.shape, sharding, lambda index: reference[index])


def check_local(result, want):
    """Compare this process's shards of a global result with the reference."""
    assert result.sharding.spec[0] == "d", result.sharding
    for shard in result.addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data), want[shard.index], rtol=1e-12)


body = shard_map(lambda a: op(a)[0], mesh=mesh, in_specs=P("d"), out_specs=P("d"))
checks = {
    "shard_map_forward": lambda: check_local(jax.jit(body)(x), 2.0 * reference),
    "shard_map_grad": lambda: check_local(jax.jit(jax.grad(lambda a: jnp.sum(body(a) ** 2)))(x), 8.0 * reference),
    "vmap_global_batch": lambda: check_local(jax.jit(jax.vmap(lambda r: op(r)[0]))(x), 2.0 * reference),
}
results, calls = {}, {}
for name, check in checks.items():
    CALLS.clear()
    try:
        check()
        results[name] = ""
    except Exception as err:  # reported to the test
        results[name] = "".join(traceback.format_exception(type(err), err, err.__traceback__))[-2000:]
    calls[name] = len(CALLS)
print(json.dumps({"results": results, "calls": calls, "local_devices": jax.local_device_count()}))
sys.stdout.flush()
jax.distributed.shutdown()
