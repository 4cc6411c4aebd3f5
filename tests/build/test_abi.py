"""The ABI check (pybmoe.build.abi): the ctypes declarations pybmoe relies on against the pinned
tree's llama.h, and pybmoe's own against ggml-ext/llama-moe.h; and that the check reports a
declaration broken on purpose (a wrong return type, a wrong parameter, a narrowed or missing
field, a header that changed a signature).

The constants: every copy the package holds of a llama-moe.h constant (a ``LLAMA_MOE_*`` name, the
header's own) is held to the value the header has now, read from it (``#define``s and enumerators,
:func:`pybmoe.build.abi.header_constants`), so a constant the engine renames, renumbers or moves
into an enum fails here; the results the header states only in words (a setter's -2 while a graph
is being computed, the -1 of a failed call, the read lanes' range) are read from its comments. The
copies of ggml's enumerators (``GGML_*``) are held to the pinned tree's ggml.h and ggml-backend.h.

The signature and layout checks need the built tree (``vendor/src/.../include/llama.h``), the
``llama_cpp`` package and a C++ compiler; each test says why it skips without them. One compile
per check (about a second). The llama-moe.h constants need only the checkout and ``llama_cpp``.
"""
from __future__ import annotations

import ctypes
import re
import shutil
from pathlib import Path

import pytest

from pybmoe.build import abi, vendor

ROOT = Path(__file__).resolve().parents[2]

#: Differences between llama-cpp-python 0.3.36 and the pinned llama.h in what pybmoe never
#: reaches (training), with why each is harmless to pybmoe. Anything else fails the test.
KNOWN_UNREACHED = {
    # the bindings' struct lacks the trailing `enum ggml_opt_optimizer_type optimizer_type`;
    # llama_opt_init takes it by value, so a caller would pass 8 bytes short. pybmoe does not train.
    "struct llama_opt_params: size",
}


def _tree() -> Path:
    lc = vendor.tree_dir(ROOT, vendor.load_pin(ROOT)) / vendor.load_pin(ROOT).subdir
    if not (lc / "include" / "llama.h").is_file():
        pytest.skip(f"no built tree: {lc / 'include' / 'llama.h'} is absent (run `pybmoe vendor` or a build)")
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler (c++) on PATH")
    return lc


def _llama_cpp():
    try:
        import llama_cpp
        import llama_cpp.llama_cpp as m
    except Exception as e:  # the package or its library is missing
        pytest.skip(f"the llama_cpp bindings do not import: {e}")
    return llama_cpp, m


def _used(llama_cpp) -> set[str]:
    """What pybmoe reaches of llama_cpp.llama_cpp: the names pybmoe uses directly, and those that
    the parts of llama_cpp it builds on (Llama, its internals, chat formats, logging) use."""
    pkg = Path(llama_cpp.__file__).parent
    files = [pkg / f for f in ("llama.py", "_internals.py", "llama_chat_format.py", "_logger.py",
                               "llama_tokenizer.py", "llama_grammar.py") if (pkg / f).is_file()]
    return abi.referenced_names(files) | abi.referenced_names(sorted((ROOT / "pybmoe").rglob("*.py")))


def _check(fns, structs, lc: Path, header: Path | None = None) -> abi.Report:
    return abi.check(fns, structs, header or lc / "include" / "llama.h",
                     [lc / "include", lc / "ggml" / "include"])


def test_llama_cpp_bindings_match_the_pinned_llama_h():
    lc = _tree()
    llama_cpp, m = _llama_cpp()
    fns, structs = abi.declarations(m)
    rep = _check(fns, structs, lc)
    assert rep.functions > 200 and rep.structs > 15 and rep.checked > 1000, rep
    used = abi.reached(fns, structs, _used(llama_cpp))
    assert {"llama_decode", "llama_batch", "llama_model_params", "llama_context_params", "llama_log_set"} <= used
    bad = [str(x) for x in rep.mismatches if x.name in used]
    assert not bad, "the llama_cpp bindings pybmoe uses differ from llama.h:\n" + "\n".join(bad)
    unreached = {x.where for x in rep.mismatches if x.name not in used}
    assert unreached == KNOWN_UNREACHED, [str(x) for x in rep.mismatches]


