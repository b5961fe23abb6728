"""The package's layout: no import circle between its modules, and the reader of untrusted programs
uses only the public names of the modules it imports (issue 43, items 1 and 2)."""

import ast
import pathlib

import pytest

import jaxbind

# The package under test, where it is imported from (the source tree, or an installed wheel: the wheel
# lane runs the tests from a copy outside the repository).
PACKAGE = pathlib.Path(jaxbind.__file__).resolve().parent
COMPILED = "jaxbind._trampoline"  # the compiled module: imports nothing of the package


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: pathlib.Path, known: set) -> set:
    """The package's modules ``name`` imports, anywhere in it (a late import inside a function counts)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            found.add(origin)
            found |= {f"{origin}.{alias.name}" for alias in node.names}
    return {m for m in found if m in known and m != name and m != COMPILED}


def _circle(graph: dict) -> list | None:
    """One import circle of ``graph`` (module -> modules it imports), or None. The package's face
    (``jaxbind/__init__.py``, which only hands names on) is left out: every module importing the package
    for its compiled module would otherwise close a circle through it."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_package_has_no_import_circle():
    modules = _modules()
    assert "jaxbind._programs" in modules and len(modules) > 30, sorted(modules)  # (the package was found)
    known = set(modules) - {"jaxbind"}
    graph = {n: _imports(n, p, known) for n, p in modules.items() if n != "jaxbind"}
    circle = _circle(graph)
    assert circle is None, "an import circle: " + " -> ".join(circle)


def test_the_circle_finder_finds_a_circle():
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.mark.parametrize("reader", ["_programs"])
def test_the_program_reader_uses_no_private_name_of_another_module(reader):
    tree = ast.parse((PACKAGE / f"{reader}.py").read_text())
    imported_modules, private = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module is None:  # from . import _sites: a module by name
                imported_modules |= {alias.asname or alias.name for alias in node.names}
            else:
                private += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in imported_modules - {"_trampoline"}
            and node.attr.startswith("_")
        ):
            private.append(f"{node.value.id}.{node.attr}")
    assert not private, f"{reader}.py uses private names of other modules: {sorted(set(private))}"
