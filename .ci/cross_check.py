"""Helpers of .ci/cross_build.sh (the macOS and Windows compile-and-link check of the extension).

    cross_check.py def INCLUDE NAME       a .def file of what CPython's headers in INCLUDE declare exported
    cross_check.py check TARGET MINOR DIR  checks the extension built in DIR for TARGET and Python MINOR

The check reads the product with LIEF: its format, machine and kind (a Mach-O bundle or dylib, a PE32+ DLL), its
name (the suffix CPython looks for on that platform), and what it needs from outside: Python's C API
(names CPython's headers declare with PyAPI_FUNC or PyAPI_DATA) and the system's libraries, nothing else.
"""

import pathlib
import re
import sys

# A balanced (...) of PyAPI_FUNC(type) / PyAPI_DATA(type): the type may hold one level of parentheses.
_TYPE = r"\((?:[^()]|\([^()]*\))*\)"


def python_api(include):
    """The functions and the data CPython's headers in `include` declare as exported by libpython."""
    funcs, data = set(), set()
    for header in pathlib.Path(include).rglob("*.h"):
        text = re.sub(r"/\*.*?\*/", " ", header.read_text(errors="replace"), flags=re.S)
        funcs |= set(re.findall(r"\bPyAPI_FUNC" + _TYPE + r"\s*(\w+)\s*\(", text))
        data |= set(re.findall(r"\bPyAPI_DATA" + _TYPE + r"\s*(\w+)\s*[;\[]", text))
    return funcs - data, data


def write_def(include, name):
    funcs, data = python_api(include)
    print(f"LIBRARY {name}.dll\nEXPORTS")
    for symbol in sorted(funcs):
        print(f"  {symbol}")
    for symbol in sorted(data):
        print(f"  {symbol} DATA")


def libsystem_exports():
    """The names macOS's libSystem exports: those of the SDK's stub zig links against (libSystem.tbd)."""
    import ziglang

    tbd = pathlib.Path(ziglang.__file__).parent / "lib" / "libc" / "darwin" / "libSystem.tbd"
    return {name[1:] for name in re.findall(r"(?<![\w/])_[\w$.]+", tbd.read_text())}


# The system's libraries the extension may need. macOS: libSystem (the C library, libm, pthreads,
# the dynamic loader); zig links LLVM's libc++ into the extension. Windows: KERNEL32 and the C runtime
# (the universal CRT's api-ms-win-crt-* forwarders, ucrtbase, or the older msvcrt).
_MACOS_LIBRARIES = re.compile(r"/usr/lib/libSystem\.B\.dylib$")
_WINDOWS_LIBRARIES = re.compile(r"(kernel32|msvcrt|ucrtbase|api-ms-win-crt-[a-z0-9-]+)\.dll$", re.I)


