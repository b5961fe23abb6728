"""Checks the release artifacts tools/build_release.sh left in a folder (CI's wheel lane runs it).

    python3 tools/check_release.py dist

- the wheel's platform tags are manylinux for glibc 2.27 (jaxlib's own wheels' floor) or older: it
  installs wherever jaxlib's do;
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
import re
import sys
import tarfile
import tomllib
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
NEWEST_GLIBC = (2, 27)


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


def check(folder: pathlib.Path) -> list[str]:
    """Every problem found with the artifacts in folder (empty if none)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wheels, sdists = sorted(folder.glob("*.whl")), sorted(folder.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        return [f"{folder}: expected one wheel and one sdist, found {[p.name for p in wheels + sdists]}"]
    (wheel,), (sdist,) = wheels, sdists
    problems = _tag_problems(wheel) + notice_problems(project)
    with zipfile.ZipFile(wheel) as z:
        info = next(n.split("/")[0] for n in z.namelist() if n.split("/")[0].endswith(".dist-info"))
        problems += wheel_problems(wheel.name, {name: z.read(name) for name in z.namelist()}, info, project)
    with tarfile.open(sdist) as t:
        top = sdist.name.removesuffix(".tar.gz")
        names = set(t.getnames())
        wanted = [f"{top}/{name}" for name in license_files(project)] + [f"{top}/PKG-INFO"]
        files = {name: t.extractfile(name).read() for name in wanted if name in names}
        problems += _archive_problems(sdist.name, files, f"{top}/", f"{top}/PKG-INFO", project)
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
    found = check(pathlib.Path(sys.argv[1]))
    for problem in found:
        print("release check:", problem, file=sys.stderr)
    print("release check:", "failed" if found else "the tag, the licenses, the notices and the URLs are right")
    sys.exit(1 if found else 0)
