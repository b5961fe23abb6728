"""Install hints that work today: the name `jaxbind-ffi` is not published on PyPI yet, so a repair
command or an install hint naming it fails ("No matching distribution"). The import warning's repair
command names what this environment was installed from (the wheel file or the source checkout, as pip
recorded it in direct_url.json), and no hint in the package or the guides installs the bare name."""

import importlib.metadata
import json
import os
import pathlib
import re
import shlex

import pytest

import jaxbind
from jaxbind import _install_check

DOCS_GUIDES = pathlib.Path(__file__).resolve().parent.parent.parent / "docs" / "guides"


def _direct_url(url, **extra):
    return json.dumps({"url": url, **extra})


def test_repair_command_installs_what_this_environment_was_installed_from():
    # The reference: pip's own record of where this distribution came from, read here without the
    # package's code; the command's target must be that wheel or checkout, and be there.
    distribution = importlib.metadata.distribution("jaxbind-ffi")
    record = json.loads(distribution.read_text("direct_url.json") or "null")
    source = _install_check._own_install_source()
    if record is None:  # installed from an index, where the name resolves
        assert source == "jaxbind-ffi"
        return
    words = shlex.split(source)
    target = pathlib.Path(words[-1])
    assert target.as_uri() == record["url"]
    assert words[:-1] == (["-e"] if record.get("dir_info", {}).get("editable") else [])
    if target.is_dir():  # a source checkout of this project
        assert re.search(r'^name = "jaxbind-ffi"$', (target / "pyproject.toml").read_text(), re.MULTILINE)
    else:  # the wheel, of the version installed
        assert target.is_file() and target.name.startswith(f"jaxbind_ffi-{distribution.version}-")
        assert target.suffix == ".whl"


def test_repair_command_for_a_wheel_file(tmp_path):
    wheel = tmp_path / "a folder" / "jaxbind_ffi-0.2.0-cp311-cp311-manylinux_2_27_x86_64.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"")
    source = _install_check.install_source(_direct_url(wheel.as_uri(), archive_info={}))
    assert shlex.split(source) == [str(wheel)]  # quoted: the space stays inside the one argument


@pytest.mark.parametrize("editable", [True, False])
def test_repair_command_for_a_source_checkout(tmp_path, editable):
    source = _install_check.install_source(_direct_url(tmp_path.as_uri(), dir_info={"editable": editable}))
    assert shlex.split(source) == (["-e"] if editable else []) + [str(tmp_path)]


def test_repair_command_for_a_url_a_repository_and_an_index():
    url = "https://example.invalid/jaxbind_ffi-0.2.0-cp311-cp311-manylinux_2_27_x86_64.whl"
    assert _install_check.install_source(_direct_url(url, archive_info={})) == url
    repository = _direct_url("https://example.invalid/jaxbind.git", vcs_info={"vcs": "git", "commit_id": "abc123"})
    assert _install_check.install_source(repository) == "git+https://example.invalid/jaxbind.git@abc123"
    # No record (pip writes none for an index install), or one pip could not have written.
    for direct_url in (None, "", "not json", "[]", json.dumps({"dir_info": {}})):
        assert _install_check.install_source(direct_url) == "jaxbind-ffi"


def test_repair_command_when_the_wheel_is_gone(tmp_path):
    gone = tmp_path / "jaxbind_ffi-0.2.0-cp311-cp311-manylinux_2_27_x86_64.whl"
    source = _install_check.install_source(_direct_url(gone.as_uri(), archive_info={}))
    assert "tools/build_release.sh" in source and "source checkout" in source and str(gone) in source


def _install_commands(text):
    """The `pip install ...` commands in a text (a line break read as a space, as Markdown reads it),
    each up to a backquote, a double quote, `&&`, `;` or a parenthesis."""
    return [m.group(0) for m in re.finditer(r"pip install[^`\"&;()]*", text.replace("\n", " "))]


def _names_the_unpublished_distribution(command):
    return any(re.fullmatch(r"'?jaxbind-ffi(\[[a-z0-9,]+\])?'?", word) for word in command.split()[2:])


def test_no_hint_installs_the_unpublished_name():
    texts = {path: path.read_text() for path in pathlib.Path(jaxbind.__file__).parent.rglob("*.py")}
    guides = sorted(DOCS_GUIDES.glob("*.md"))
    assert len(guides) > 10, f"the guides were not found in {DOCS_GUIDES}"
    texts.update({path: path.read_text() for path in guides})
    # The check itself: it finds the commands the issue named.
    assert _names_the_unpublished_distribution("pip install jaxbind-ffi")
    assert _names_the_unpublished_distribution("pip install 'jaxbind-ffi[ducc0]'")
    assert not _names_the_unpublished_distribution("pip install dist/jaxbind_ffi-0.2.0-cp311.whl")
    found = [
        f"{os.path.relpath(path)}: {command}"
        for path, text in texts.items()
        for command in _install_commands(text)
        if _names_the_unpublished_distribution(command)
    ]
    assert found == []