def check(target, minor, build):
    import lief

    nodot = minor.replace(".", "")
    macos = target.endswith("-macos")
    suffix = f".cpython-{nodot}-darwin.so" if macos else f".cp{nodot}-win_amd64.pyd"
    # (a Windows link also writes the debug information, _trampoline.*.pdb, beside it)
    products = sorted(
        p for p in pathlib.Path(build).glob("_trampoline*") if p.suffix in {".so", ".pyd", ".dll", ".dylib"}
    )
    if [p.name for p in products] != ["_trampoline" + suffix]:
        return [f"expected one product named _trampoline{suffix}, found {[p.name for p in products]}"]
    product = products[0]
    include = pathlib.Path(build).parent / "include"
    funcs, data = python_api(include)
    lief.logging.disable()  # (its own log lines, "Can't read value at offset", are not findings of the check)
    binary = lief.parse(str(product))
    problems = []
    if macos:
        if not isinstance(binary, lief.MachO.Binary):
            return [f"{product.name} is not a (thin) Mach-O file"]
        cpu = {"aarch64": lief.MachO.Header.CPU_TYPE.ARM64, "x86_64": lief.MachO.Header.CPU_TYPE.X86_64}
        if binary.header.cpu_type != cpu[target.split("-")[0]]:
            problems.append(f"CPU type {binary.header.cpu_type}, not {target}'s")
        # (zig links a dylib where Apple's linker makes a bundle: CPython's dlopen loads either)
        kind = binary.header.file_type
        if kind not in (lief.MachO.Header.FILE_TYPE.BUNDLE, lief.MachO.Header.FILE_TYPE.DYLIB):
            problems.append(f"file type {kind}, neither a bundle nor a dylib")
        libraries = [lib.name for lib in binary.libraries if lib.command != lief.MachO.LoadCommand.TYPE.ID_DYLIB]
        problems += [f"links {lib}, not a system library" for lib in libraries if not _MACOS_LIBRARIES.match(lib)]
        # Each undefined symbol is found at load time: in libSystem (two-level namespace) or, looked up
        # in the process (-undefined dynamic_lookup: zig's linker then looks up every name so, libSystem's
        # too), in Python's C API or libSystem.
        system_names = libsystem_exports()
        needed = {}
        for symbol in binary.symbols:
            if symbol.category != lief.MachO.Symbol.CATEGORY.UNDEFINED:
                continue
            name = symbol.name[1:] if symbol.name.startswith("_") else symbol.name
            bound = symbol.binding_info if symbol.has_binding_info else None
            library = bound.library.name if bound is not None and bound.library else None  # None: any image
            if library is None and (name in funcs or name in data):
                library = "Python"
            elif library is None and name in system_names:
                library = "/usr/lib/libSystem.B.dylib"
            needed[name] = library
            if library is None:
                problems.append(f"needs {name}, which is neither Python's C API nor libSystem's")
        python = sorted(n for n, lib in needed.items() if lib == "Python")
        system = sorted(n for n, lib in needed.items() if lib not in (None, "Python"))
        print(f"{product.name}: Mach-O {target.split('-')[0]} {str(kind).split('.')[-1].lower()}, links {libraries}")
    else:
        if not isinstance(binary, lief.PE.Binary):
            return [f"{product.name} is not a PE file"]
        if binary.header.machine != lief.PE.Header.MACHINE_TYPES.AMD64:
            problems.append(f"machine {binary.header.machine}, not x86-64")
        if binary.optional_header.magic != lief.PE.PE_TYPE.PE32_PLUS:
            problems.append("not PE32+")
        if not binary.header.has_characteristic(lief.PE.Header.CHARACTERISTICS.DLL):
            problems.append("not a DLL")
        if not any(e.name == "PyInit__trampoline" for e in binary.get_export().entries):
            problems.append("does not export PyInit__trampoline")
        python, system, libraries = [], [], []
        for lib in binary.imports:
            libraries.append(lib.name)
            names = [entry.name for entry in lib.entries]
            if lib.name.lower() == f"python{nodot}.dll":
                python += names
                problems += [
                    f"imports {n} from {lib.name}: not in Python's C API"
                    for n in names
                    if n not in funcs and n not in data
                ]
            elif _WINDOWS_LIBRARIES.match(lib.name):
                system += names
            else:
                problems.append(f"imports from {lib.name}, neither Python nor a system library: {names[:5]}")
        print(f"{product.name}: PE32+ x86-64 DLL, imports from {libraries}")
    print(f"  {len(python)} symbols of Python's C API, {len(system)} of the system's libraries")
    return problems


def main(argv):
    if argv[:1] == ["def"] and len(argv) == 3:
        write_def(argv[1], argv[2])
        return 0
    if argv[:1] == ["check"] and len(argv) == 4:
        problems = check(*argv[1:])
        for problem in problems:
            print(f"cross_check.py: {argv[1]}: {problem}", file=sys.stderr)
        if not problems:
            print(f"  {argv[1]}: the product is as CPython there loads it, and needs nothing Linux-only")
        return 1 if problems else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
