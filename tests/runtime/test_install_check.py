"""`import jaxbind` says so when another distribution that installs the package `jaxbind` is installed
beside this one (JAXbind itself, or this project's releases under that name): each child process sees a
folder on its path holding only that distribution's metadata, as pip leaves it."""

import sys

import _subprocesses
import pytest

from jaxbind import _install_check

JAXBIND_SUMMARY = "Bind any function written in another language to JAX with support for JVP/VJP/batching"
OWN_OLD_SUMMARY = "Bind functions JAX cannot see (NumPy, SciPy, C, C++, Fortran) as JAX ops"


def _repair_command():
    """The repair the warning must print: reinstall from what this environment was installed from
    (tests/api/test_install_hints.py checks that against pip's record), not the unpublished name."""
    return f"pip uninstall -y jaxbind jaxbind-ffi && pip install {_install_check._own_install_source()}"


def _import_warnings(tmp_path, metadata):
    """The RuntimeWarnings `import jaxbind` gives with `metadata` installed as a distribution."""
    if metadata is not None:
        name, version, summary = metadata
        info = tmp_path / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: {summary}\n")
    code = (
        "import sys, warnings\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import jaxbind\n"
        "print(jaxbind.get_linear_call.__module__)\n"
        "for w in caught:\n"
        "    if issubclass(w.category, RuntimeWarning):\n"
        "        print('WARNING', w.message, w.filename)\n"
    )
    returncode, out, err = _subprocesses.run(
        [sys.executable, "-c", code], timeout=240, what="import jaxbind", cwd=tmp_path
    )
    assert returncode == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("jaxbind.")  # this project's jaxbind, still imported
    return [line for line in lines if line.startswith("WARNING")]


def test_no_warning_alone(tmp_path):
    assert _import_warnings(tmp_path, None) == []


@pytest.mark.parametrize(
    "metadata, who",
    [
        (("jaxbind", "1.3.1", JAXBIND_SUMMARY), "JAXbind 1.3.1 (the distribution `jaxbind`)"),
        (("jaxbind", "0.1.0", OWN_OLD_SUMMARY), "this project's own earlier release under the name `jaxbind` (0.1.0)"),
    ],
)
def test_warns_when_another_distribution_shares_the_folder(tmp_path, metadata, who):
    (warning,) = _import_warnings(tmp_path, metadata)
    assert who in warning
    assert "`jaxbind-ffi` (running now)" in warning
    assert _repair_command() in warning
    assert warning.endswith("<string>")  # reported at the user's import line, not inside jaxbind


@pytest.mark.parametrize("metadata_file", ["without a Summary or Version", "missing"])
def test_warns_and_imports_when_the_other_distributions_metadata_lacks_fields(tmp_path, metadata_file):
    # A missing field is None on Python 3.11, a DeprecationWarning on 3.12 and 3.13 and a KeyError
    # with importlib_metadata 8; a dist-info folder an uninstall left may hold no metadata file. The
    # child reads metadata the strictest way (a missing field raises) and treats DeprecationWarnings as
    # errors, so that every Python sees what the newest do.
    info = tmp_path / "jaxbind-2.0.dist-info"
    info.mkdir()
    if metadata_file != "missing":
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: jaxbind\n")
    code = (
        "import sys, warnings\n"
        "import importlib.metadata._adapters as adapters\n"
        "def strict(self, item):\n"
        "    value = super(adapters.Message, self).__getitem__(item)\n"
        "    if value is None:\n"
        "        raise KeyError(item)\n"
        "    return value\n"
        "adapters.Message.__getitem__ = strict\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always', RuntimeWarning)\n"
        "    import jaxbind\n"
        "print(jaxbind.get_linear_call.__module__)\n"
        "for w in caught:\n"
        "    print('WARNING', w.message)\n"
    )
    returncode, out, err = _subprocesses.run(
        [sys.executable, "-c", code], timeout=240, what="import jaxbind", cwd=tmp_path
    )
    assert returncode == 0, err
    lines = out.splitlines()
    assert lines[0] == "jaxbind._linear_call"  # this project's jaxbind, imported
    (warning,) = lines[1:]
    assert warning.startswith("WARNING jaxbind: this environment has two distributions")
    assert "JAXbind of an unknown version (the distribution `jaxbind`)" in warning
    assert _repair_command() in warning
