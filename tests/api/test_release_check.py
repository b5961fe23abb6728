"""tools/check_release.py's checks of a wheel's compiled extension (issue 41: the aarch64 wheel beside the
x86_64 one), on the extension this process imported: its reading of the ELF file against binutils'
readelf, and the machine, the name and the libraries it refuses."""

import importlib.util
import pathlib
import platform
import re
import shutil
import struct
import subprocess

import pytest

from jaxbind import _trampoline

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "check_release.py"
if not TOOL.exists():  # (a copy of the tests without the repository, as the wheel lane runs them)
    pytest.skip(f"{TOOL} is not beside this copy of the tests", allow_module_level=True)
spec = importlib.util.spec_from_file_location("check_release", TOOL)
check_release = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_release)

EXTENSION = pathlib.Path(_trampoline.__file__)
OTHER = {"x86_64": "aarch64", "aarch64": "x86_64"}


def _with_machine(data: bytes, machine: int) -> bytes:
    return data[:18] + struct.pack("<H", machine) + data[20:]


def test_the_versions_and_libraries_read_are_readelfs():
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) not found: install it to compare the ELF reading with it")
    out = subprocess.run([readelf, "-W", "-d", "-V", str(EXTENSION)], check=True, capture_output=True, text=True)
    glibc, needed = check_release.elf_needs(EXTENSION.read_bytes())
    assert needed == re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out.stdout)
    wanted = {(int(a), int(b)) for a, b in re.findall(r"Name: GLIBC_(\d+)\.(\d+)", out.stdout)}
    assert wanted and set(glibc) == wanted


@pytest.mark.skipif(platform.machine() not in OTHER, reason="an architecture the release builds no wheel for")
def test_an_extension_for_another_machine_is_refused_naming_both():
    data = EXTENSION.read_bytes()
    own, other = platform.machine(), OTHER[platform.machine()]
    machine = check_release.MACHINES[other]
    assert not any("ELF machine" in p for p in check_release.elf_problems(data, own))
    problems = check_release.elf_problems(_with_machine(data, machine), own)
    assert f"ELF machine {machine}, not {own}'s ({check_release.MACHINES[own]})" in problems
    assert not any("ELF machine" in p for p in check_release.elf_problems(_with_machine(data, machine), other))


def test_an_extension_named_for_another_architecture_is_refused():
    data = EXTENSION.read_bytes()
    wheel = "jaxbind_ffi-0.2.0-cp313-cp313-manylinux_2_27_aarch64.whl"
    problems = check_release.extension_problems(wheel, {"jaxbind/_trampoline.cpython-313-x86_64-linux-gnu.so": data})
    assert problems == [
        f"{wheel}: the extensions are ['jaxbind/_trampoline.cpython-313-x86_64-linux-gnu.so'], "
        "not jaxbind/_trampoline.cpython-313-aarch64-linux-gnu.so"
    ]


def test_a_library_outside_the_manylinux_policies_is_named():
    _, needed = check_release.elf_needs(EXTENSION.read_bytes())
    problems = check_release.elf_problems(EXTENSION.read_bytes(), platform.machine())
    wanted = [f"needs {n}, not in every manylinux policy" for n in needed if n not in check_release.ALLOWED_LIBRARIES]
    assert [p for p in problems if p.endswith("not in every manylinux policy")] == wanted
    assert "libc.so.6" in needed
    assert check_release.wheel_arch(pathlib.Path("x-1-cp313-cp313-manylinux_2_27_aarch64.whl")) == "aarch64"
    assert check_release.wheel_arch(pathlib.Path("x-1-cp311-cp311-manylinux_2_27_x86_64.whl")) == "x86_64"
