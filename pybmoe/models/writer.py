"""Tiny, deterministic, real-architecture MoE models in GGUF.

The generator writes a ``qwen3moe`` model (llama.cpp's ``LLM_ARCH_QWEN3MOE``)
with random weights and the real Qwen2 tokenizer copied from
``models/ggml-vocab-qwen2.gguf`` of the pinned llama.cpp tree. The file loads
and generates (gibberish) in stock llama.cpp, so it exercises the MoE code
paths (``ffn_*_exps`` tensors, ``MUL_MAT_ID``) without downloading anything.

Layout of the file, in ggml order (``ne0`` first; numpy shapes are reversed)::

    token_embd.weight            {n_embd, n_vocab}                 Q8_0 (F16 if n_embd % 32)
    output_norm.weight           {n_embd}                          F32
    (no output.weight: the output head is tied to token_embd)
    blk.N.attn_norm.weight       {n_embd}                          F32
    blk.N.attn_q.weight          {n_embd, n_head * head_dim}       ftype
    blk.N.attn_k.weight          {n_embd, n_head_kv * head_dim}    ftype
    blk.N.attn_v.weight          {n_embd, n_head_kv * head_dim}    ftype
    blk.N.attn_output.weight     {n_head * head_dim, n_embd}       ftype (see below)
    blk.N.attn_q_norm.weight     {head_dim}                        F32
    blk.N.attn_k_norm.weight     {head_dim}                        F32
    blk.N.ffn_norm.weight        {n_embd}                          F32
    blk.N.ffn_gate_inp.weight    {n_embd, n_expert}                F32 (the router)
    blk.N.ffn_gate_exps.weight   {n_embd, n_ff_exp, n_expert}      ftype
    blk.N.ffn_up_exps.weight     {n_embd, n_ff_exp, n_expert}      ftype
    blk.N.ffn_down_exps.weight   {n_ff_exp, n_embd, n_expert}      ftype

``ftype`` is one of ``F16``, ``Q8_0``, ``Q4_K``. A quantized type needs the
row length (``ne0``) of a tensor to be a multiple of its block size (32 for
Q8_0, 256 for Q4_K): ``n_embd`` and ``n_ff_exp`` are validated, while
``attn_output`` (row length ``n_head * head_dim``) falls back to Q8_0, then
F16, when it does not fit. The token embedding is Q8_0 for every ftype so the
151,936-token table stays small (about 40 MiB at ``n_embd=256``).

gguf 0.19 cannot quantize Q4_K, so :func:`quantize_q4_k` implements it
(``block_q4_K`` of ``ggml-common.h``: f16 ``d`` and ``dmin``, 12 bytes of
packed 6-bit sub-block scales and mins, 128 bytes of 4-bit quants).

Weights come from ``numpy.random.default_rng(seed)`` in a fixed order, so the
same arguments give a byte-identical file. Matmul weights are normal with
standard deviation ``1/sqrt(fan_in)``, norms are 1, and the router is drawn
wider (``2/sqrt(n_embd)``) so different tokens pick different experts.

Errors: :class:`ValueError` for a bad shape, ftype or architecture (the
message names the value and the accepted range), :class:`FileNotFoundError`
when the vocab file is missing, :class:`ModelFileError` (:func:`check_gguf`) for a path that is not a
complete GGUF file.
"""
from __future__ import annotations

import functools
import mmap
import os
import re
import struct
import secrets
import shutil
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

#: Bump when the bytes written for the same arguments change; it is part of
#: the cache file name of :func:`default_model_path`.
GENERATOR_VERSION = 1

FTYPES = ("F16", "Q8_0", "Q4_K")
_QTYPE = {"F16": QT.F16, "Q8_0": QT.Q8_0, "Q4_K": QT.Q4_K}
_FILE_TYPE = {
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_S,
}
# limits of the pinned llama.cpp (src/llama-hparams.h)
MAX_LAYERS = 512
MAX_EXPERTS = 1024

ROPE_FREQ_BASE = 1_000_000.0
RMS_EPS = 1e-6
QK_K = 256


def _block_size(qtype: QT) -> int:
    return gguf.GGML_QUANT_SIZES[qtype][0]


