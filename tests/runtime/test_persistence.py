"""Programs that outlive the process: JAX's persistent compilation cache and jax.export.

Each case runs ``_persistence_job.py`` in fresh processes (two forced CPU devices)
sharing a temporary folder, and reads the JSON line each prints.
"""

import json
import os
import sys

import _subprocesses
import numpy as np
import pytest

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_persistence_job.py")
PROGRAMS = ("forward", "native", "grad_with_residuals", "vmap", "sharded_walk", "eager")
# Seconds per job (they take 2-5 s): a test runs at most 3, in all below the per-test limit (900 s, pyproject.toml).
TIMEOUT = 240


def run_job(*args):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    returncode, out, err = _subprocesses.run(
        [sys.executable, JOB, *map(str, args)], TIMEOUT, f"_persistence_job.py {' '.join(map(str, args))}", env=env
    )
    assert returncode == 0, out + err
    return json.loads(out.strip().splitlines()[-1])


def files_in(folder):
    return sorted(os.listdir(folder))


def test_a_second_process_hits_the_cache_and_writes_nothing(tmp_path):
    cache = tmp_path / "cache"
    cold = run_job("cache", cache, "a")
    written = files_in(cache)
    warm = run_job("cache", cache, "a")
    for name in PROGRAMS:
        assert cold[name]["ok"] and warm[name]["ok"], (name, cold[name], warm[name])
        assert not cold[name]["hit"], (name, "hit in an empty cache")
        assert warm[name]["hit"], (name, "missed in the second process")
    assert cold["partitioned"] and warm["partitioned"]
    assert written and files_in(cache) == written  # the rerun added no entries
    # The callback's code changed (not the op): the cached program runs the new code.
    changed = run_job("cache", cache, "b")
    for name in PROGRAMS:
        assert changed[name]["hit"] and changed[name]["ok"], (name, changed[name])
    assert files_in(cache) == written


@pytest.fixture(scope="module")
def blob(tmp_path_factory):
    path = tmp_path_factory.mktemp("export") / "program.bin"
    assert run_job("export", path) == {"made": True}
    return path


def test_an_exported_program_runs_in_a_process_that_defines_its_ops(blob):
    # The importer defines other ops first: ops are found by name, not by order.
    assert run_job("import", blob, "all") == {"eager": True, "jitted": True, "grad": True}


def test_an_exported_program_names_the_op_a_process_lacks(blob):
    error = run_job("import", blob, "none")["error"]
    assert "op 'scale'" in error and "does not define" in error and "name='scale'" in error, error


def test_an_exported_program_refuses_ambiguous_names(blob):
    error = run_job("import", blob, "dup")["error"]
    assert "2 different ops of that name" in error and "distinct name=" in error, error


def test_an_unknown_schema_is_refused(blob, tmp_path):
    data = blob.read_bytes()
    assert data.count(b'"schema":1') >= 2  # the forward and its vjp
    future = tmp_path / "future.bin"
    future.write_bytes(data.replace(b'"schema":1', b'"schema":7'))
    error = run_job("import", future, "all")["error"]
    assert "schema is 7" in error and "reads schema 1" in error and "op '" in error, error


def test_export_without_jax_export_says_what_to_install(monkeypatch):
    """jax < 0.6's jax.export cannot be imported without absl-py: jaxbind.export says so."""
    import jax

    import jaxbind

    monkeypatch.setitem(sys.modules, "jax.export", None)  # `import jax.export` raises ImportError
    with pytest.raises(
        ImportError,
        match=r"jaxbind.export: jax .*'s jax.export cannot be imported .*"
        r"pip install absl-py",
    ):
        jaxbind.export(jax.jit(lambda x: x))


PURE_CALLBACK_JOB = """
import os, sys, json
import jax, jax.numpy as jnp, numpy as np
import jaxbind
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
spec = jax.ShapeDtypeStruct((3,), jnp.float32)

@jax.jit
def with_jaxbind(x):
    return jaxbind.pure_callback(np.sin, spec, x) + 1

@jax.jit
def with_jax(x):
    return jax.pure_callback(np.sin, spec, x) + 1

x = jnp.arange(3.0, dtype=jnp.float32)
print(json.dumps({"jaxbind": with_jaxbind(x).tolist(), "jax": with_jax(x).tolist()}))
"""


def test_a_pure_callback_program_is_cached_as_jax_caches_its_own(tmp_path):
    # JAX writes no entry for a program with a host callback before jax 0.11 and writes one from 0.11 on;
    # jaxbind.pure_callback's programs hold one too (they run synchronously, as JAX's): the same rule.
    cache = tmp_path / "cache"
    script = tmp_path / "pure_callback_job.py"
    script.write_text(PURE_CALLBACK_JOB)
    runs = []
    for _ in range(2):
        returncode, out, err = _subprocesses.run(
            [sys.executable, str(script), str(cache)], TIMEOUT, "pure_callback job"
        )
        assert returncode == 0, out + err
        runs.append((json.loads(out.strip().splitlines()[-1]), files_in(cache)))
    (first, written), (second, again) = runs
    expected = (np.sin(np.arange(3.0, dtype=np.float32)) + 1).tolist()
    for values in (first, second):
        np.testing.assert_allclose(values["jaxbind"], expected, rtol=1e-6)
        np.testing.assert_allclose(values["jax"], values["jaxbind"], rtol=1e-6)
    entries = lambda name: [f for f in written if f.startswith(f"jit_{name}-")]
    assert len(entries("with_jaxbind")) == len(entries("with_jax")), written
    assert again == written  # the second process loaded what the first wrote (or compiled again, writing nothing)
