"""Checks the release artifacts tools/build_release.sh left in a folder (CI's wheel lane runs it).

    python3 tools/check_release.py dist [--arch x86_64 --arch aarch64]

- one wheel per architecture asked for (by default the machine's and, on x86_64, the aarch64 wheel
  tools/build_release.sh cross-builds beside it; --arch ARCH, repeated, names others), and every
  wheel's platform tags are manylinux for glibc 2.27 (jaxlib's own wheels' floor) or older: it installs
  wherever jaxlib's do;
- each wheel's extension is one ELF shared object for its tag's machine (EM_X86_64, EM_AARCH64: read
  from the ELF header, not trusted to the name), named for the wheel's Python and architecture
  (.cpython-313-aarch64-linux-gnu.so), needing no glibc symbol version newer than 2.27 and no library
  beyond glibc's and libgcc_s (what every manylinux policy offers), read from its ELF sections;
- the wheel holds every file pyproject.toml's license-files names (LICENSE, THIRD_PARTY_NOTICES.md and
  the third-party license texts in licenses/: nanobind's, which its BSD-3 license asks a binary copy to
  carry, and the others the extension holds code of) under .dist-info/licenses/, byte for byte as in the
  repository, the sdist holds them at its root, and both metadata files name them (License-File) with the
  license expression pyproject.toml gives;
- THIRD_PARTY_NOTICES.md names every file of licenses/, and licenses/ holds nanobind's license;
- both metadata files carry pyproject.toml's [project.urls], no more and no fewer.

Exits non-zero with every failed check named.
"""

import email.parser
import pathlib
import platform
import re
import struct
import sys
import tarfile
import tomllib
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
NEWEST_GLIBC = (2, 27)
# ELF e_machine of each architecture a wheel may be for.
MACHINES = {"x86_64": 62, "aarch64": 183}
# The libraries an extension may need: glibc's and libgcc_s (in every manylinux policy).
ALLOWED_LIBRARIES = {
    "libc.so.6",
    "libm.so.6",
    "libpthread.so.0",
    "libdl.so.2",
    "librt.so.1",
    "libgcc_s.so.1",
    "ld-linux-x86-64.so.2",
    "ld-linux-aarch64.so.1",
}


def _metadata_problems(where: str, text: str, project: dict) -> list[str]:
    """What is wrong with one METADATA/PKG-INFO text, against pyproject.toml's [project]."""
    message = email.parser.Parser().parsestr(text)
    problems = []
    expression = message.get("License-Expression")
    if expression != project["license"]:
        problems.append(f"{where}: License-Expression is {expression!r}, not {project['license']!r}")
    if sorted(message.get_all("License-File") or []) != license_files(project):
        problems.append(f"{where}: License-File is {message.get_all('License-File')}, not {license_files(project)}")
    urls = sorted(message.get_all("Project-URL") or [])
    wanted = sorted(f"{label}, {url}" for label, url in project.get("urls", {}).items())
    if urls != wanted:
        problems.append(f"{where}: Project-URL is {urls}, not pyproject.toml's {wanted}")
    return problems


def license_files(project: dict) -> list[str]:
    """The files pyproject.toml's license-files globs match, relative to the repository, sorted."""
    found = {path.relative_to(ROOT).as_posix() for glob in project["license-files"] for path in ROOT.glob(glob)}
    return sorted(found)


def notice_problems(project: dict) -> list[str]:
    """What the repository's notices lack: nanobind's license, a third-party text the notices do not name."""
    files = license_files(project)
    problems = [] if "licenses/nanobind-LICENSE" in files else ["licenses/nanobind-LICENSE is not a license file"]
    notices = (ROOT / "THIRD_PARTY_NOTICES.md").read_text()
    problems += [
        f"THIRD_PARTY_NOTICES.md does not name {name}"
        for name in files
        if name.startswith("licenses/")
        if f"`{name}`" not in notices
    ]
    return problems


def _tag_problems(wheel: pathlib.Path) -> list[str]:
    """The wheel's platform tags that are not manylinux for glibc NEWEST_GLIBC or older."""
    problems = []
    for tag in wheel.stem.split("-")[-1].split("."):
        legacy = {"manylinux2014": (2, 17), "manylinux2010": (2, 12), "manylinux1": (2, 5)}
        match = re.fullmatch(r"manylinux_(\d+)_(\d+)_\w+", tag)
        glibc = (int(match[1]), int(match[2])) if match else legacy.get(tag.split("_")[0])
        if glibc is None or glibc > NEWEST_GLIBC:
            problems.append(f"{wheel.name}: platform tag {tag} is not manylinux_2_27 or older")
    return problems


def default_arches() -> list[str]:
    """The wheels tools/build_release.sh builds on this machine: its own, and aarch64 beside x86_64."""
    machine = platform.machine()
    return [machine, "aarch64"] if machine == "x86_64" else [machine]


def wheel_arch(wheel: pathlib.Path) -> str:
    """The architecture a wheel's platform tags name (the first tag's, e.g. aarch64)."""
    tag = wheel.stem.split("-")[-1].split(".")[0]
    return next((arch for arch in MACHINES if tag.endswith("_" + arch)), tag)


