"""The ABI check of ctypes bindings against a C header: function signatures and struct layouts.

The ``llama_cpp`` bindings (llama-cpp-python) declare each C function of ``llama.h`` by hand, as
a ctypes function with ``argtypes`` and ``restype``, and each public struct as a
``ctypes.Structure``. Nothing checks them against the header they bind: a pin whose ``llama.h``
changed a signature or a struct would load, and then pass the wrong bytes at run time. This
module compares the two, with the C++ compiler as the judge of the C side:

1. :func:`declarations` reads the declarations from a module (``llama_cpp.llama_cpp``): every
   ctypes function object with its ``argtypes``/``restype``, every ``Structure``/``Union``
   subclass with its ``_fields_`` and ctypes' ``sizeof``, ``alignment`` and field offsets.
2. :func:`check` writes one C++ file that includes the header and, for each function, takes its
   type with ``decltype`` and splits it with templates into the return type and each parameter
   type (so no C is parsed here); for each struct it takes ``sizeof``, ``alignof``, and for each
   field ``offsetof``, ``sizeof`` and the declared type. Each C type is tested against what its
   ctypes type implies (below), evaluated by the compiler as a constant. The file is compiled
   once (``c++``, C++17; the header is C, included through its ``extern "C"`` guard) and run; it
   prints one line per item and each line is compared here.

What a ctypes type implies of the C type:

- ``None``: ``void``; ``c_bool``: ``bool``; ``c_float``/``c_double``: exactly that;
- an integer type (``c_int32``, ``c_uint64``, ``c_size_t``, ...): an integer of the same size and
  signedness, or an enum of the same size (ctypes binds enums as ``c_int``);
- ``c_char_p``: a pointer to ``char``; ``c_void_p``: any pointer (ctypes knows no more of an
  opaque handle); ``POINTER(X)``: a pointer to what ``X`` implies, or to an opaque (incomplete)
  struct, whose handle any pointer type carries alike (the bindings declare
  ``llama_adapter_lora *`` as ``POINTER(c_void_p)``);
- a ``Structure``/``Union`` by value: the C struct or union of the same name;
- a ``CFUNCTYPE``: a pointer to a function with as many parameters, each (and the return type)
  as its ctypes type implies;
- an array ``X * n``: an array of ``n`` of what ``X`` implies.

A field a struct names in ``_anonymous_``, or whose ``Structure``/``Union`` type has no C
definition of its name, is an anonymous union or struct in C (``llama_model_kv_override``'s
``value``): its own fields are compared as fields of the outer struct (offsets added), and its
ctypes class, which has no C name, is not looked for.

Functions are found in the header by name (a declaration ``name (`` outside comments), structs by
``struct name {`` or ``union name {``; a declaration that ctypes has and the header lacks is a
mismatch, reported without compiling it.

Errors: :class:`AbiError` when the compiler is missing or the generated file does not compile or
run (its message holds the compiler's output).
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path


class AbiError(RuntimeError):
    """The check could not run: no C++ compiler, or the generated file failed to compile or run."""


@dataclass(frozen=True)
class Function:
    """A ctypes function declaration: ``argtypes`` (``None``: not declared) and ``restype``."""

    name: str
    argtypes: tuple | None
    restype: object


@dataclass(frozen=True)
class Struct:
    """A ctypes ``Structure`` or ``Union`` subclass and the name of its C counterpart (``name``;
    a struct's C name where it has one, whatever the class is called)."""

    name: str
    cls: type
    union: bool = False


@dataclass(frozen=True)
class Mismatch:
    """One difference: ``where`` (``fn llama_x: arg 1``, ``struct s: field f offset``),
    ``ctypes`` (what the binding declares) and ``c`` (what the header has)."""

    where: str
    ctypes: str
    c: str

    @property
    def name(self) -> str:
        """The function or struct the difference is in."""
        return self.where.split(":", 1)[0].split(" ", 1)[1]

    def __str__(self) -> str:
        return f"{self.where}: ctypes has {self.ctypes}, the header has {self.c}"


@dataclass
class Report:
    """The outcome of :func:`check`: ``checked`` counts the items compared (a return type, a
    parameter, a struct's size, a field's offset...), ``mismatches`` lists every difference."""

    checked: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    functions: int = 0
    structs: int = 0

    @property
    def ok(self) -> bool:
        return not self.mismatches


def declarations(module, prefix: str = "llama_") -> tuple[list[Function], list[Struct]]:
    """The ctypes functions and structs that ``module`` defines whose names start with ``prefix``.

    A function is a ctypes function object (what ``CDLL.__getattr__`` returns, with its
    ``argtypes`` and ``restype`` set); a struct is a ``Structure``/``Union`` subclass defined in the
    module itself (``__module__``) that has ``_fields_``.
    """
    fns, structs = [], []
    for name, v in sorted(vars(module).items()):
        if isinstance(v, ctypes._CFuncPtr) and not isinstance(v, type):
            cname = getattr(v, "__name__", name)
            if cname.startswith(prefix):
                fns.append(Function(cname, tuple(v.argtypes) if v.argtypes is not None else None, v.restype))
        elif (isinstance(v, type) and issubclass(v, (ctypes.Structure, ctypes.Union))
              and v.__module__ == module.__name__ and name.startswith(prefix) and "_fields_" in vars(v)):
            structs.append(Struct(name, v, issubclass(v, ctypes.Union)))
    return fns, structs


def _anonymous(cls, fld, cnames) -> bool:
    t = fld[1]
    return fld[0] in getattr(cls, "_anonymous_", ()) or (
        isinstance(t, type) and issubclass(t, (ctypes.Structure, ctypes.Union)) and t.__name__ not in cnames)


def _flat_fields(cls, cnames: set[str], base: int = 0):
    """``(name, ctypes type, offset, size, is_bitfield)`` of ``cls``'s fields, the fields of an
    anonymous member in its place (offsets from the start of the outermost struct)."""
    for fld in cls._fields_:
        d = getattr(cls, fld[0])
        if _anonymous(cls, fld, cnames):
            yield from _flat_fields(fld[1], cnames, base + d.offset)
        else:
            yield fld[0], fld[1], base + d.offset, d.size, len(fld) > 2


def reached(functions: list[Function], structs: list[Struct], names) -> set[str]:
    """The functions and structs a program reaches when it uses ``names``: those names, the
    structs in the signatures of the functions among them (by value or through pointers) and,
    transitively, the structs in those structs' fields."""
    by_name = {s.cls: s.name for s in structs}
    out = set(names)
    todo = [t for f in functions if f.name in out for t in [f.restype, *(f.argtypes or ())]]
    todo += [s.cls for s in structs if s.name in out]
    seen = set()
    while todo:
        t = todo.pop()
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        if not isinstance(t, type):
            continue
        if issubclass(t, ctypes._Pointer) or issubclass(t, ctypes.Array):
            todo.append(t._type_)
        elif issubclass(t, ctypes._CFuncPtr):
            todo += [t._restype_, *(t._argtypes_ or ())]
        elif issubclass(t, (ctypes.Structure, ctypes.Union)):
            if t in by_name:
                out.add(by_name[t])
            todo += [f[1] for f in getattr(t, "_fields_", ())]
    return out


def referenced_names(files, module_alias: str = "llama_cpp") -> set[str]:
    """The names used as ``<module_alias>.<name>`` in the source ``files`` (paths): what a
    program reaches of a bindings module."""
    pat = re.compile(rf"\b{re.escape(module_alias)}\.([A-Za-z_]\w*)")
    out: set[str] = set()
    for f in files:
        out |= set(pat.findall(Path(f).read_text(errors="replace")))
    return out


# --------------------------------------------------------------------------- ctypes -> C++ tests

_INTS = {ctypes.c_int8, ctypes.c_uint8, ctypes.c_int16, ctypes.c_uint16, ctypes.c_int32, ctypes.c_uint32,
         ctypes.c_int64, ctypes.c_uint64, ctypes.c_int, ctypes.c_uint, ctypes.c_long, ctypes.c_ulong,
         ctypes.c_longlong, ctypes.c_ulonglong, ctypes.c_short, ctypes.c_ushort, ctypes.c_byte,
         ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_ssize_t}


def ctype_name(ct) -> str:
    """A readable name of a ctypes type (``c_int32``, ``POINTER(llama_batch)``, ``CFUNCTYPE(...)``)."""
    if ct is None:
        return "None"
    if isinstance(ct, type) and issubclass(ct, ctypes._Pointer):
        return f"POINTER({ctype_name(ct._type_)})"
    if isinstance(ct, type) and issubclass(ct, ctypes._CFuncPtr):
        args = ", ".join(ctype_name(a) for a in (ct._argtypes_ or ()))
        return f"CFUNCTYPE({ctype_name(ct._restype_)}{', ' if args else ''}{args})"
    if isinstance(ct, type) and issubclass(ct, ctypes.Array):
        return f"{ctype_name(ct._type_)} * {ct._length_}"
    if ct in _INTS:
        return f"{ct.__name__} ({ctypes.sizeof(ct)} bytes, {'signed' if ct(-1).value < 0 else 'unsigned'})"
    return getattr(ct, "__name__", repr(ct))


def _test(ct, T: str, cstructs: set[str], cname: dict | None = None) -> str:
    """A C++ constant expression, true when the type ``T`` is what ``ct`` implies (``cname`` maps
    a ctypes struct class to its C name where the two differ)."""
    cname = cname or {}
    if ct is None:
        return f"std::is_void_v<{T}>"
    if ct is ctypes.c_bool:
        return f"std::is_same_v<{T}, bool>"
    if ct is ctypes.c_float:
        return f"std::is_same_v<{T}, float>"
    if ct is ctypes.c_double:
        return f"std::is_same_v<{T}, double>"
    if ct is ctypes.c_char:
        return f"std::is_same_v<{T}, char>"
    if ct in _INTS:
        signed = "true" if ct(-1).value < 0 else "false"
        return f"num_ok<{T}, {ctypes.sizeof(ct)}, {signed}>"
    if ct is ctypes.c_char_p:
        return f"(std::is_pointer_v<{T}> && std::is_same_v<P<{T}>, char>)"
    if ct is ctypes.c_void_p:
        return f"std::is_pointer_v<{T}>"
    if isinstance(ct, type) and issubclass(ct, ctypes._Pointer):
        return (f"(std::is_pointer_v<{T}> && (opaque<P<{T}>> || "
                f"{_test(ct._type_, f'P<{T}>', cstructs, cname)}))")
    if isinstance(ct, type) and issubclass(ct, ctypes._CFuncPtr):
        F = f"P<{T}>"
        args = list(ct._argtypes_ or ())
        parts = [f"std::is_pointer_v<{T}>", f"std::is_function_v<{F}>", f"sig<{F}>::n == {len(args)}",
                 _test(ct._restype_, f"typename sig<{F}>::ret", cstructs, cname)]
        parts += [_test(a, f"typename sig<{F}>::template arg<{i}>", cstructs, cname) for i, a in enumerate(args)]
        return "(" + " && ".join(parts) + ")"
    if isinstance(ct, type) and issubclass(ct, ctypes.Array):
        return (f"(std::is_array_v<{T}> && std::extent_v<{T}> == {ct._length_} && "
                f"{_test(ct._type_, f'std::remove_extent_t<{T}>', cstructs, cname)})")
    if isinstance(ct, type) and issubclass(ct, (ctypes.Structure, ctypes.Union)):
        n = cname.get(ct, ct.__name__)
        if n in cstructs:
            return f"std::is_same_v<std::remove_cv_t<{T}>, ::{n}>"
        return "false"
    return "false"


_PRELUDE = r"""
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include "%(header)s"

struct absent {};
template<class T> using P = std::remove_cv_t<std::remove_pointer_t<T>>;
template<std::size_t i, class Tup, class = void> struct elem { using type = absent; };
template<std::size_t i, class... A> struct elem<i, std::tuple<A...>, std::enable_if_t<(i < sizeof...(A))>> {
    using type = std::tuple_element_t<i, std::tuple<A...>>;
};
template<class F> struct sig { static constexpr int n = -1; using ret = absent; template<std::size_t i> using arg = absent; };
template<class R, class... A> struct sig<R(A...)> {
    static constexpr int n = sizeof...(A);
    using ret = R;
    template<std::size_t i> using arg = typename elem<i, std::tuple<A...>>::type;
};
template<class T, class = void> struct complete : std::false_type {};
template<class T> struct complete<T, std::void_t<decltype(sizeof(T))>> : std::true_type {};
template<class T> constexpr std::size_t size_of() {
    if constexpr (std::is_void_v<T> || std::is_function_v<T>) return 0;
    else if constexpr (complete<T>::value) return sizeof(T);
    else return 0;
}
template<class T> constexpr bool opaque = std::is_class_v<T> && !complete<T>::value;
template<class T, std::size_t N, bool S> constexpr bool num_ok =
    (std::is_integral_v<T> && !std::is_same_v<T, bool> && size_of<T>() == N && std::is_signed_v<T> == S) ||
    (std::is_enum_v<T> && size_of<T>() == N);
template<class T> const char * tname() {
    static char buf[512];
    const char * s = __PRETTY_FUNCTION__;
    const char * b = std::strstr(s, "T = ");
    if (!b) return s;
    b += 4;
    std::size_t n = std::strlen(b);
    if (n && b[n - 1] == ']') n--;
    if (n >= sizeof buf) n = sizeof buf - 1;
    std::memcpy(buf, b, n);
    buf[n] = 0;
    return buf;
}
static void row(const char * id, int ok, const char * c) { std::printf("%%s\t%%d\t%%s\n", id, ok, c); }
static void num(const char * id, long long v) { std::printf("%%s\t=\t%%lld\n", id, v); }
"""


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _header_text(header: Path, include_dirs: list[Path]) -> str:
    """The header and the headers it includes by ``"name"`` from the include dirs, comments removed."""
    seen, out, todo = set(), [], [header]
    while todo:
        h = todo.pop()
        if h in seen or not h.is_file():
            continue
        seen.add(h)
        t = _strip_comments(h.read_text(errors="replace"))
        out.append(t)
        for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', t, re.M):
            for d in [h.parent, *include_dirs]:
                if (d / inc).is_file():
                    todo.append(d / inc)
                    break
    return "\n".join(out)


def check(functions: list[Function], structs: list[Struct], header: Path,
          include_dirs: list[Path] | None = None, cxx: str | None = None) -> Report:
    """Compare ``functions`` and ``structs`` with the C declarations in ``header``.

    ``include_dirs`` are passed with ``-I`` (the header's own folder is always one);
    ``cxx`` is the C++ compiler (default ``$CXX``, else ``c++``). A function whose ``argtypes``
    is None (ctypes left undeclared) has only its return type checked.

    Returns a :class:`Report` (``ok`` when nothing differs).

    Raises:
        AbiError: no compiler, or the generated file does not compile or run.
        FileNotFoundError: ``header`` does not exist.
    """
    header = Path(header)
    if not header.is_file():
        raise FileNotFoundError(f"no header {header}")
    include_dirs = [Path(d) for d in (include_dirs or [])]
    cxx = cxx or os.environ.get("CXX") or "c++"
    if shutil.which(cxx) is None:
        raise AbiError(f"no C++ compiler {cxx!r} on PATH")
    text = _header_text(header, include_dirs)
    cstructs = set(re.findall(r"\b(?:struct|union)\s+(\w+)\s*\{", text))
    declared = set(re.findall(r"\b(\w+)\s*\(", text))
    cname = {st.cls: st.name for st in structs}
    rep = Report()
    expect: dict[str, tuple[str, str]] = {}  # id -> (where, ctypes side)
    nums: dict[str, int] = {}                # id -> the value ctypes has
    body: list[str] = []
    k = 0

    def new_id() -> str:
        nonlocal k
        k += 1
        return f"c{k}"

    for f in functions:
        if f.name not in declared:
            rep.mismatches.append(Mismatch(f"fn {f.name}", "a declaration", "no such function"))
            continue
        rep.functions += 1
        F = f"decltype(::{f.name})"
        body.append(f"  // {f.name}")
        i = new_id()
        expect[i] = (f"fn {f.name}: return type", ctype_name(f.restype))
        body.append(f'  row("{i}", {_test(f.restype, f"sig<{F}>::ret", cstructs, cname)}, tname<sig<{F}>::ret>());')
        if f.argtypes is None:
            continue
        i = new_id()
        nums[i] = len(f.argtypes)
        expect[i] = (f"fn {f.name}: number of parameters", str(len(f.argtypes)))
        body.append(f'  num("{i}", sig<{F}>::n);')
        for a, at in enumerate(f.argtypes):
            i = new_id()
            T = f"sig<{F}>::arg<{a}>"
            expect[i] = (f"fn {f.name}: parameter {a + 1}", ctype_name(at))
            body.append(f'  row("{i}", {_test(at, T, cstructs, cname)}, tname<{T}>());')

    helpers: list[str] = []
    anon = {f[1] for st in structs for f in st.cls._fields_ if _anonymous(st.cls, f, cstructs)}
    for s in structs:
        if s.cls in anon:
            continue
        if s.name not in cstructs:
            rep.mismatches.append(Mismatch(f"struct {s.name}", "a definition", "no such struct or union"))
            continue
        rep.structs += 1
        body.append(f"  // struct {s.name}")
        for what, val, expr in (("size", ctypes.sizeof(s.cls), f"sizeof(::{s.name})"),
                                ("alignment", ctypes.alignment(s.cls), f"alignof(::{s.name})")):
            i = new_id()
            nums[i] = val
            expect[i] = (f"struct {s.name}: {what}", str(val))
            body.append(f'  num("{i}", (long long){expr});')
        for fname, ftype, foff, fsize, bits in _flat_fields(s.cls, cstructs):
            h = f"has_{s.name}_{fname}"
            helpers.append(f"template<class T, class = void> struct {h} : std::false_type {{}};\n"
                           f"template<class T> struct {h}<T, std::void_t<decltype(std::declval<T&>().{fname})>>"
                           f" : std::true_type {{}};")
            ids = {w: new_id() for w in ("present", "offset", "size", "type")}
            expect[ids["present"]] = (f"struct {s.name}: field {fname}", "the field")
            expect[ids["offset"]] = (f"struct {s.name}: field {fname} offset", str(foff))
            expect[ids["size"]] = (f"struct {s.name}: field {fname} size", str(fsize))
            expect[ids["type"]] = (f"struct {s.name}: field {fname} type", ctype_name(ftype))
            nums[ids["offset"]], nums[ids["size"]] = foff, fsize
            M = f"decltype(std::declval<T&>().{fname})"
            helpers.append(
                f"template<class T> void field_{s.name}_{fname}() {{\n"
                f"  if constexpr ({h}<T>::value) {{\n"
                f'    row("{ids["present"]}", 1, "");\n'
                + ("" if bits else
                   f'    num("{ids["offset"]}", (long long)offsetof(T, {fname}));\n'
                   f'    num("{ids["size"]}", (long long)sizeof({M}));\n'
                   f'    row("{ids["type"]}", {_test(ftype, M, cstructs, cname)}, tname<{M}>());\n')
                + f"  }} else {{\n"
                f'    row("{ids["present"]}", 0, "no such field");\n'
                f"  }}\n}}")
            if bits:
                for w in ("offset", "size", "type"):
                    expect.pop(ids[w])
                    nums.pop(ids[w], None)
            body.append(f"  field_{s.name}_{fname}<::{s.name}>();")

    src = (_PRELUDE % {"header": header.name} + "\n".join(helpers)
           + "\nint main() {\n" + "\n".join(body) + "\n  return 0;\n}\n")
    with tempfile.TemporaryDirectory(prefix="pybmoe-abi-") as tmp:
        cpp, exe = Path(tmp) / "abi.cpp", Path(tmp) / "abi"
        cpp.write_text(src)
        cmd = [cxx, "-std=c++17", "-w", "-O0", "-I", str(header.parent),
               *[a for d in include_dirs for a in ("-I", str(d))], str(cpp), "-o", str(exe)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise AbiError(f"the ABI check does not compile against {header}:\n{r.stderr[-4000:]}")
        r = subprocess.run([str(exe)], capture_output=True, text=True)
        if r.returncode != 0:
            raise AbiError(f"the ABI check program failed ({r.returncode}):\n{r.stderr[-2000:]}")
    for line in r.stdout.splitlines():
        i, flag, c = (line.split("\t", 2) + ["", ""])[:3]
        if i not in expect:
            continue
        rep.checked += 1
        where, want = expect[i]
        if flag == "=":
            if int(c) != nums[i]:
                rep.mismatches.append(Mismatch(where, want, c))
        elif flag != "1":
            rep.mismatches.append(Mismatch(where, want, c or "?"))
    return rep


# --------------------------------------------------------------------------- constants

_INT_LITERAL = re.compile(r"\b(0[xX][0-9a-fA-F]+|\d+)(?:[uU](?:ll|LL|l|L)?|(?:ll|LL|l|L)[uU]?)?\b")
_C_OPS = {"||": " or ", "&&": " and ", "!": " not "}


def _c_int(expr: str, known: dict[str, int]) -> int | None:
    """The value of the C integer constant expression ``expr`` (literals with or without
    suffixes, names in ``known``, parentheses, unary and binary arithmetic and bit operators);
    None when it is not one (a string, a float, a cast, a name not in ``known``)."""
    import ast

    def lit(m: re.Match) -> str:
        s = m.group(1)
        if len(s) > 1 and s[0] == "0" and s[1] not in "xX":
            return str(int(s, 8))  # C octal
        return str(int(s, 0))

    py = _INT_LITERAL.sub(lit, expr.strip())
    for c, p in _C_OPS.items():
        py = py.replace(c, p)
    try:
        tree = ast.parse(py, mode="eval")
    except SyntaxError:
        return None
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.LShift: lambda a, b: a << b, ast.RShift: lambda a, b: a >> b, ast.BitOr: lambda a, b: a | b,
           ast.BitAnd: lambda a, b: a & b, ast.BitXor: lambda a, b: a ^ b,
           ast.Div: lambda a, b: int(a / b), ast.Mod: lambda a, b: a - b * int(a / b)}  # C truncates

    def ev(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, int) and not isinstance(n.value, bool):
            return n.value
        if isinstance(n, ast.Name) and n.id in known:
            return known[n.id]
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd, ast.Invert)):
            v = ev(n.operand)
            return -v if isinstance(n.op, ast.USub) else v if isinstance(n.op, ast.UAdd) else ~v
        if isinstance(n, ast.BinOp) and type(n.op) in ops:
            return ops[type(n.op)](ev(n.left), ev(n.right))
        raise ValueError(ast.dump(n))

    try:
        return ev(tree.body)
    except (ValueError, ZeroDivisionError):
        return None


