"""Every page's examples run as one script in an empty folder, with nothing predefined.

Run:  python docs/check_pages.py [PAGE.md ...] [--jobs N] [--timeout S] [--keep]
(from any directory; CI does). For each page of the site (``docs/**/*.md`` outside ``_build``), or the
pages given, this takes the Python blocks the doctest builder runs, in page order (```` ```{testsetup} ````,
```` ```{testcode} ```` and ```` ```{testcleanup} ```` as they are, the ``>>>``/``...`` source lines of
```` ```{doctest} ````; plain ```` ```python ```` fences are illustrations and stay out), writes them as one
script into a fresh empty temporary folder with the files the page links with ``{download}`` beside it
(under their own names: the convention the pages state), and runs it there with this Python, as a reader
who copied the page would. It prints one line per page and, for a failure, the last lines of the error
with the script's line numbers turned into the page's; it exits non-zero if any page fails. Pages with
no Python examples are skipped. What the examples print is the doctest builder's business, not this
script's.
"""

import argparse
import concurrent.futures
import doctest
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

DOCS = os.path.dirname(os.path.abspath(__file__))
RUN = {"testsetup", "testcode", "testcleanup", "doctest"}
# Directives whose content is not Markdown: nothing inside them is a page's block.
RAW = {
    "testoutput",
    "eval-rst",
    "literalinclude",
    "code-block",
    "code",
    "sourcecode",
    "math",
    "toctree",
    "raw",
    "csv-table",
}
FENCE = re.compile(r"^(\s*)(`{3,}|:{3,})\s*(?:\{([\w:-]+)\})?(.*)$")
DOWNLOAD = re.compile(r"\{download\}`(?:[^`<]*<([^`>]+)>|([^`<]+))`")
RST_TEST = re.compile(r"^\s*\.\. (testsetup|testcode|testcleanup|doctest)::", re.M)
TAIL = 15  # lines of a failure's output to show


def pages():
    found = []
    for folder, dirs, files in os.walk(DOCS):
        dirs[:] = sorted(d for d in dirs if d != "_build")
        found += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".md")]
    return found


def _strip_options(body):
    """A directive's body without its ``:key: value`` lines or ``---`` YAML block."""
    if body and body[0].strip() == "---":
        end = next(i for i in range(1, len(body)) if body[i].strip() == "---")
        return body[end + 1 :]
    i = 0
    while i < len(body) and re.match(r"^\s*:[\w-]+:", body[i]):
        i += 1
    return body[i:]


def parse(path):
    """The page's Python blocks, as (first line of code, kind, code), and its downloads' targets."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks, stack = [], []  # stack: the open fences, (char, length, raw, directive)
    current = None  # (kind, line of the fence, body lines) of a block being collected
    for n, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if stack:
            char, length, raw, directive = stack[-1]
            if m and m.group(2)[0] == char and len(m.group(2)) >= length and not m.group(3) and not m.group(4).strip():
                stack.pop()
                if current is not None:
                    kind, start, body = current
                    options = len(body)
                    body = _strip_options(body)
                    first = start + 1 + options - len(body)
                    text = textwrap.dedent("\n".join(body)) + "\n"  # a block in a list is indented
                    if kind == "doctest":
                        text = "".join(e.source for e in doctest.DocTestParser().get_examples(text))
                    blocks.append((first, kind, text))
                    current = None
                continue
            if current is not None:
                current[2].append(line)
                continue
            if raw:
                if directive == "eval-rst" and RST_TEST.match(line):
                    raise ValueError(f"{path}:{n}: a reST test directive, which this script does not run")
                continue
        if m:
            name = m.group(3)
            raw = name is None or name in RAW
            stack.append((m.group(2)[0], len(m.group(2)), raw, name))
            if name in RUN:
                current = (name, n, [])
    if stack:
        raise ValueError(f"{path}: a fence opened and never closed")
    downloads = [a or b for a, b in DOWNLOAD.findall("\n".join(lines))]
    return blocks, [d.strip() for d in downloads]


def script(path):
    """The page's script and the map from its lines to the page's: [(script line, page line)]."""
    blocks, downloads = parse(path)
    parts, spans, at = [], [], 1
    for first, _kind, text in blocks:
        parts.append(text)
        spans.append((at, first))
        at += text.count("\n")
    return "".join(parts), spans, downloads


def page_line(spans, n):
    start, first = max((s for s in spans if s[0] <= n), default=(1, 1))
    return first + n - start


def check(path, timeout, keep):
    name = os.path.relpath(path, DOCS) if path.startswith(DOCS + os.sep) else path
    try:
        code, spans, downloads = script(path)
    except (ValueError, OSError) as err:
        return name, False, 0.0, str(err)
    if not code.strip():
        return name, None, 0.0, ""
    folder = tempfile.mkdtemp(prefix="jaxbind-page-")
    try:
        for target in downloads:
            source = os.path.normpath(os.path.join(os.path.dirname(path), target))
            dest = os.path.join(folder, os.path.basename(target))
            if os.path.exists(dest):
                return name, False, 0.0, f"two downloads named {os.path.basename(target)}"
            shutil.copy(source, dest)
        with open(os.path.join(folder, "page.py"), "w", encoding="utf-8") as f:
            f.write(code)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
        start = time.perf_counter()
        try:
            run = subprocess.run(
                [sys.executable, "page.py"],
                cwd=folder,
                env=env,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
            )
        except subprocess.TimeoutExpired:
            return name, False, time.perf_counter() - start, f"no result after {timeout} s"
        seconds = time.perf_counter() - start
        if run.returncode == 0:
            return name, True, seconds, ""
        tail = "\n".join((run.stdout + run.stderr).rstrip().splitlines()[-TAIL:])
        tail = re.sub(
            r'File "[^"]*page\.py", line (\d+)',
            lambda m: f'File "{name}", line {page_line(spans, int(m.group(1)))}',
            tail,
        )
        return name, False, seconds, tail + f"\n(exit status {run.returncode})"
    finally:
        if keep:
            print(f"  {name}: kept {folder}", flush=True)
        else:
            shutil.rmtree(folder, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", help="pages to check (default: every page of docs/)")
    parser.add_argument("--jobs", type=int, default=2, help="pages run at once (default 2)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per page (default 600)")
    parser.add_argument("--keep", action="store_true", help="keep each page's folder, to look at")
    args = parser.parse_args()
    paths = [os.path.abspath(p) for p in args.pages] or pages()
    start = time.perf_counter()
    failed, skipped, passed = [], [], 0
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = [pool.submit(check, p, args.timeout, args.keep) for p in paths]
        for future in concurrent.futures.as_completed(futures):
            name, ok, seconds, tail = future.result()
            if ok is None:
                skipped.append(name)
                continue
            print(f"{'pass' if ok else 'FAIL'}  {name}  ({seconds:.1f} s)", flush=True)
            if ok:
                passed += 1
            else:
                failed.append(name)
                print("      " + tail.replace("\n", "\n      "), flush=True)
    print(
        f"pages: {passed} passed, {len(failed)} failed, {len(skipped)} without Python examples; "
        f"{time.perf_counter() - start:.1f} s"
    )
    if failed:
        sys.exit("failed: " + ", ".join(sorted(failed)))


if __name__ == "__main__":
    main()