def test_pybmoe_own_bindings_match_llama_moe_h():
    lc = _tree()
    _llama_cpp()
    from pybmoe.engine import bindings
    lib = bindings._llama_lib()
    fns = [abi.Function(n, tuple(f.argtypes), f.restype) for n, f in sorted(vars(lib).items())
           if n.startswith("llama_") and "moe" in n and isinstance(f, ctypes._CFuncPtr)]
    assert len(fns) >= 10, [f.name for f in fns]
    assert {"llama_moe_default_params", "llama_model_moe_apply"} <= {f.name for f in fns}
    structs = [abi.Struct("llama_moe_cache_stats", bindings.MoeCacheStatsC),
               abi.Struct("llama_moe_stream_stats", bindings.MoeStreamStatsC),
               abi.Struct("llama_moe_params", bindings.MoeParamsC),
               abi.Struct("llama_moe_apply_report", bindings.MoeApplyReportC),
               abi.Struct("llama_moe_cache_device_stats", bindings.MoeCacheDeviceStatsC)]
    rep = _check(fns, structs, lc, ROOT / "ggml-ext" / "llama-moe.h")
    assert rep.functions == len(fns) and rep.structs == 5
    assert rep.ok, "\n".join(map(str, rep.mismatches))


# ------------------------------------------------------------------ broken on purpose: it must say so

def test_a_wrong_return_type_or_parameter_is_reported():
    lc = _tree()
    _, m = _llama_cpp()
    right = m.llama_model_n_layer  # int32_t llama_model_n_layer(const struct llama_model * model)
    assert right.restype is ctypes.c_int32
    fns = [abi.Function("llama_model_n_layer", tuple(right.argtypes), ctypes.c_int64),        # restype
           abi.Function("llama_set_n_threads", (ctypes.c_void_p, ctypes.c_int32, ctypes.c_float), None),  # arg 3
           abi.Function("llama_batch_free", (ctypes.POINTER(m.llama_batch),), None),          # by value in C
           abi.Function("llama_n_ctx", (ctypes.c_void_p, ctypes.c_int32), ctypes.c_uint32),   # one too many
           abi.Function("llama_no_such_function", (), None)]
    rep = _check(fns, [], lc)
    got = {x.where: x for x in rep.mismatches}
    assert set(got) == {"fn llama_model_n_layer: return type", "fn llama_set_n_threads: parameter 3",
                        "fn llama_batch_free: parameter 1", "fn llama_n_ctx: number of parameters",
                        "fn llama_n_ctx: parameter 2", "fn llama_no_such_function"}, [str(x) for x in rep.mismatches]
    assert "(8 bytes, signed)" in str(got["fn llama_model_n_layer: return type"])  # c_int64 is c_long
    assert "the header has int" in str(got["fn llama_model_n_layer: return type"])  # int32_t is int
    assert "the header has int" in str(got["fn llama_set_n_threads: parameter 3"])
    assert got["fn llama_n_ctx: number of parameters"].c == "1"
    assert got["fn llama_n_ctx: parameter 2"].c == "absent"  # a parameter C does not have


def test_a_struct_with_a_moved_or_missing_field_is_reported():
    lc = _tree()
    _, m = _llama_cpp()
    good = list(m.llama_token_data._fields_)           # id (int32), logit (float), p (float)
    assert [f[0] for f in good] == ["id", "logit", "p"]
    Narrow = type("llama_token_data", (ctypes.Structure,),
                  {"_fields_": [("id", ctypes.c_int64), ("logit", ctypes.c_float), ("p", ctypes.c_float)]})
    Extra = type("llama_logit_bias", (ctypes.Structure,),
                 {"_fields_": [*m.llama_logit_bias._fields_, ("scale", ctypes.c_float)]})
    rep = _check([], [abi.Struct("llama_token_data", Narrow), abi.Struct("llama_logit_bias", Extra)], lc)
    got = {x.where for x in rep.mismatches}
    assert {"struct llama_token_data: size", "struct llama_token_data: field id size",
            "struct llama_token_data: field id type", "struct llama_token_data: field logit offset",
            "struct llama_logit_bias: size", "struct llama_logit_bias: field scale"} <= got, got