def row_bytes(n: int, qtype: QT) -> int:
    """Bytes of one row of ``n`` elements stored as ``qtype``; ``n`` must fill whole blocks."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if n % block:
        raise ValueError(f"row length {n} is not a multiple of {block}, the {qtype.name} block size")
    return n // block * size


@dataclass(frozen=True)
class ModelSpec:
    """Shape, storage type and seed of a generated model.

    Units: ``n_layer`` blocks, ``n_expert`` experts per layer of which
    ``n_expert_used`` are routed per token, ``n_embd`` / ``n_ff_exp`` /
    ``head_dim`` elements, ``n_head`` / ``n_head_kv`` heads, ``n_ctx_train``
    tokens. Construction validates every field and raises :class:`ValueError`
    naming the bad value and the accepted range.
    """

    arch: str = "qwen3moe"
    n_layer: int = 4
    n_expert: int = 16
    n_expert_used: int = 4
    n_embd: int = 256
    n_ff_exp: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_ctx_train: int = 4096
    ftype: str = "Q8_0"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHES:
            raise ValueError(f"arch={self.arch!r} is not supported; accepted: {', '.join(ARCHES)}")
        if ARCHES[self.arch].validate is not None:
            ARCHES[self.arch].validate(self)
        if self.ftype not in FTYPES:
            raise ValueError(f"ftype={self.ftype!r} is not supported; accepted: {', '.join(FTYPES)}")
        for f in fields(self):
            if f.name in ("arch", "ftype"):
                continue
            v = getattr(self, f.name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise ValueError(f"{f.name}={v!r} must be an integer")
        _check_range("n_layer", self.n_layer, 1, MAX_LAYERS)
        _check_range("n_expert", self.n_expert, 2, MAX_EXPERTS)
        _check_range("n_expert_used", self.n_expert_used, 1, self.n_expert)
        _check_range("n_embd", self.n_embd, 1, None)
        _check_range("n_ff_exp", self.n_ff_exp, 1, None)
        _check_range("n_head", self.n_head, 1, None)
        _check_range("n_head_kv", self.n_head_kv, 1, self.n_head)
        if self.n_head % self.n_head_kv:
            raise ValueError(
                f"n_head_kv={self.n_head_kv} must divide n_head={self.n_head} "
                f"(accepted: a divisor of {self.n_head})")
        _check_range("head_dim", self.head_dim, 2, None)
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs); accepted: 2, 4, 6, ...")
        _check_range("n_ctx_train", self.n_ctx_train, 1, None)
        _check_range("seed", self.seed, 0, None)
        block = _block_size(self.qtype)
        for name in ("n_embd", "n_ff_exp"):
            v = getattr(self, name)
            if v % block:
                raise ValueError(
                    f"{name}={v} is not a multiple of {block}, the {self.ftype} block size; "
                    f"accepted: {block}, {2 * block}, {3 * block}, ...")

    @property
    def qtype(self) -> QT:
        """The ggml type of the expert and attention weights."""
        return _QTYPE[self.ftype]

    @property
    def name(self) -> str:
        """A file-name friendly summary, e.g. ``qwen3moe-L4-E16-K4-D256-F256-Q8_0-s0``."""
        s = (f"{self.arch}-L{self.n_layer}-E{self.n_expert}-K{self.n_expert_used}"
             f"-D{self.n_embd}-F{self.n_ff_exp}")
        if (self.n_head, self.n_head_kv, self.head_dim) != (4, 2, 64):
            s += f"-H{self.n_head}x{self.n_head_kv}x{self.head_dim}"
        if self.n_ctx_train != 4096:
            s += f"-C{self.n_ctx_train}"
        return f"{s}-{self.ftype}-s{self.seed}"


def _check_range(name: str, value: int, lo: int, hi: int | None) -> None:
    if value < lo or (hi is not None and value > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}={value} is out of range; accepted: {rng}")


def _fit(qtype: QT, n: int) -> QT:
    """``qtype`` if rows of ``n`` elements fill its blocks, else Q8_0, else F16."""
    for t in (qtype, QT.Q8_0, QT.F16):
        if n % _block_size(t) == 0:
            return t
    return QT.F16


def embd_qtype(spec: ModelSpec) -> QT:
    """Storage type of ``token_embd`` (also the tied output head)."""
    return _fit(QT.Q8_0, spec.n_embd)


def expert_bytes(spec: ModelSpec) -> int:
    """Bytes of one expert of one layer: its gate + up + down slices in ``spec.ftype``.

    gate and up are ``n_ff_exp`` rows of ``n_embd``; down is ``n_embd`` rows
    of ``n_ff_exp``. E.g. 3 * 256 * 272 = 208,896 bytes (0.2 MiB) for Q8_0 at
    the defaults.
    """
    q = spec.qtype
    return 2 * spec.n_ff_exp * row_bytes(spec.n_embd, q) + spec.n_embd * row_bytes(spec.n_ff_exp, q)


# --------------------------------------------------------------------------- Q4_K

def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Quantize float rows to ``block_q4_K`` bytes.

    ``x`` has shape ``(..., n)`` with ``n`` a multiple of 256; the result is
    ``uint8`` of shape ``(..., n // 256 * 144)``, the layout that
    ``gguf.quants.dequantize(result, Q4_K)`` and ggml read. Each 256-value
    super-block holds 8 sub-blocks of 32 with ``x ~= d*sc[j]*q - dmin*m[j]``,
    ``q`` in 0..15, ``sc``/``m`` in 0..63. The fit is min/max per sub-block
    (not ggml's iterative search): relative RMS error is about 8% on normal
    data. Raises :class:`ValueError` when ``n`` is not a multiple of 256.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % QK_K:
        raise ValueError(f"Q4_K row length {x.shape[-1] if x.ndim else 0} is not a multiple of {QK_K}; "
                         f"accepted: {QK_K}, {2 * QK_K}, ...")
    out_shape = x.shape[:-1] + (x.shape[-1] // QK_K * 144,)
    b = x.reshape(-1, 8, 32)
    n = b.shape[0]

    lo = np.minimum(b.min(axis=-1), 0.0)              # (n, 8), <= 0
    hi = np.maximum(b.max(axis=-1), 0.0)
    scale = (hi - lo) / 15.0                           # per sub-block step
    mins = -lo                                         # >= 0
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = (mins.max(axis=-1) / 63.0).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    dmin32 = dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.rint(scale / d32), 0.0)
        m = np.where(dmin32 > 0, np.rint(mins / dmin32), 0.0)
    sc = np.clip(sc, 0, 63).astype(np.uint8)
    m = np.clip(m, 0, 63).astype(np.uint8)

    step = (d32 * sc.astype(np.float32))[..., None]     # (n, 8, 1)
    off = (dmin32 * m.astype(np.float32))[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.rint((b + off) / step), 0.0)
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(n, 4, 2, 32)
    qs = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(n, 128)

    scales = np.concatenate([
        (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
        (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4),
    ], axis=1).astype(np.uint8)

    blocks = np.concatenate([
        d.reshape(n, 1).view(np.uint8),
        dmin.reshape(n, 1).view(np.uint8),
        scales,
        qs,
    ], axis=1)
    return blocks.reshape(out_shape)


#: Elements :func:`quantize` hands gguf's quantizer per call (its own loop takes 16 rows at a time, and
#: its per-call cost was most of the 151,936-row embedding's).
QUANT_CHUNK = 1 << 20


def quantize(x: np.ndarray, qtype: QT) -> np.ndarray:
    """``x`` (float, rows along the last axis) stored as ``qtype``: F32, F16, Q8_0 or Q4_K; the bytes
    of ``gguf.quants.quantize`` (each block is quantized alone), from row chunks of about
    :data:`QUANT_CHUNK` elements."""
    if qtype == QT.Q4_K:
        return quantize_q4_k(x)
    x = np.asarray(x, dtype=np.float32)
    traits = getattr(gguf.quants, "_type_traits", {}).get(qtype)
    if traits is None or x.ndim < 2 or x.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return gguf.quants.quantize(x, qtype)
    rows = x.reshape(-1, x.shape[-1])
    step = max(1, QUANT_CHUNK // x.shape[-1])
    out = np.concatenate([traits.quantize_rows(rows[i:i + step]) for i in range(0, len(rows), step)])
    return out.reshape(*x.shape[:-1], out.shape[-1])


# --------------------------------------------------------------------------- vocab

VOCAB_FILE = "ggml-vocab-qwen2.gguf"


def default_vocab_path() -> Path:
    """``models/ggml-vocab-qwen2.gguf`` of the pinned llama.cpp tree.

    ``pip install .`` ships a copy in ``pybmoe/data/``; a source checkout uses the materialised
    tree under ``vendor/src/``. Raises :class:`FileNotFoundError` when neither exists (install
    pybmoe, run ``pybmoe vendor`` in the checkout, or pass ``vocab_path``).
    """
    shipped = Path(__file__).resolve().parent.parent / "data" / VOCAB_FILE
    if shipped.is_file():
        return shipped
    from ..build import vendor

    try:
        p = vendor.llama_cpp_dir() / "models" / VOCAB_FILE
    except vendor.VendorError as e:
        raise FileNotFoundError(f"vocab file {VOCAB_FILE} not found: pybmoe is neither installed with its "
                                f"data nor run from a checkout ({e}); pass vocab_path=") from e
    if not p.is_file():
        raise FileNotFoundError(
            f"vocab file {p} not found: run `pybmoe vendor` in the checkout or pass vocab_path=")
    return p


@dataclass(frozen=True)
class KV:
    """One GGUF metadata pair; strings are raw ``bytes`` so nothing is re-encoded."""

    key: str
    value: Any            # scalar, bytes, or a list of them for an ARRAY
    vtype: VT
    sub_type: VT | None   # element type of an ARRAY, else None


@dataclass(frozen=True)
class TensorInfo:
    """One GGUF tensor header: ``shape`` is in ggml order (``ne0`` first), ``offset`` in bytes from the file start."""

    name: str
    shape: tuple[int, ...]
    qtype: QT
    offset: int


@dataclass(frozen=True)
class Metadata:
    """The header of a GGUF file: its key/value pairs and tensor infos, in file order."""

    kvs: dict[str, KV]
    tensors: list[TensorInfo]


_SCALAR = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I",
           VT.INT32: "<i", VT.FLOAT32: "<f", VT.BOOL: "<?", VT.UINT64: "<Q", VT.INT64: "<q",
           VT.FLOAT64: "<d"}
_NUMPY = {VT.UINT8: "<u1", VT.INT8: "<i1", VT.UINT16: "<u2", VT.INT16: "<i2", VT.UINT32: "<u4",
          VT.INT32: "<i4", VT.FLOAT32: "<f4", VT.BOOL: "?", VT.UINT64: "<u8", VT.INT64: "<i8",
          VT.FLOAT64: "<f8"}


def split_files(path: str | os.PathLike) -> list[Path]:
    """The files of a GGUF: ``[path]``, or every shard of a split GGUF given its first file
    (``<prefix>-00001-of-0000N.gguf``, the ``split.count`` key; llama.cpp's ``gguf-split`` names).

    Raises :class:`FileNotFoundError` naming a missing shard, :class:`ValueError` for a file that
    is not GGUF, or a split whose first file is not named as llama.cpp names shards.
    """
    path = Path(path)
    kvs = read_metadata(path).kvs
    n = int(kvs["split.count"].value) if "split.count" in kvs else 1
    if n <= 1:
        return [path]
    m = re.fullmatch(r"(.*)-(\d{5})-of-(\d{5})\.gguf", path.name)
    if not m or int(m.group(3)) != n or int(kvs["split.no"].value if "split.no" in kvs else 0) != 0:
        raise ValueError(f"{path} is shard {int(kvs['split.no'].value) + 1 if 'split.no' in kvs else '?'} of a "
                         f"{n}-file split GGUF but is not named <prefix>-00001-of-{n:05d}.gguf; pass the first file")
    files = [path.with_name(f"{m.group(1)}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f}: shard of the split GGUF {path} is missing")
    return files


def read_metadata(path: str | os.PathLike) -> Metadata:
    """Parse the header of a little-endian GGUF (v2/v3) file: every key/value and tensor info.

    A fast stand-in for ``gguf.GGUFReader`` (which takes ~13 s on the 151,936-token
    Qwen2 vocab): values come back as plain Python scalars, ``bytes`` and lists.
    Raises :class:`ValueError` for a file that is not GGUF v2/v3, or whose header is cut off (a
    truncated file). Only the header is read: :func:`check_complete` checks the tensor data.
    """
    # note: mapped, not read: a 100 GB model's header costs only the pages it touches
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{path} is not a GGUF file (too short); accepted: a GGUF v2/v3 file")
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse_header(path, data)
    except (struct.error, IndexError) as e:
        raise ValueError(f"{path}: the GGUF header is cut off ({e}; the file has {size} bytes): the file is "
                         "truncated (an interrupted download or copy?)") from None


def _parse_header(path: str | os.PathLike, data: mmap.mmap) -> Metadata:
    """:func:`read_metadata`'s parser over the mapped file ``data``."""
    pos = 0

    def unpack(fmt: str) -> Any:
        nonlocal pos
        v = struct.unpack_from(fmt, data, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def string() -> bytes:
        nonlocal pos
        n = unpack("<Q")
        s = data[pos:pos + n]
        pos += n
        return s

    def value(vt: VT) -> Any:
        if vt == VT.STRING:
            return string()
        return unpack(_SCALAR[vt])

    if data[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (magic {data[:4]!r}); accepted: b'GGUF'")
    pos = 4
    version = unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported; accepted: 2, 3")
    n_tensors, n_kv = unpack("<Q"), unpack("<Q")
    kvs: dict[str, KV] = {}
    for _ in range(n_kv):
        key = string().decode("utf-8")
        vt = VT(unpack("<I"))
        if vt != VT.ARRAY:
            kvs[key] = KV(key, value(vt), vt, None)
            continue
        sub, n = VT(unpack("<I")), unpack("<Q")
        if sub == VT.ARRAY:
            raise ValueError(f"{path}: nested array in {key} is not supported")
        if sub == VT.STRING:
            items = [string() for _ in range(n)]
        else:
            dt = np.dtype(_NUMPY[sub])
            items = np.frombuffer(data, dt, n, pos).tolist()
            pos += n * dt.itemsize
        kvs[key] = KV(key, items, vt, sub)
    tensors = []
    for _ in range(n_tensors):
        name = string().decode("utf-8")
        n_dims = unpack("<I")
        shape = tuple(unpack("<Q") for _ in range(n_dims))
        qtype = QT(unpack("<I"))
        tensors.append(TensorInfo(name, shape, qtype, unpack("<Q")))
    align = kvs["general.alignment"].value if "general.alignment" in kvs else gguf.GGUF_DEFAULT_ALIGNMENT
    start = -(-pos // align) * align
    tensors = [TensorInfo(t.name, t.shape, t.qtype, start + t.offset) for t in tensors]
    return Metadata(kvs, tensors)


def tensor_nbytes(info: TensorInfo) -> int:
    """Bytes of one tensor's data in the file (its elements over its type's blocks)."""
    block, size = gguf.GGML_QUANT_SIZES[info.qtype]
    n = 1
    for d in info.shape:
        n *= int(d)
    return n // block * size


def check_complete(path: str | os.PathLike, meta: Metadata | None = None) -> None:
    """Checks that every tensor's data of the GGUF file ``path`` (one file: a shard of a split GGUF is
    checked on its own) lies within the file, as llama.cpp checks at load. ``meta``: its header, when
    already read.

    Raises:
        ValueError: the file is truncated (the message names the first tensor past its end, the
            byte it needs and the file's size), or is not a GGUF file.
    """
    meta = read_metadata(path) if meta is None else meta
    size = os.stat(path).st_size
    for t in meta.tensors:
        end = t.offset + tensor_nbytes(t)
        if end > size:
            raise ValueError(f"{path} is truncated: the data of tensor {t.name!r} ends at byte {end}, past the end "
                             f"of the file ({size} bytes; {end - size} missing): the model is incomplete (an "
                             "interrupted download or copy?), and llama.cpp refuses it too")


class ModelFileError(ValueError):
    """A path that is not a complete GGUF file: missing, a folder, unreadable, empty, not GGUF, or
    truncated. The message names the path and what is wrong with it, in one line."""


def check_gguf(path: str | os.PathLike) -> Metadata:
    """Checks that ``path`` is a complete GGUF file, as llama.cpp would load it (every shard of a
    split GGUF given by its first file), and returns its header. Only the header is read, so a check
    costs milliseconds whatever the model's size.

    Raises :class:`ModelFileError` (a :class:`ValueError`) naming the path and what is wrong: it does
    not exist, is a folder or not a regular file, cannot be read, is empty, is not a GGUF file, has
    its header cut off, misses a shard, or is truncated (a tensor's data past its end).
    """
    p = Path(os.fspath(path))
    accepted = "accepted: a GGUF file"
    try:
        st = os.stat(p)
    except FileNotFoundError:
        where = p.parent if str(p.parent) not in ("", ".") else Path(".")
        why = "no such file" if where.is_dir() else f"no such file (the folder {where} does not exist)"
        raise ModelFileError(f"{p}: {why}; {accepted}") from None
    except OSError as e:
        raise ModelFileError(f"{p}: cannot be read ({(e.strerror or str(e)).lower()}); {accepted}") from None
    if p.is_dir():
        raise ModelFileError(f"{p} is a directory; {accepted} (the first file of a split GGUF)")
    if not p.is_file():
        raise ModelFileError(f"{p} is not a regular file; {accepted}")
    if st.st_size == 0:
        raise ModelFileError(f"{p} is empty (0 bytes; an interrupted download or copy?); {accepted}")
    if not os.access(p, os.R_OK):
        raise ModelFileError(f"{p}: cannot be read (permission denied); {accepted}")
    try:
        meta = read_metadata(p)
        for f in split_files(p):
            check_complete(f, meta if f == p else None)
    except (ValueError, OSError) as e:
        raise ModelFileError(str(e)) from None
    return meta


@dataclass(frozen=True)
class MoeShape:
    """The MoE shape of any GGUF model, read from its header.

    Units: ``n_layer`` blocks, ``n_expert`` experts per MoE layer, ``n_expert_used``
    experts routed per token (top-k), ``n_embd`` elements.
    """

    arch: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    n_embd: int


def read_spec(path: str | os.PathLike) -> MoeShape:
    """The :class:`MoeShape` of the GGUF at ``path``.

    Raises:
        ValueError: the file is not a MoE model (no ``<arch>.expert_count``).
    """
    kvs = read_metadata(path).kvs

    def get(key: str) -> Any:
        return kvs[key].value if key in kvs else None

    arch = get("general.architecture")
    arch = arch.decode() if isinstance(arch, bytes) else str(arch)
    n_expert = get(f"{arch}.expert_count")
    if not n_expert:
        raise ValueError(f"{path} is not a MoE model: it has no {arch}.expert_count")
    return MoeShape(arch, int(get(f"{arch}.block_count")), int(n_expert),
                    int(get(f"{arch}.expert_used_count")), int(get(f"{arch}.embedding_length")))


def read_tensor(path: str | os.PathLike, info: TensorInfo) -> np.ndarray:
    """The raw data of one tensor as a read-only array: numpy shape is ``reversed(info.shape)``,
    with the last axis in bytes for quantized types (what ``gguf.quants.dequantize`` takes)."""
    block, size = gguf.GGML_QUANT_SIZES[info.qtype]
    np_shape = list(reversed(info.shape))
    if info.qtype in (QT.F32, QT.F16):
        dtype = np.float32 if info.qtype == QT.F32 else np.float16
    else:
        dtype = np.uint8
        np_shape[-1] = np_shape[-1] // block * size
    return np.memmap(path, dtype=dtype, mode="r", offset=info.offset, shape=tuple(np_shape))


def copy_with_tensor_values(src: str | os.PathLike, dst: str | os.PathLike, suffix: str, value: float) -> Path:
    """Copy the model ``src`` to ``dst`` with every F32 tensor whose name ends in ``suffix`` set to
    ``value`` (for tests that check a tensor is really read: a scale set to 1, a bias set to 0).

    Raises :class:`ValueError` when no tensor matches or a match is not F32."""
    dst = Path(shutil.copy(src, dst))
    hits = [t for t in read_metadata(dst).tensors if t.name.endswith(suffix)]
    if not hits or any(t.qtype != QT.F32 for t in hits):
        raise ValueError(f"{src}: tensors ending in {suffix!r} must exist and be F32; got "
                         f"{[(t.name, t.qtype.name) for t in hits]}")
    for t in hits:
        m = np.memmap(dst, dtype=np.float32, mode="r+", offset=t.offset, shape=tuple(reversed(t.shape)))
        m[:] = value
        m.flush()
        del m
    return dst


@functools.lru_cache(maxsize=4)
def _tokenizer_kvs_cached(path: str, mtime_ns: int, size: int) -> tuple[KV, ...]:
    meta = read_metadata(path)
    out = tuple(kv for key, kv in meta.kvs.items() if key.startswith("tokenizer."))
    if "tokenizer.ggml.tokens" not in meta.kvs:
        raise ValueError(f"vocab file {path} has no tokenizer.ggml.tokens; accepted: a GGUF vocab file")
    return out


def tokenizer_kvs(vocab_path: str | os.PathLike) -> tuple[KV, ...]:
    """Every ``tokenizer.*`` pair of a GGUF vocab file, in file order (cached per path and mtime)."""
    p = Path(vocab_path)
    if not p.is_file():
        raise FileNotFoundError(f"vocab file {p} not found")
    st = p.stat()
    return _tokenizer_kvs_cached(str(p.resolve()), st.st_mtime_ns, st.st_size)


def _n_vocab(kvs: Sequence[KV]) -> int:
    for kv in kvs:
        if kv.key == "tokenizer.ggml.tokens":
            return len(kv.value)
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- writer

def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    a = rng.standard_normal(shape, dtype=np.float32)
    a *= np.float32(std)
    return a


def attention_plan(spec: ModelSpec, p: str) -> list[tuple[str, tuple[int, ...], QT]]:
    """The qwen3-style attention block of layer prefix ``p`` (``"blk.N."``): norm, q/k/v/output
    and the per-head q/k norms, plus ``ffn_norm``."""
    q, E = spec.qtype, spec.n_embd
    nq, nkv = spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    return [
        (p + "attn_norm.weight", (E,), QT.F32),
        (p + "attn_q.weight", (E, nq), q),
        (p + "attn_k.weight", (E, nkv), q),
        (p + "attn_v.weight", (E, nkv), q),
        (p + "attn_output.weight", (nq, E), _fit(q, nq)),
        (p + "attn_q_norm.weight", (spec.head_dim,), QT.F32),
        (p + "attn_k_norm.weight", (spec.head_dim,), QT.F32),
        (p + "ffn_norm.weight", (E,), QT.F32),
    ]


def _plan_qwen3moe(spec: ModelSpec, n_vocab: int) -> list[tuple[str, tuple[int, ...], QT]]:
    q = spec.qtype
    E, F, X = spec.n_embd, spec.n_ff_exp, spec.n_expert
    plan: list[tuple[str, tuple[int, ...], QT]] = [
        ("token_embd.weight", (E, n_vocab), embd_qtype(spec)),
        ("output_norm.weight", (E,), QT.F32),
    ]
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        plan += attention_plan(spec, p)
        if spec.arch == "qwen3":  # dense FFN of n_ff_exp
            plan += [
                (p + "ffn_gate.weight", (E, F), q),
                (p + "ffn_up.weight", (E, F), q),
                (p + "ffn_down.weight", (F, E), _fit(q, F)),
            ]
            continue
        plan += [
            (p + "ffn_gate_inp.weight", (E, X), QT.F32),
            (p + "ffn_gate_exps.weight", (E, F, X), q),
            (p + "ffn_up_exps.weight", (E, F, X), q),
            (p + "ffn_down_exps.weight", (F, E, X), q),
        ]
    return plan


def _kvs_qwen3moe(spec: ModelSpec, w: "gguf.GGUFWriter") -> None:
    if spec.arch == "qwen3":
        w.add_feed_forward_length(spec.n_ff_exp)
    else:
        w.add_feed_forward_length(spec.n_ff_exp * spec.n_expert_used)
        w.add_expert_feed_forward_length(spec.n_ff_exp)
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(spec.n_expert_used)


@dataclass(frozen=True)
class ArchDef:
    """How :func:`write_model` writes one llama.cpp architecture.

    ``plan(spec, n_vocab)`` gives every tensor as ``(name, ggml shape (ne0 first), type)`` in file
    order; ``add_kvs(spec, writer)`` adds the architecture's own metadata (the shared keys: context,
    embedding and block lengths, heads, key/value lengths, RoPE base, RMS epsilon and the
    tokenizer are written for every architecture); ``init(name, ggml_shape, rng)`` may return a
    tensor's float32 values (numpy shape = reversed ggml shape) or ``None`` for the default
    (normal, std ``1/sqrt(fan_in)``; norms 1); ``validate(spec)`` raises :class:`ValueError` for
    shapes the architecture cannot take; ``moe`` is False for a dense architecture.
    """

    name: str
    plan: Callable[["ModelSpec", int], list[tuple[str, tuple[int, ...], QT]]]
    add_kvs: Callable[["ModelSpec", Any], None]
    init: Callable[[str, tuple[int, ...], np.random.Generator], np.ndarray | None] | None = None
    validate: Callable[["ModelSpec"], None] | None = None
    #: ``(head_count_kv, key_length, value_length)`` for the shared attention keys, when the
    #: architecture defines them otherwise than ``(n_head_kv, head_dim, head_dim)`` (deepseek2's MLA)
    attention_lengths: Callable[["ModelSpec"], tuple[int, int, int]] | None = None
    moe: bool = True
    doc: str = ""


#: Architectures :func:`write_model` can write, by GGUF ``general.architecture`` name.
ARCHES: dict[str, ArchDef] = {
    "qwen3moe": ArchDef("qwen3moe", _plan_qwen3moe, _kvs_qwen3moe,
                        doc="separate gate/up/down experts, SiLU gate, softmax router"),
    "qwen3": ArchDef("qwen3", _plan_qwen3moe, _kvs_qwen3moe, moe=False,
                     doc="dense (no experts), for the cache's non-MoE path"),
}


def register_arch(arch: ArchDef) -> ArchDef:
    """Add ``arch`` to :data:`ARCHES` (the architecture modules under :mod:`pybmoe.models.archs` call it)."""
    ARCHES[arch.name] = arch
    return arch


def tensor_plan(spec: ModelSpec, n_vocab: int) -> list[tuple[str, tuple[int, ...], QT]]:
    """``(name, ggml shape (ne0 first), type)`` of every tensor, in file order."""
    return ARCHES[spec.arch].plan(spec, n_vocab)


def _std(name: str, shape: tuple[int, ...]) -> float | None:
    """Init std of a tensor (``None``: a norm, all ones)."""
    if name.endswith("norm.weight"):
        return None
    fan_in = shape[0]
    if name.endswith("ffn_gate_inp.weight"):
        return 2.0 / np.sqrt(fan_in)   # wider router: non-degenerate top-k
    return 1.0 / np.sqrt(fan_in)


#: (id of a value, how it is packed) -> (the value, its packed bytes): see :class:`_Writer`.
_PACKED: dict[tuple, tuple[Any, bytes]] = {}


class _Writer(gguf.GGUFWriter):
    """``gguf.GGUFWriter`` that packs each large array value once per process. The vocab's tokenizer
    arrays (151,936 tokens and as many merges in the pinned vocab) are the same objects in every model a
    process writes (:func:`tokenizer_kvs` is cached), and packing them again took a third of the
    default model's write; the bytes are gguf's own."""

    def _pack_val(self, val: Any, vtype: gguf.GGUFValueType, add_vtype: bool,
                  sub_type: gguf.GGUFValueType | None = None) -> bytes:
        if vtype != gguf.GGUFValueType.ARRAY or not isinstance(val, (list, tuple)) or len(val) < 4096:
            return super()._pack_val(val, vtype, add_vtype, sub_type=sub_type)
        key = (id(val), add_vtype, sub_type)
        hit = _PACKED.get(key)
        if hit is None or hit[0] is not val:
            if len(_PACKED) >= 16:
                _PACKED.clear()
            hit = _PACKED[key] = (val, bytes(super()._pack_val(val, vtype, add_vtype, sub_type=sub_type)))
        return hit[1]


def write_model(spec: ModelSpec, path: str | os.PathLike, *, vocab_path: str | os.PathLike | None = None,
                split_max_tensors: int = 0) -> Path:
    """Write the model described by ``spec`` to ``path`` (atomically) and return it.

    ``split_max_tensors`` > 0 writes a split GGUF of at most that many tensors per file, named as
    llama.cpp's ``gguf-split`` names them (``<stem>-00001-of-0000N.gguf`` next to ``path``); the
    first file's path is returned, which is what ``-m`` takes. Raises :class:`ValueError` for a
    negative ``split_max_tensors``.
    """
    path = Path(path)
    if split_max_tensors < 0:
        raise ValueError(f"split_max_tensors={split_max_tensors}: expected 0 (one file) or a tensor count > 0")
    kvs = tokenizer_kvs(vocab_path if vocab_path is not None else default_vocab_path())
    n_vocab = _n_vocab(kvs)
    arch = spec.arch
    rng = np.random.default_rng(spec.seed)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmpdir = None
    if split_max_tensors:
        # the shards are named after the path they are written to: write them under their final
        # names in a private folder, then move each into place
        tmpdir = path.parent / f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}.split"
        tmpdir.mkdir()
        tmp = tmpdir / path.name
    else:
        tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    w = _Writer(tmp, arch, split_max_tensors=split_max_tensors)
    try:
        w.add_name(f"pybmoe-{spec.name}")
        w.add_file_type(int(_FILE_TYPE[spec.ftype]))
        if spec.ftype != "F16":
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_context_length(spec.n_ctx_train)
        w.add_embedding_length(spec.n_embd)
        w.add_block_count(spec.n_layer)
        ARCHES[arch].add_kvs(spec, w)
        w.add_head_count(spec.n_head)
        lengths = ARCHES[arch].attention_lengths
        n_head_kv, key_length, value_length = (lengths(spec) if lengths is not None
                                               else (spec.n_head_kv, spec.head_dim, spec.head_dim))
        w.add_head_count_kv(n_head_kv)
        w.add_key_length(key_length)
        w.add_value_length(value_length)
        w.add_rope_freq_base(ROPE_FREQ_BASE)
        w.add_layer_norm_rms_eps(RMS_EPS)
        for kv in kvs:
            w.add_key_value(kv.key, kv.value, kv.vtype, sub_type=kv.sub_type)

        for name, shape, qtype in tensor_plan(spec, n_vocab):
            np_shape = tuple(reversed(shape))
            data = ARCHES[arch].init(name, shape, rng) if ARCHES[arch].init is not None else None
            if data is None:
                std = _std(name, shape)
                data = np.ones(np_shape, np.float32) if std is None else _normal(rng, np_shape, std)
            elif data.shape != np_shape or data.dtype != np.float32:
                raise AssertionError(f"{arch} init of {name}: got {data.dtype} {data.shape}, want float32 {np_shape}")
            if qtype == QT.F32:
                w.add_tensor(name, data)
            elif qtype == QT.F16:
                w.add_tensor(name, data.astype(np.float16))
            else:
                w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
            del data

        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        if tmpdir is None:
            os.replace(tmp, path)
        else:
            shards = sorted(tmpdir.iterdir())
            for shard in shards:
                os.replace(shard, path.parent / shard.name)
            tmpdir.rmdir()
            path = path.parent / shards[0].name
    except BaseException:
        w.close()
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


_SHAPE_KEYS = tuple(f.name for f in fields(ModelSpec) if f.name not in ("arch", "ftype", "seed"))


def make_model(path: str | os.PathLike, *, arch: str = "qwen3moe", ftype: str = "Q8_0", seed: int = 0,
               vocab_path: str | os.PathLike | None = None, **shape: int) -> Path:
    """Generate a model and write it to ``path``; return ``path``.

    ``shape`` takes the :class:`ModelSpec` shape fields (``n_layer=4,
    n_expert=16, n_expert_used=4, n_embd=256, n_ff_exp=256, n_head=4,
    n_head_kv=2, head_dim=64, n_ctx_train=4096``). At the defaults the file is
    about 71 MiB (F16), 59 MiB (Q8_0) or 52 MiB (Q4_K), written in ~2 s. ``vocab_path`` defaults
    to :func:`default_vocab_path`.

    Raises :class:`ValueError` for a bad shape/ftype/arch, :class:`TypeError`
    for an unknown shape keyword, :class:`FileNotFoundError` for a missing vocab.
    """
    unknown = sorted(set(shape) - set(_SHAPE_KEYS))
    if unknown:
        raise TypeError(f"unknown shape argument(s) {', '.join(unknown)}; accepted: {', '.join(_SHAPE_KEYS)}")
    spec = ModelSpec(arch=arch, ftype=ftype, seed=seed, **shape)
    return write_model(spec, path, vocab_path=vocab_path)


def cache_dir() -> Path:
    """Where :func:`default_model_path` keeps models: ``$PYBMOE_CACHE/models``,
    else ``$XDG_CACHE_HOME/pybmoe/models``, else ``~/.cache/pybmoe/models``."""
    if os.environ.get("PYBMOE_CACHE"):
        return Path(os.environ["PYBMOE_CACHE"]) / "models"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pybmoe" / "models"


def cached_model_file(spec: ModelSpec) -> Path:
    """Where :func:`cached_model_path` keeps the model of ``spec`` (whether or not it is written yet).

    The name carries the spec and :data:`GENERATOR_VERSION`, so a changed
    generator writes a new file.
    """
    return cache_dir() / f"pybmoe-{spec.name}-g{GENERATOR_VERSION}.gguf"


def cached_model_path(spec: ModelSpec) -> Path:
    """The model of ``spec``, generated into :func:`cache_dir` on first use (:func:`cached_model_file`)."""
    path = cached_model_file(spec)
    if not path.is_file():
        write_model(spec, path)
    return path


def default_model_path(ftype: str = "Q8_0") -> Path:
    """The default-shape model for ``ftype`` (see :func:`cached_model_path`).
    Raises :class:`ValueError` for an unknown ftype."""
    return cached_model_path(ModelSpec(ftype=ftype))


#: The granite-3.0-1b-a400m routing shape (24 MoE layers, 32 experts, top-8; the bundled trace in
#: ``pybmoe/data``) at the tiny default widths: the cache sees the real layer/expert/top-k shape.
GRANITE_TRACE_SPEC = ModelSpec(n_layer=24, n_expert=32, n_expert_used=8)