def header_constants(header: Path) -> dict[str, int]:
    """The integer constants ``header`` defines, by name: every object-like ``#define NAME value``
    whose value is an integer constant expression, and every enumerator (an explicit value, else
    one more than the one before, from 0), in the order they come, a later one seeing the earlier
    ones. The file alone is read (not the headers it includes); comments are removed first.

    Raises:
        FileNotFoundError: ``header`` does not exist.
    """
    text = _strip_comments(Path(header).read_text(errors="replace")).replace("\\\n", " ")
    out: dict[str, int] = {}
    item = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(?P<name>\w+)(?![\w(])[ \t]*(?P<value>[^\n]*)$"
                      r"|\benum\b[^{;()]*\{(?P<body>[^}]*)\}", re.M)
    for m in item.finditer(text):
        if m.group("name"):
            v = _c_int(m.group("value"), out)
            if v is not None:
                out[m.group("name")] = v
            continue
        nxt = 0
        for part in m.group("body").split(","):
            name, eq, expr = part.partition("=")
            name = name.strip()
            if not re.fullmatch(r"[A-Za-z_]\w*", name):
                continue
            v = _c_int(expr, out) if eq else nxt
            if v is None:
                break  # an enumerator this reader cannot evaluate: the ones after it would be wrong
            out[name] = v
            nxt = v + 1
    return out