def test_a_header_that_changed_a_signature_is_reported(tmp_path):
    """The real declarations against a fake llama.h in which one function returns int64_t and
    llama_token_data lost a field: what a future pin that breaks the bindings looks like."""
    lc = _tree()
    _, m = _llama_cpp()
    h = tmp_path / "llama.h"
    h.write_text("#pragma once\n#include <stdint.h>\n#include <stdbool.h>\n"
                 "#ifdef __cplusplus\nextern \"C\" {\n#endif\n"
                 "struct llama_model;\n"
                 "typedef int32_t llama_token;\n"
                 "typedef struct llama_token_data { llama_token id; float logit; } llama_token_data;\n"
                 "int64_t llama_model_n_layer(const struct llama_model * model);\n"
                 "int32_t llama_model_n_head(const struct llama_model * model);\n"
                 "#ifdef __cplusplus\n}\n#endif\n")
    fns = [abi.Function(n, tuple(getattr(m, n).argtypes), getattr(m, n).restype)
           for n in ("llama_model_n_layer", "llama_model_n_head")]
    rep = abi.check(fns, [abi.Struct("llama_token_data", m.llama_token_data)], h)
    got = {x.where for x in rep.mismatches}
    assert got == {"fn llama_model_n_layer: return type", "struct llama_token_data: size",
                   "struct llama_token_data: field p"}, [str(x) for x in rep.mismatches]
    # and the real header accepts the same declarations
    assert _check(fns, [abi.Struct("llama_token_data", m.llama_token_data)], lc).ok


def test_check_raises_on_a_missing_header_or_compiler(tmp_path):
    with pytest.raises(FileNotFoundError):
        abi.check([], [], tmp_path / "nope.h")
    (tmp_path / "x.h").write_text("")
    with pytest.raises(abi.AbiError, match="no C\\+\\+ compiler"):
        abi.check([], [], tmp_path / "x.h", cxx="no-such-compiler-here")


# ------------------------------------------------------------------ constants: the package's copies of the headers'

LLAMA_MOE_H = ROOT / "ggml-ext" / "llama-moe.h"


def _copies(prefix: str) -> dict[str, int]:
    """``{"module.NAME": value}`` of every module-level name of the package that starts with ``prefix``
    (found in the source, valued as the imported module has it)."""
    import ast
    import importlib
    out = {}
    for f in sorted((ROOT / "pybmoe").rglob("*.py")):
        names = {t.id for node in ast.parse(f.read_text()).body if isinstance(node, (ast.Assign, ast.AnnAssign))
                 for tgt in (node.targets if isinstance(node, ast.Assign) else [node.target])
                 for t in ast.walk(tgt) if isinstance(t, ast.Name) and t.id.startswith(prefix)}
        if names:
            mod = importlib.import_module(".".join(f.relative_to(ROOT).with_suffix("").parts))
            out |= {f"{mod.__name__}.{n}": getattr(mod, n) for n in names}
    return out


def _differences(copies: dict[str, int], header: dict[str, int]) -> list[str]:
    return [f"{where} = {v}: " + (f"the header has {header[where.rsplit('.', 1)[1]]}"
                                  if where.rsplit(".", 1)[1] in header else "the header has no such name")
            for where, v in sorted(copies.items()) if header.get(where.rsplit(".", 1)[1]) != v]


def test_every_copy_of_a_llama_moe_h_constant_equals_the_header():
    """Every LLAMA_MOE_* name of the package is llama-moe.h's, and has its value there (a #define or an
    enumerator, read from the header as it is now)."""
    _llama_cpp()
    copies = _copies("LLAMA_MOE_")
    assert {"pybmoe.engine.bindings.LLAMA_MOE_STREAM_ERR_BUDGET", "pybmoe.engine.bindings.LLAMA_MOE_CACHE_ERR_NO_ROOM",
            "pybmoe.engine.bindings.LLAMA_MOE_DENSE_AUTO", "pybmoe.engine.flags.LLAMA_MOE_CACHE_ADMIT_WINDOW_MAX",
            "pybmoe.routing.sim.LLAMA_MOE_CACHE_ADMIT_WINDOW_DEFAULT"} <= set(copies), sorted(copies)
    bad = _differences(copies, abi.header_constants(LLAMA_MOE_H))
    assert not bad, "copies of llama-moe.h's constants that differ from it:\n" + "\n".join(bad)


def _comments(header: Path) -> str:
    """The text of ``header``'s comments, the lines of each joined by spaces."""
    text = header.read_text()
    parts = re.findall(r"//([^\n]*)|/\*(.*?)\*/", text, re.S)
    return " ".join((a or b).strip() for a, b in parts)


