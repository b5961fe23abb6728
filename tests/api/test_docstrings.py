"""Docstrings of the public API: every public name has a complete NumPy-style docstring.

The public names are those in ``__all__`` of ``jaxbind``, ``jaxbind.testing``
and ``jaxbind.contrib.jaxducc0``, with the public methods and properties of
the public classes. For each this checks, from the object itself (its
signature and its source):

- there is a docstring, beginning with a one-line summary, and every section
  it underlines is a standard numpydoc section, underlined to its length;
- ``Parameters`` names every parameter of the signature (``*args`` and
  ``**kwargs`` as such; underscore-prefixed ones are internal) and nothing
  else;
- a function that returns a value has ``Returns`` (``Yields`` for a
  generator);
- a function whose body raises has ``Raises``, listing every built-in or
  jaxbind exception type it raises by name, and every entry there is an
  exception type;
- ops (``jaxbind.Op`` instances, whose Python signature is ``(*args,
  **kwargs)``) begin with a signature line ``name(...)`` giving the call, and
  document every parameter of it, their ``Returns`` and their ``Raises``.

These are the docstrings the API reference is built from (autodoc with
napoleon, NumPy style).
"""

import ast
import builtins
import importlib
import inspect
import re
import textwrap

import pytest

import jaxbind
import jaxbind.testing

SECTIONS = {
    "Parameters",
    "Other Parameters",
    "Returns",
    "Yields",
    "Receives",
    "Raises",
    "Warns",
    "Warnings",
    "See Also",
    "Notes",
    "References",
    "Examples",
    "Attributes",
    "Methods",
}

# Functions that raise through helpers they call (argument checks, ``int()``,
# pickle, ...) rather than with a ``raise`` statement of their own.
RAISES_THROUGH_HELPERS = {
    "jaxbind.load_kwargs",
    "jaxbind.export",
    "jaxbind.NativeKernel",
    "jaxbind.contrib.jaxducc0.nalm",
    "jaxbind.contrib.jaxducc0.alm2realalm",
    "jaxbind.contrib.jaxducc0.realalm2alm",
}


def _public(module):
    return [(module.__name__, name) for name in module.__all__]


def _modules():
    """``(module name, public name)`` for every public name; jaxducc0's need ducc0."""
    names = _public(jaxbind) + _public(jaxbind.testing)
    try:
        import jaxbind.contrib.jaxducc0 as jaxducc0
    except ImportError:  # (the test extra installs ducc0)
        names.append(("jaxbind.contrib.jaxducc0", None))
    else:
        names += _public(jaxducc0)
    return names


PUBLIC = _modules()


# ---------------------------------------------------------------------------
# Reading a numpydoc docstring
# ---------------------------------------------------------------------------


def sections(doc: str) -> dict:
    """Section title -> its lines (dedented); ``""`` holds what precedes the first section.

    Raises AssertionError for an underlined title that is not a standard
    section or whose underline does not match its length.
    """
    lines = inspect.cleandoc(doc).splitlines()
    found, title, body = {}, "", []
    i = 0
    while i < len(lines):
        line = lines[i]
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if line.strip() and re.fullmatch(r"-{3,}", nxt.strip()) and not line.startswith(" "):
            assert line.strip() in SECTIONS, f"{line.strip()!r} is not a numpydoc section"
            assert len(nxt.strip()) == len(line.strip()), f"the underline of {line.strip()!r} is not its length"
            assert line.strip() not in found, f"section {line.strip()!r} appears twice"
            found[title] = body
            title, body = line.strip(), []
            i += 2
            continue
        body.append(line)
        i += 1
    found[title] = body
    return found


def entries(lines) -> list:
    """The entries of a Parameters-like section: ``(names, type)`` of each unindented line."""
    result = []
    for line in lines:
        if not line.strip() or line.startswith(" "):
            continue
        head, _, kind = line.partition(" : ")
        result.append(([n.strip() for n in head.split(",") if n.strip()], kind.strip()))
    return result


def documented_parameters(doc: str) -> list:
    parts = sections(doc)
    names = []
    for title in ("Parameters", "Other Parameters"):
        for group, _ in entries(parts.get(title, [])):
            names += group
    return names


def resolve_exception(name: str, namespace: dict):
    """The exception class a Raises entry names (``TypeError``, ``jax.errors.JaxRuntimeError``, ...)."""
    if hasattr(builtins, name):
        return getattr(builtins, name)
    if name in namespace:
        return namespace[name]
    if hasattr(jaxbind, name):
        return getattr(jaxbind, name)
    module, _, attr = name.rpartition(".")
    while module:
        try:
            value = importlib.import_module(module)
        except ImportError:
            module, _, head = module.rpartition(".")
            attr = f"{head}.{attr}"
            continue
        for part in attr.split("."):
            value = getattr(value, part)
        return value
    raise AssertionError(f"Raises names {name!r}, which is not an exception type")


