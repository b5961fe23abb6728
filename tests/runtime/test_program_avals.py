"""Programs from elsewhere whose shapes, dtypes or names are not the op's (issue 40, items 2, 3 and 8).

Each case runs in a process of its own (``_program_avals_cases.py``), so that a program that gets a
kernel to write past a buffer fails the test instead of ending the run. The programs are forged as
an attacker forges them: made by another process's op of the same name with another abstract (the
docs' own native kernel, ``docs/examples/scale.c``), written by hand against jaxbind's target, or a
real ``jaxbind.export`` artifact edited and serialized again. Every case asserts the refusal's words
and that the op itself still computes what NumPy computes.
"""

import os
import subprocess
import sys

import _subprocesses

CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_program_avals_cases.py")


def _run(case, folder, env=None):
    process = subprocess.Popen(
        [sys.executable, CASES, case, str(folder)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_subprocesses.environment({**os.environ, **(env or {})}),
    )
    ((out, err),) = _subprocesses.communicate_all([process], 300, case)
    assert process.returncode == 0 and out.strip().endswith("DONE"), (
        f"{case} ended with status {process.returncode}:\n{out[-3000:]}\n{err[-6000:]}"
    )


def test_a_program_made_by_another_processs_op_with_another_abstract_is_refused(tmp_path):
    # scale.c with out f64[1] for in f64[100000] there; the kernel would write 100000 doubles
    _run("make_other_abstract", tmp_path)
    _run("run_other_abstract", tmp_path)


def test_buffers_other_than_the_description_says_never_reach_a_kernel(tmp_path):
    # the description an honest export makes (f64[1] -> f64[1]), the buffers f64[100000] -> f64[1]:
    # resolved from the description, and with the site live; a plain and a concurrent kernel
    _run("make_other_buffers", tmp_path)
    _run("run_other_buffers", tmp_path)


def test_a_live_sites_own_description_on_other_buffers_is_refused_at_the_call(tmp_path):
    _run("run_live_site_other_buffers", tmp_path)


def test_a_vmapped_programs_output_avals_are_checked_with_its_batch(tmp_path):
    _run("run_batched_avals", tmp_path)


def test_a_program_cannot_run_a_pure_callback_function_by_name(tmp_path):
    _run("run_pure_callback_by_name", tmp_path)


def test_a_program_whose_op_structure_differs_is_refused_naming_the_fields(tmp_path):
    _run("run_def_with_inplace", tmp_path)


def test_a_padded_programs_avals_and_buffers_are_checked_where_it_runs(tmp_path):
    # 10 rows over 4 devices: XLA pads the batch and the call carries a validity operand
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    _run("run_padded_export", tmp_path, {"XLA_FLAGS": flags})
