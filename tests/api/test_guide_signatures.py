"""The signatures the guides give in their headings are the functions' own (issue 40, item 9).

A guide that is the reference of a function heads its section with the call, ``## `jaxbind.name(...)` ``.
Each such heading in the docs is parsed and compared with ``inspect.signature`` of the function: the same
parameters in the same order, the same ``/`` and ``*`` markers and the same defaults (as Python literals).
A parameter may be written as the tuple it takes (``(f_jvp, f_vjp)`` for ``f_derivative``); a heading may
also give the return annotation. A parameter added to a function and not to its heading fails here.
"""

import ast
import inspect
import pathlib
import re

import pytest

import jaxbind

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
HEADING = re.compile(r"^#+ `jaxbind\.(\w+)\((.*)\)(?: -> (\w+))?`\s*$")
# Parameters a heading writes as the tuple they take.
WRITTEN_AS = {("get_nonlinear_call", "(f_jvp, f_vjp)"): "f_derivative"}


def headings():
    """(page, line number, function name, its parameter text, its return text) of every signature heading."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            match = HEADING.match(line)
            if match:
                found.append((f"{page.relative_to(DOCS)}:{number}", *match.groups()))
    return found


def split_top_level(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    return [part for part in parts + [current.strip()] if part]


def as_written(name: str, function) -> list[str]:
    """The parameters of ``function`` as a heading writes them (``/``, ``*``, ``x=default``, ``**kwargs``)."""
    written, seen_positional_only, seen_star = [], False, False
    parameters = list(inspect.signature(function).parameters.values())
    for parameter in parameters:
        if seen_positional_only and parameter.kind is not parameter.POSITIONAL_ONLY:
            written.append("/")
            seen_positional_only = False
        if parameter.kind is parameter.POSITIONAL_ONLY:
            seen_positional_only = True
        if parameter.kind is parameter.KEYWORD_ONLY and not seen_star:
            written.append("*")
            seen_star = True
        if parameter.kind is parameter.VAR_POSITIONAL:
            seen_star = True
            written.append(f"*{parameter.name}")
        elif parameter.kind is parameter.VAR_KEYWORD:
            written.append(f"**{parameter.name}")
        elif parameter.default is parameter.empty:
            written.append(parameter.name)
        else:
            written.append(f"{parameter.name}={parameter.default!r}")
    if seen_positional_only:
        written.append("/")
    return written


def normalized(name: str, text: str) -> list[str]:
    """The heading's parameters, tuples replaced by the parameter they stand for, defaults as their repr."""
    result = []
    for part in split_top_level(text):
        part = WRITTEN_AS.get((name, part), part)
        if "=" in part:
            parameter, default = part.split("=", 1)
            part = f"{parameter.strip()}={ast.literal_eval(default.strip())!r}"
        result.append(part)
    return result


def signature_problems(name: str, text: str, returns: str | None) -> list[str]:
    """What differs between a heading ``jaxbind.name(text) -> returns`` and the function."""
    function = getattr(jaxbind, name, None)
    if function is None:
        return [f"jaxbind has no {name}"]
    problems = []
    heading, real = normalized(name, text), as_written(name, function)
    if heading != real:
        missing = [p for p in real if p not in heading]
        extra = [p for p in heading if p not in real]
        problems.append(f"gives ({', '.join(heading)}), the function is ({', '.join(real)})")
        problems += [f"missing {missing}"] * bool(missing) + [f"not in the function: {extra}"] * bool(extra)
    annotation = inspect.signature(function).return_annotation
    if returns is not None and returns != getattr(annotation, "__name__", annotation):
        problems.append(f"returns {returns}, the function's annotation is {annotation}")
    return problems


PAGES = headings()


def test_the_guides_give_signatures():
    assert {"get_linear_call", "get_nonlinear_call"} <= {name for _, name, _, _ in PAGES}


@pytest.mark.parametrize("where, name, text, returns", PAGES, ids=lambda v: str(v)[:40])
def test_a_heading_gives_the_functions_signature(where, name, text, returns):
    problems = signature_problems(name, text, returns)
    assert not problems, f"{where}: `jaxbind.{name}(...)`: " + "; ".join(problems)


@pytest.mark.parametrize(
    "name, text, problem",
    [
        (  # the linear guide's heading before issue 40
            "get_linear_call",
            "f, f_T, /, abstract, abstract_T, *, first_n_args_fixed=0, func_can_batch=False, name=None, "
            'vmap_method="sequential"',
            "missing ['thread_safe=False', 'inplace=None', 'setup=None', 'setup_cache=None', 'effect=None']",
        ),
        ("load_kwargs", "kwargs_dump, strict=True", "not in the function: ['strict=True']"),
        ("load_kwargs", "dump", "gives (dump), the function is (kwargs_dump)"),
        ("export", "fun, *, **kwargs", "gives (fun, *, **kwargs)"),
    ],
)
def test_the_check_catches_a_heading_that_drifted(name, text, problem):
    assert problem in "; ".join(signature_problems(name, text, None))