def documented_raises(doc: str, namespace: dict) -> list:
    types = []
    for line in sections(doc).get("Raises", []):
        if line.strip() and not line.startswith(" "):
            for name in line.split(","):
                kind = resolve_exception(name.strip(), namespace)
                assert isinstance(kind, type) and issubclass(kind, BaseException), (
                    f"Raises names {name.strip()!r}, which is not an exception type"
                )
                types.append(kind)
    return types


# ---------------------------------------------------------------------------
# What a function does, from its source
# ---------------------------------------------------------------------------


def _function_node(fn):
    source = textwrap.dedent(inspect.getsource(fn))
    tree = ast.parse(source)
    node = tree.body[0]
    while isinstance(node, ast.ClassDef):  # (not expected; getsource of a function)
        node = node.body[0]
    return node


def _own_nodes(node):
    """The nodes of a function's body, not those of functions or classes defined in it."""
    stack = list(node.body)
    while stack:
        child = stack.pop()
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield child
        stack.extend(ast.iter_child_nodes(child))


def behaviour(fn):
    """``(returns a value, yields, exception types raised by name, raises at all)`` of a function."""
    node = _function_node(fn)
    returns = yields = raises = False
    raised = set()
    for child in _own_nodes(node):
        if (
            isinstance(child, ast.Return)
            and child.value is not None
            and not (isinstance(child.value, ast.Constant) and child.value.value is None)
        ):
            returns = True
        elif isinstance(child, (ast.Yield, ast.YieldFrom)):
            yields = True
        elif isinstance(child, ast.Raise) and child.exc is not None:
            raises = True
            target = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
            if isinstance(target, ast.Name):
                value = fn.__globals__.get(target.id, getattr(builtins, target.id, None))
                if isinstance(value, type) and issubclass(value, BaseException):
                    raised.add(value)
    return returns, yields, raised, raises


# ---------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------


def check_summary(doc, where):
    assert doc and doc.strip(), f"{where} has no docstring"
    first = inspect.cleandoc(doc).splitlines()[0]
    assert first.strip(), f"{where}: the docstring does not begin with a summary line"
    sections(doc)  # section titles and underlines


def check_parameters(doc, params, where, check_extra=True):
    """``params``: the signature's parameter names (``*args``, ``**kwargs`` spelled so)."""
    documented = documented_parameters(doc)
    missing = [p for p in params if p not in documented]
    assert not missing, f"{where}: Parameters does not document {missing} (documents {documented})"
    if check_extra:
        extra = [p for p in documented if p not in params]
        assert not extra, f"{where}: Parameters documents {extra}, which the signature does not have"


def signature_names(signature: inspect.Signature, skip_first=False) -> list:
    names = []
    for i, p in enumerate(signature.parameters.values()):
        if (skip_first and i == 0) or p.name.startswith("_"):
            continue
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        names.append(prefix + p.name)
    return names


def check_function(fn, where, *, method=False, extra_raises=False):
    doc = inspect.getdoc(fn) if not method else fn.__doc__
    check_summary(doc, where)
    parts = sections(doc)
    params = signature_names(inspect.signature(fn), skip_first=method)
    check_parameters(doc, params, where)
    if params:
        assert "Parameters" in parts, f"{where} takes parameters but has no Parameters section"
    returns, yields, raised, raises = behaviour(fn)
    if returns or (inspect.signature(fn).return_annotation not in (inspect.Signature.empty, None, "None")):
        assert "Returns" in parts, f"{where} returns a value but has no Returns section"
    if yields:
        assert "Yields" in parts, f"{where} is a generator but has no Yields section"
    if raises or extra_raises:
        assert "Raises" in parts, f"{where} raises but has no Raises section"
    documented = documented_raises(doc, fn.__globals__)
    for kind in raised:
        assert any(issubclass(kind, d) for d in documented), (
            f"{where} raises {kind.__name__}, which its Raises section does not list"
        )


