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
        f"{DISTRIBUTION}: pip uninstall -y {OTHER} {DISTRIBUTION} && pip install {DISTRIBUTION}"
    )


def warn_if_shared():
    message = shared_folder_message()
    if message is not None:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
