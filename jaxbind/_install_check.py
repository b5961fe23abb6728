"""At import: is another distribution installed that writes the same package folder, ``jaxbind/``?

This project is the distribution ``jaxbind-ffi``. PyPI's ``jaxbind`` is JAXbind, whose API this one keeps
and which installs a package of the same name; so did this project's own releases before it took its
name (``jaxbind`` 0.1.0). pip keeps no owner per file: with both installed, the files installed last
replace the other's, and uninstalling either deletes files the other listed (``jaxbind/__init__.py``
among them), which leaves a ``jaxbind`` that imports as an empty namespace package. When this file runs,
this project's ``__init__`` is the one in the folder; the other's metadata still being there is the sign.
"""

import importlib.metadata
import warnings

DISTRIBUTION = "jaxbind-ffi"
OTHER = "jaxbind"
# The summary this project's releases as `jaxbind` carried (pyproject.toml's description, unchanged).
OWN_SUMMARY = "Bind functions JAX cannot see"


def _other():
    """The other distribution's metadata, or None."""
    try:
        return importlib.metadata.distribution(OTHER)
    except importlib.metadata.PackageNotFoundError:
        return None


def _field(other, name: str) -> str:
    """A field of the other distribution's metadata, or "" where it has none.

    Whatever the metadata lacks must not stop the import: a missing field is None
    on Python 3.11, a DeprecationWarning on 3.12 and 3.13 and a KeyError with
    importlib_metadata 8, and a dist-info folder an uninstall left may have no
    metadata file at all (None, or an empty message).
    """
    try:
        metadata = other.metadata
        value = metadata.get(name) if metadata is not None else None
    except Exception:
        return ""
    return str(value) if value is not None else ""


def install_source(direct_url: str | None) -> str:
    """What `pip install` needs to install this project again the way it was installed.

    Parameters
    ----------
    direct_url : str or None
        The text of this distribution's ``direct_url.json`` (PEP 610), which pip writes when it installs
        from a file, a folder or a URL rather than from an index; None where there is none.

    Returns
    -------
    str
        The arguments for ``pip install``: the wheel file or source folder it came from (``-e`` before a
        folder installed in editable mode), its URL (a repository's at the commit installed), or the
        distribution's name where it came from an index. The name is not published on PyPI yet, so a
        command naming it would fail for anyone who installed from a built wheel or a checkout; the file
        or folder does not.
    """
    # Imported here: only a warning needs them, and every `import jaxbind` runs this module.
    import json
    import os
    import shlex
    import urllib.parse

    try:
        record = json.loads(direct_url) if direct_url else None
        url = record["url"] if isinstance(record, dict) else None
    except (ValueError, KeyError, TypeError):
        url = None
    if not isinstance(url, str) or not url:
        return DISTRIBUTION
    vcs = record.get("vcs_info")
    if isinstance(vcs, dict) and vcs.get("vcs") and vcs.get("commit_id"):  # pip's form: git+URL@commit
        return shlex.quote(f"{vcs['vcs']}+{url}@{vcs['commit_id']}")
    if urllib.parse.urlsplit(url).scheme != "file":
        return shlex.quote(url)
    path = urllib.parse.unquote(urllib.parse.urlsplit(url).path)
    if not os.path.exists(path):
        return (
            f"<the wheel built by tools/build_release.sh, or the source checkout> (it was installed from "
            f"{path}, which is gone)"
        )
    editable = isinstance(record.get("dir_info"), dict) and record["dir_info"].get("editable") is True
    return ("-e " if editable else "") + shlex.quote(path)


def _own_install_source() -> str:
    """install_source for this distribution as it is installed now."""
    try:
        direct_url = importlib.metadata.distribution(DISTRIBUTION).read_text("direct_url.json")
    except Exception:
        direct_url = None
    return install_source(direct_url)


def shared_folder_message():
    """The warning's text if another distribution shares the package folder, else None."""
    other = _other()
    if other is None:
        return None
    version = _field(other, "Version") or "of an unknown version"
    if _field(other, "Summary").startswith(OWN_SUMMARY):
        who = f"this project's own earlier release under the name `{OTHER}` ({version})"
    else:
        who = f"JAXbind {version} (the distribution `{OTHER}`)"
    return (
        f"jaxbind: this environment has two distributions that install the package `jaxbind`: "
        f"`{DISTRIBUTION}` (running now) and {who}. They share one folder: the files installed last "
        f"replaced the other's, and `pip uninstall` of either deletes files the other needs. To keep "
        f"{DISTRIBUTION}: pip uninstall -y {OTHER} {DISTRIBUTION} && pip install {_own_install_source()}"
    )


def warn_if_shared():
    message = shared_folder_message()
    if message is not None:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