def check_class(cls, where):
    doc = cls.__doc__
    check_summary(doc, where)
    parts = sections(doc)
    try:
        signature = inspect.signature(cls)
    except ValueError:  # a class with a built-in constructor (an exception type)
        signature = None
    if signature is not None:
        params = signature_names(signature)
        check_parameters(doc, params, where)
        if params:
            assert "Parameters" in parts, f"{where} takes parameters but has no Parameters section"
    if issubclass(cls, BaseException):
        assert re.search(r"\braise[sd]?\b", doc), f"{where}: an exception's docstring must say when it is raised"
        documented = documented_parameters(doc)
        assert documented in ([], ["*args"]), f"{where} documents {documented}; its constructor takes *args"
    for constructor in ("__init__", "__new__"):
        fn = vars(cls).get(constructor)
        if inspect.isfunction(fn) and not fn.__code__.co_filename.startswith("<"):  # (not a dataclass's)
            _, _, raised, raises = behaviour(fn)
            if raises or where in RAISES_THROUGH_HELPERS:
                assert "Raises" in parts, f"{where}: its constructor raises but it has no Raises section"
    attributes = [n for group, _ in entries(parts.get("Attributes", [])) for n in group]
    for slot in vars(cls).get("__slots__", ()):
        if not slot.startswith("_"):
            assert slot in attributes, f"{where}: the public attribute {slot!r} is not in its Attributes section"
    for name, member in vars(cls).items():
        if name.startswith("_") and name != "__call__":
            continue
        if isinstance(member, property):
            check_summary(member.fget.__doc__, f"{where}.{name}")
        elif isinstance(member, staticmethod):
            check_function(member.__func__, f"{where}.{name}")
        elif isinstance(member, classmethod):
            check_function(member.__func__, f"{where}.{name}", method=True)
        elif inspect.isfunction(member):
            check_function(member, f"{where}.{name}", method=True, extra_raises=name == "__call__")


def check_op_object(op, where):
    """An op: its own docstring, opened by the call's signature line ``name(...)``."""
    doc = op.__doc__
    assert doc and doc != type(op).__doc__, f"{where} is an op without a docstring of its own"
    lines = inspect.cleandoc(doc).splitlines()
    name = where.rpartition(".")[2]
    assert re.fullmatch(rf"{re.escape(name)}\(.*\)", lines[0].strip()), (
        f"{where}: an op's docstring begins with its call's signature, {name}(...), got {lines[0]!r}"
    )
    assert len(lines) > 2 and not lines[1].strip() and lines[2].strip(), (
        f"{where}: the signature line is followed by a blank line and the summary"
    )
    sections(doc)
    definition = ast.parse(f"def {lines[0].strip()}: pass").body[0]
    arguments = definition.args
    params = [a.arg for a in arguments.posonlyargs + arguments.args]
    params += [f"*{arguments.vararg.arg}"] if arguments.vararg else []
    params += [a.arg for a in arguments.kwonlyargs]
    params += [f"**{arguments.kwarg.arg}"] if arguments.kwarg else []
    check_parameters(doc, params, where)
    parts = sections(doc)
    assert "Returns" in parts, f"{where}: an op returns the list of its outputs; no Returns section"
    assert "Raises" in parts, f"{where}: no Raises section"
    documented_raises(doc, {})


@pytest.mark.parametrize("module_name, name", PUBLIC, ids=lambda v: str(v))
def test_public_name_is_documented(module_name, name):
    if name is None:
        pytest.skip("jaxbind.contrib.jaxducc0 needs ducc0 (pip install ducc0)")
    module = importlib.import_module(module_name)
    obj = getattr(module, name)
    where = f"{module_name}.{name}"
    if inspect.ismodule(obj):
        check_summary(obj.__doc__, where)
    elif isinstance(obj, jaxbind.Op):
        check_op_object(obj, where)
    elif inspect.isclass(obj):
        check_class(obj, where)
    elif inspect.isfunction(obj):
        check_function(obj, where, extra_raises=where in RAISES_THROUGH_HELPERS)
    else:  # an instance such as jaxbind.config: documented by its class
        check_class(type(obj), where)


@pytest.mark.parametrize("module_name", ["jaxbind", "jaxbind.testing", "jaxbind.contrib.jaxducc0"])
def test_module_is_documented(module_name):
    if module_name == "jaxbind.contrib.jaxducc0":
        pytest.importorskip("ducc0")
    module = importlib.import_module(module_name)
    check_summary(module.__doc__, module_name)
    assert module.__all__, f"{module_name} has no public names"


# ---------------------------------------------------------------------------
# The checks themselves catch what they are for
# ---------------------------------------------------------------------------


def _undocumented(x, y=1):
    return x + y


def _half_documented(x, y=1):
    """Add.

    Parameters
    ----------
    x : int
        A number.

    Returns
    -------
    int
        The sum.
    """
    return x + y


def _raises_undocumented(x):
    """Check.

    Parameters
    ----------
    x : int
        A number.
    """
    if x < 0:
        raise ValueError("negative")


def _bad_section(x):
    """Check.

    Params
    ------
    x : int
        A number.
    """


@pytest.mark.parametrize(
    "fn, message",
    [
        (_undocumented, "has no docstring"),
        (_half_documented, r"does not document \['y'\]"),
        (_raises_undocumented, "raises but has no Raises section"),
        (_bad_section, "is not a numpydoc section"),
    ],
)
def test_checks_fail_on_bad_docstrings(fn, message):
    with pytest.raises(AssertionError, match=message):
        check_function(fn, fn.__name__)