def check(folder: pathlib.Path, arches: list[str] | None = None) -> list[str]:
    """Every problem found with the artifacts in folder (empty if none): one wheel per arch in arches."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    arches = default_arches() if arches is None else arches
    wheels, sdists = sorted(folder.glob("*.whl")), sorted(folder.glob("*.tar.gz"))
    found = {arch: [w.name for w in wheels if wheel_arch(w) == arch] for arch in {*arches, *map(wheel_arch, wheels)}}
    if len(sdists) != 1 or any(len(found[arch]) != 1 for arch in arches) or len(wheels) != len(arches):
        return [
            f"{folder}: expected one sdist and one wheel for each of {arches}, found "
            f"{[p.name for p in sdists]} and {found}"
        ]
    (sdist,) = sdists
    problems = notice_problems(project)
    for wheel in wheels:
        problems += _tag_problems(wheel)
        with zipfile.ZipFile(wheel) as z:
            files = {name: z.read(name) for name in z.namelist()}
        info = next(n.split("/")[0] for n in files if n.split("/")[0].endswith(".dist-info"))
        problems += wheel_problems(wheel.name, files, info, project)
        problems += extension_problems(wheel.name, files)
    with tarfile.open(sdist) as t:
        top = sdist.name.removesuffix(".tar.gz")
        names = set(t.getnames())
        wanted = [f"{top}/{name}" for name in license_files(project)] + [f"{top}/PKG-INFO"]
        files = {name: t.extractfile(name).read() for name in wanted if name in names}
        problems += _archive_problems(sdist.name, files, f"{top}/", f"{top}/PKG-INFO", project)
    return problems


def extension_problems(archive: str, files: dict) -> list[str]:
    """What is wrong with a wheel's compiled extension (files: name -> bytes) for the wheel's tags."""
    python, _abi, platforms = archive.removesuffix(".whl").split("-")[-3:]
    arch = wheel_arch(pathlib.Path(archive))
    suffix = f".cpython-{python.removeprefix('cp')}-{arch}-linux-gnu.so"
    extensions = [name for name in files if re.fullmatch(r"jaxbind/_trampoline\..*\.so", name)]
    if extensions != [f"jaxbind/_trampoline{suffix}"]:
        return [f"{archive}: the extensions are {extensions}, not jaxbind/_trampoline{suffix}"]
    return [f"{archive}: {extensions[0]}: {problem}" for problem in elf_problems(files[extensions[0]], arch)]


def elf_needs(data: bytes) -> tuple[list[tuple[int, int]], list[str]]:
    """The glibc symbol versions (GLIBC_2.x) and the libraries (DT_NEEDED) a 64-bit ELF file needs."""
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]

    def string(section: int, offset: int) -> str:
        start = sections[section][4] + offset
        return data[start : data.index(b"\0", start)].decode()

    glibc, needed = [], []
    for _name, kind, _flags, _addr, offset, size, link, info, _align, _entsize in sections:
        if kind == 0x6FFFFFFE:  # SHT_GNU_verneed: the symbol versions needed, per library
            at = offset
            for _ in range(info):
                _version, count, _file, aux, following = struct.unpack_from("<HHIII", data, at)
                entry = at + aux
                for _ in range(count):
                    _hash, _flags2, _other, name, next_aux = struct.unpack_from("<IHHII", data, entry)
                    match = re.fullmatch(r"GLIBC_(\d+)\.(\d+)(?:\.\d+)?", string(link, name))
                    if match:
                        glibc.append((int(match[1]), int(match[2])))
                    entry += next_aux
                at += following
        elif kind == 6:  # SHT_DYNAMIC: DT_NEEDED entries name the libraries needed
            for at in range(offset, offset + size, 16):
                tag, value = struct.unpack_from("<qQ", data, at)
                if tag == 1:
                    needed.append(string(link, value))
    return glibc, needed


def elf_problems(data: bytes, arch: str) -> list[str]:
    """What makes data not a 64-bit little-endian ELF shared object for arch that runs on glibc 2.27."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return ["not a 64-bit little-endian ELF file"]
    e_type, e_machine = struct.unpack_from("<HH", data, 16)
    problems = [] if e_type == 3 else [f"ELF type {e_type}, not a shared object (3)"]
    if e_machine != MACHINES.get(arch):
        problems.append(f"ELF machine {e_machine}, not {arch}'s ({MACHINES.get(arch)})")
    glibc, needed = elf_needs(data)
    if not glibc:
        problems.append("no glibc symbol versions found (not linked against glibc?)")
    elif max(glibc) > NEWEST_GLIBC:
        problems.append(f"needs glibc {'.'.join(map(str, max(glibc)))}, newer than 2.27")
    problems += [
        f"needs {library}, not in every manylinux policy" for library in needed if library not in ALLOWED_LIBRARIES
    ]
    return problems


def wheel_problems(archive: str, files: dict, info: str, project: dict) -> list[str]:
    """What is wrong with a wheel's license files and metadata (files: name -> bytes; info: its .dist-info)."""
    return _archive_problems(archive, files, f"{info}/licenses/", f"{info}/METADATA", project)


def _archive_problems(archive: str, files: dict, prefix: str, metadata_name: str, project: dict) -> list[str]:
    """What is wrong with one archive's license files (under prefix) and metadata (files: name -> bytes)."""
    problems = []
    for name in license_files(project):
        if prefix + name not in files:
            problems.append(f"{archive}: no {prefix}{name}")
        elif files[prefix + name] != (ROOT / name).read_bytes():
            problems.append(f"{archive}: {prefix}{name} is not the repository's {name}")
    if metadata_name not in files:
        return [*problems, f"{archive}: no {metadata_name}"]
    return problems + _metadata_problems(archive, files[metadata_name].decode(), project)


if __name__ == "__main__":
    arches = [sys.argv[i + 1] for i, arg in enumerate(sys.argv) if arg == "--arch"] or None
    found = check(pathlib.Path(sys.argv[1]), arches)
    for problem in found:
        print("release check:", problem, file=sys.stderr)
    print(
        "release check:",
        "failed" if found else "the tags, the extensions, the licenses, the notices and the URLs are right",
    )
    sys.exit(1 if found else 0)