def test_the_results_llama_moe_h_states_in_words_are_its_names():
    """The header's comments that state a result in words (a setter's value while a graph is being
    computed, the -1 of a failed call, the read lanes' range) agree with the names it gives them
    (LLAMA_MOE_ERR_BUSY, LLAMA_MOE_ERR, LLAMA_MOE_STREAM_IO_THREADS_MAX), which the bindings copy."""
    _llama_cpp()
    from pybmoe.engine import bindings
    said = _comments(LLAMA_MOE_H)
    busy = re.findall(r"(-?\d+) while a graph is being computed", said)
    assert len(busy) >= 6 and set(map(int, busy)) == {bindings.LLAMA_MOE_ERR_BUSY}, busy
    failed = re.findall(r"(?:Returns|returns)[^.;]*?(-\d+) "
                        r"(?:for a bad value|when the (?:cache|tier) is off|\(logged\))", said)
    assert len(failed) >= 6 and set(map(int, failed)) == {bindings.LLAMA_MOE_ERR}, failed
    lanes = re.findall(r"io_threads read lanes \(1 \.\. (\d+)\)", said)
    assert lanes == [str(bindings.LLAMA_MOE_STREAM_IO_THREADS_MAX)], lanes


def test_every_copy_of_a_ggml_constant_equals_the_pinned_headers():
    lc = _tree()
    _llama_cpp()
    header = {}
    for h in ("ggml.h", "ggml-backend.h"):
        header |= abi.header_constants(lc / "ggml" / "include" / h)
    copies = _copies("GGML_")
    assert {"pybmoe.engine.bindings.GGML_LOG_LEVEL_WARN", "pybmoe.engine.bindings.GGML_BACKEND_DEVICE_TYPE_GPU"} \
        <= set(copies), sorted(copies)
    bad = _differences(copies, header)
    assert not bad, "copies of ggml's constants that differ from the pinned headers:\n" + "\n".join(bad)


def test_header_constants_reads_defines_and_enums(tmp_path):
    """What the reader takes from a header: object-like #defines of integer expressions (suffixes, names
    defined before, parentheses), enumerators with and without values; not a function-like macro, a
    string, a float or a comment."""
    h = tmp_path / "x.h"
    h.write_text("#pragma once\n"
                 "#define A (-3)   // a comment\n"
                 "#define B 0x10u\n"
                 "#define C (B << 2) + A\n"
                 "#define F(x) ((x) + 1)\n"
                 "#define S \"text\"\n"
                 "#define D 1.5\n"
                 "#define LONG \\\n    (7 * 6)\n"
                 "/* #define HIDDEN 1 */\n"
                 "// #define ALSO_HIDDEN 2\n"
                 "enum llama_moe_result {\n"
                 "    LLAMA_MOE_OK,              // 0\n"
                 "    LLAMA_MOE_ERR_FAILED = -1,\n"
                 "    LLAMA_MOE_ERR_BUSY = LLAMA_MOE_ERR_FAILED - 1,\n"
                 "    LLAMA_MOE_NEXT,\n"
                 "};\n"
                 "typedef enum { E0 = 010, E1 } e_t;\n")
    assert abi.header_constants(h) == {"A": -3, "B": 16, "C": 61, "LONG": 42, "LLAMA_MOE_OK": 0,
                                       "LLAMA_MOE_ERR_FAILED": -1, "LLAMA_MOE_ERR_BUSY": -2, "LLAMA_MOE_NEXT": -1,
                                       "E0": 8, "E1": 9}


def test_a_copy_the_header_changed_or_dropped_is_reported(tmp_path):
    """llama-moe.h as a refactor may leave it: the stream's budget error renumbered and moved into an
    enum, the cache's auto gone. The check names both copies, and nothing else."""
    _llama_cpp()
    text = LLAMA_MOE_H.read_text()
    text = re.sub(r"^#define LLAMA_MOE_STREAM_ERR_BUDGET .*$",
                  "enum { LLAMA_MOE_X = -3, LLAMA_MOE_STREAM_ERR_BUDGET };", text, flags=re.M)
    text = re.sub(r"^#define LLAMA_MOE_CACHE_AUTO .*$", "", text, flags=re.M)
    h = tmp_path / "llama-moe.h"
    h.write_text(text)
    bad = _differences(_copies("LLAMA_MOE_"), abi.header_constants(h))
    assert bad == ["pybmoe.engine.bindings.LLAMA_MOE_CACHE_AUTO = -1: the header has no such name",
                   "pybmoe.engine.bindings.LLAMA_MOE_STREAM_ERR_BUDGET = -3: the header has -2"], bad
