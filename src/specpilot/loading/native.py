"""Native GGUF weights: a model whose projections, LM head and embedding run on the file's blocks.

Weights modes (:func:`choose_weights`). ``load_model(weights=...)`` takes ``fp32`` (dequantize
the file, today's oneDNN path with its Hugging Face parity), ``native`` or ``auto`` (the default:
native for a GGUF file on CPU float32 when the kernels build, else fp32). Where native cannot
run (no compiler, a failed build; ``native`` asked for off CPU float32) a one-line note says why
and the fp32 path loads; a Hugging Face directory is always fp32.

:func:`load_native` builds the model without the fp32 detour: the Transformer is constructed on
the ``meta`` device (no storage), the small fp32 tensors (norms, biases) are dequantized and
assigned, and every projection (q/k/v fused when they share a block type, o, gate/up fused
likewise, down), the LM head and the token embedding become
:class:`~specpilot.kernels.GGUFLinear` / :class:`~specpilot.kernels.GGUFEmbedding` modules over
the file's raw blocks (a lookup dequantizes only the rows it reads). :func:`to_native` performs
the same swap, in place, on a model already loaded in fp32 (same modules, same bits). Every native
linear follows the kernels' numerics contract, so rows are batch-invariant by construction. Q/K
rows are un-permuted as whole block rows (llama.cpp permutes rows, never splits one). A 2-D
tensor whose block type has no kernel is dequantized and runs through the dense F32 kernel (same
order); each such tensor is named in the returned notes.

Memory. The blocks are copied off the read-only map once and the map is dropped: fused q/k/v
and gate/up and Llama's un-permuted Q/K are new tensors anyway, and pages of a map read during
the load would stay resident beside those copies (and a map faults if the file is replaced while
it runs). So the loaded model holds about the file's bytes. fp32 copies are made only on demand:
``GGUFLinear.weight`` / ``GGUFEmbedding.weight`` dequantize the whole matrix on first access and
keep it (vocab x dim x 4 bytes each: 113 MB for SmolLM2's embedding). The trained drafters use
the modules in place and never ask (:meth:`specpilot.drafters.feature_net.FeatureNet.attach`);
what still asks: drafter training (its gradient needs the dense head), and a reduced draft
vocabulary on a native draft model (``Transformer.set_head_rows``). A tied LM head shares the
embedding's copy. :func:`fp32_copy_bytes` counts them.

Header cache. Parsing a GGUF header (49k-token vocabulary and merges) with ``gguf.GGUFReader``
takes seconds, so the first native load of a file writes its config, tokenizer and tensor table
(type, shape, data offset) into a small cache entry next to the converted-model ones
(:mod:`specpilot.loading.cache`, ``<entry>-native``: no weights); later loads read those and map
the file's tensor data directly. A cache that cannot be written only costs the parse next time.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quant_shape_to_byte_shape
from torch import Tensor

from specpilot import kernels
from specpilot.config import ModelConfig
from specpilot.errors import ModelLoadError
from specpilot.kernels.linear import QTYPES, row_bytes
from specpilot.loading import cache, hf
from specpilot.loading.gguf_file import (
    _PARSE_ERRORS,
    fp32_tensor,
    hf_name,
    read_header,
    read_metadata,
    tensor_shapes,
    unpermute_qk,
)
from specpilot.model import Transformer
from specpilot.tokenizer import Tokenizer

WEIGHTS = ("fp32", "native", "auto")
"""``load_model(weights=...)``; ``auto`` is the default (see the module docstring)."""

Rows = tuple[np.ndarray, int, int, int]
"""(uint8 block rows (n, row_bytes), GGML type id, n, k)."""

_ELEMS = {QTYPES[q]: GGML_QUANT_SIZES[GGMLQuantizationType[q]][0] for q in QTYPES}
"""Elements per block of every type the kernels run."""
_BLOCK_WEIGHTS = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")
"""Our names of the tensors that stay in blocks (every other tensor is loaded in fp32)."""


def choose_weights(
    weights: str, gguf: bool, device: str | torch.device, dtype: torch.dtype
) -> tuple[str, tuple[str, ...]]:
    """``("native" | "fp32", notes)`` for a load with ``weights`` (see the module docstring)."""
    if weights not in WEIGHTS:
        raise ModelLoadError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if weights == "fp32" or not gguf:
        return "fp32", ()
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        if weights == "auto":
            return "fp32", ()
        return "fp32", ("native GGUF weights need CPU float32; using the fp32 weights",)
    reason = kernels.unavailable_reason()
    if reason is not None:
        return "fp32", (f"{reason}; using the fp32 weights",)
    return "native", ()


class TiedHead(kernels.GGUFLinear):
    """The LM head of a tied model: the embedding's blocks, and its fp32 copy when asked. When
    the int8 profile packs the shared blocks, the embedding's lookup is told (it then reads each
    row from its unpacked pair)."""

    tied: tuple[kernels.GGUFEmbedding, ...] = ()

    def _set_packed(self, on: bool) -> None:
        super()._set_packed(on)
        for emb in self.tied:
            emb.qcode = self.qcode

    @property
    def weight(self) -> Tensor:
        return self.tied[0].weight

    def tie(self, embedding: kernels.GGUFEmbedding) -> None:
        self.tied = (embedding,)  # a tuple: not registered as a second submodule
        embedding.qcode = self.qcode


def _rows(t: Any, heads: int | None, notes: list[str]) -> Rows:
    """The block rows of reader tensor ``t`` (un-permuted over ``heads`` when given), as a numpy
    array that may still be a view of the file's map (:func:`_linear` copies it off once)."""
    shape = [int(s) for s in t.shape.tolist()]
    if len(shape) != 2:
        raise ModelLoadError(f"tensor {t.name}: expected 2 dimensions, got {len(shape)}")
    k, n = shape
    qtype = int(t.tensor_type)
    try:
        if kernels.supports(qtype):
            rows = np.asarray(t.data).view(np.uint8).reshape(-1)
            rb = row_bytes(qtype, k) if k % _ELEMS.get(qtype, 1) == 0 else -1
            if rows.size != n * rb:
                raise ModelLoadError(f"tensor {t.name}: truncated or corrupt block data: "
                                     f"{rows.size} bytes for a ({n}, {k}) tensor")  # fmt: skip
            rows = rows.reshape(n, rb)
        else:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(n, k)
            rows = np.ascontiguousarray(w).view(np.uint8)
            notes.append(f"{t.name}: {t.tensor_type.name} has no native kernel, dequantized")
            qtype = QTYPES["F32"]
    except (*_PARSE_ERRORS, NotImplementedError) as e:
        raise ModelLoadError(f"tensor {t.name}: corrupt block data: {e}") from None
    if heads is not None:
        rows = rows[unpermute_qk(np.arange(n), heads)]
    return rows, qtype, n, k


def _linear(parts: list[Rows], bias: Tensor | None, name: str) -> kernels.GGUFLinear:
    """One GGUFLinear over the rows of ``parts`` stacked (they share type and k), copied off
    the file's map once."""
    if len(parts) > 1:
        blocks = np.concatenate([p[0] for p in parts])
    else:
        blocks = parts[0][0] if parts[0][0].flags.owndata else parts[0][0].copy()
    n = sum(p[2] for p in parts)
    return kernels.GGUFLinear(torch.from_numpy(blocks), parts[0][1], n, parts[0][3], bias,
                              name=name)  # fmt: skip


def _fusable(parts: list[Rows]) -> bool:
    return len({(p[1], p[3]) for p in parts}) == 1


def _check_shape(got: tuple[int, int], old: Any, name: str) -> None:
    want = tuple(old.weight.shape)
    if got != want:
        raise ModelLoadError(f"tensor {name}: shape {got} does not match the model's {want}")


def _attention(att: Any, get: Any, i: int, heads: tuple[int, int] | None) -> None:
    names = [f"blk.{i}.attn_{x}.weight" for x in ("q", "k", "v")]
    parts = [get(names[0], heads and heads[0]), get(names[1], heads and heads[1]),
             get(names[2], None)]  # fmt: skip
    mods = [att.q_proj, att.k_proj, att.v_proj]
    for p, m, nm in zip(parts, mods, names, strict=True):
        _check_shape((p[2], p[3]), m, nm)
    biases = [m.bias for m in mods]
    if _fusable(parts):
        bias = None if biases[0] is None else torch.cat(biases)
        att.qkv = _linear(parts, bias, names[0])
        del att.q_proj, att.k_proj, att.v_proj
    else:  # mixed types: one fused call over the three (the same bits as three calls)
        att.qkv = kernels.GGUFMultiLinear(
            [_linear([p], b, nm) for p, b, nm in zip(parts, biases, names, strict=True)]
        )
        del att.q_proj, att.k_proj, att.v_proj
    name = f"blk.{i}.attn_output.weight"
    o = get(name, None)
    _check_shape((o[2], o[3]), att.o_proj, name)
    att.o_proj = _linear([o], att.o_proj.bias, name)


def _mlp(mlp: Any, get: Any, i: int) -> None:
    names = [f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"]
    parts = [get(nm, None) for nm in names]
    for p, m, nm in zip(parts, (mlp.gate_proj, mlp.up_proj), names, strict=True):
        _check_shape((p[2], p[3]), m, nm)
    if _fusable(parts):
        mlp.gate_up = _linear(parts, None, names[0])
        del mlp.gate_proj, mlp.up_proj
    else:
        pairs = zip(parts, names, strict=True)
        mlp.gate_up = kernels.GGUFMultiLinear([_linear([p], None, nm) for p, nm in pairs])
        del mlp.gate_proj, mlp.up_proj
    name = f"blk.{i}.ffn_down.weight"
    d = get(name, None)
    _check_shape((d[2], d[3]), mlp.down_proj, name)
    mlp.down_proj = _linear([d], None, name)


def _swap(model: Transformer, tensors: dict[str, Any], arch: str, path: Path) -> list[str]:
    """Install the native modules over ``tensors`` (GGUF name -> reader tensor) in ``model``."""
    notes: list[str] = []

    def get(name: str, heads: int | None) -> Rows:
        if name not in tensors:
            raise ModelLoadError(f"{path}: tensor {name} is missing")
        return _rows(tensors[name], heads, notes)

    cfg = model.cfg
    heads = (cfg.n_heads, cfg.n_kv_heads) if arch == "llama" else None
    for i, layer in enumerate(model.model.layers):
        _attention(layer.self_attn, get, i, heads)
        _mlp(layer.mlp, get, i)
    emb = get("token_embd.weight", None)
    _check_shape((emb[2], emb[3]), model.model.embed_tokens, "token_embd.weight")
    table = emb[0] if emb[0].flags.owndata else emb[0].copy()
    embedding = kernels.GGUFEmbedding(torch.from_numpy(table), emb[1], emb[2], emb[3],
                                      "token_embd.weight")  # fmt: skip
    head = emb if "output.weight" not in tensors else get("output.weight", None)
    _check_shape((head[2], head[3]), model.lm_head, "output.weight")
    if head is emb:  # tied: one set of blocks, one fp32 copy if a drafter asks
        model.lm_head = TiedHead(embedding.blocks, head[1], head[2], head[3], None,
                                 name="output.weight")  # fmt: skip
        model.lm_head.tie(embedding)
    else:
        model.lm_head = _linear([head], None, "output.weight")
    model.model.embed_tokens = embedding
    model.native = True
    return notes


def _open(path: Path) -> tuple[dict[str, Any], str]:
    try:
        reader = GGUFReader(path, "r")
        arch = read_metadata(reader)["general.architecture"]
        return {t.name: t for t in reader.tensors}, arch
    except _PARSE_ERRORS as e:
        raise ModelLoadError(f"corrupt or unreadable GGUF file {path}: {e}") from None


def to_native(model: Transformer, path: Path) -> tuple[str, ...]:
    """Swap the projections, LM head and embedding of ``model`` (loaded in fp32 from ``path``)
    for native ones over the file's blocks, in place. Returns notes: tensors that had to be
    dequantized, or, when nothing was swapped (kernels unavailable, not CPU fp32), the reason."""
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return ("native GGUF weights need CPU float32; using the fp32 weights",)
    if model.prepacked:
        raise ModelLoadError("to_native needs a model that was not prepacked")
    reason = kernels.unavailable_reason()
    if reason is not None:
        return (f"{reason}; using the fp32 weights",)
    tensors, arch = _open(path)
    return tuple(_swap(model, tensors, arch, path))


def load_native(
    path: Path, cache_dir: str | Path | None = None
) -> tuple[Transformer, Tokenizer, ModelConfig, tuple[str, ...]]:
    """(model, tokenizer, config, notes) of GGUF file ``path`` with native weights, built without
    an fp32 copy of any block tensor (the kernels must be available: :func:`choose_weights`).
    ``cache_dir``: the header cache's root (see the module docstring)."""
    listed, cfg, tokenizer, arch = _header(path, cache_dir)
    shapes = tensor_shapes(listed)
    tensors = {t.name: t for t in listed}
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    small: dict[str, Tensor] = {}
    for t in listed:
        name = hf_name(t.name, arch)
        if name is None or name not in expected:
            raise ModelLoadError(f"{path}: GGUF tensor {t.name} has no counterpart in our model")
        if name.endswith(_BLOCK_WEIGHTS):
            continue
        if shapes[t.name] != expected[name]:
            raise ModelLoadError(f"tensor {t.name}: shape {shapes[t.name]} does not match the "
                                 f"model's {expected[name]}")  # fmt: skip
        small[name] = fp32_tensor(t, shapes[t.name], cfg, arch, path)
    model.load_state_dict(small, strict=False, assign=True)
    notes = _swap(model, tensors, arch, path)
    left = [n for n, v in (*model.named_parameters(), *model.named_buffers()) if v.is_meta]
    if left:
        raise ModelLoadError(f"{path}: GGUF file lacks {len(left)} tensors (e.g. {left[0]})")
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer, cfg, tuple(notes)


def release_heap() -> None:
    """Hand the heap a native load freed (header parse, tokenizer build, block copies'
    temporaries) back to the OS: glibc keeps freed arenas mapped (~10 MB resident for SmolLM2,
    ~135 MB for Gemma's 262k-token vocabulary). :func:`specpilot.loading.load_model` calls it
    once the model is loaded. A no-op where libc has no ``malloc_trim``."""
    import contextlib
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def fp32_copy_bytes(model: Transformer) -> int:
    """Bytes of the fp32 copies that native modules made on demand (``.weight`` of a
    GGUFLinear / GGUFEmbedding, asked for by a drafter sharing the head or embedding)."""
    seen: dict[int, int] = {}
    for mod in model.modules():
        dense = getattr(mod, "_dense", None)
        if isinstance(mod, (kernels.GGUFLinear, kernels.GGUFEmbedding)) and dense is not None:
            seen[dense.untyped_storage().data_ptr()] = dense.untyped_storage().nbytes()
    return sum(seen.values())


# -- header cache ----------------------------------------------------------------------------------

_TABLE = "tensors.json"
_ENTRY_FILES = (hf.CONFIG_FILE, "tokenizer.json", "tokenizer_config.json", _TABLE)
_Q = GGMLQuantizationType
_ITEM = {_Q.F16: np.float16, _Q.F32: np.float32, _Q.F64: np.float64, _Q.I8: np.int8,
         _Q.I16: np.int16, _Q.I32: np.int32, _Q.I64: np.int64}  # fmt: skip
"""The types gguf.GGUFReader maps as numbers; every other type is mapped as bytes."""


@dataclass(frozen=True)
class _Tensor:
    """The fields of ``gguf.ReaderTensor`` the loader reads, over the file's mapped bytes."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    data: np.ndarray


def _header(path: Path, cache_dir: str | Path | None) -> tuple[list[Any], ModelConfig,
                                                                Tokenizer, str]:  # fmt: skip
    """:func:`~specpilot.loading.gguf_file.read_header`, through the header cache."""
    try:
        entry = cache.cache_entry(path, cache_dir)
    except OSError as e:
        raise ModelLoadError(f"cannot stat {path}: {e}") from None
    entry = entry.with_name(entry.name + "-native")
    if cache.is_complete(entry, _ENTRY_FILES):
        try:
            return _cached(path, entry)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged entry: parse the file again (and rewrite the entry)
    listed, cfg, tokenizer, arch = read_header(path)
    table = [{"name": t.name, "type": int(t.tensor_type), "shape": [int(d) for d in t.shape],
              "offset": int(t.data_offset)} for t in listed]  # fmt: skip

    def write(tmp: Path) -> None:
        (tmp / hf.CONFIG_FILE).write_text(json.dumps(cfg.to_hf(), indent=2), encoding="utf-8")
        tokenizer.save(tmp)
        (tmp / _TABLE).write_text(json.dumps({"arch": arch, "tensors": table}), encoding="utf-8")

    try:
        if entry.exists():
            shutil.rmtree(entry)
        cache.write_atomic(entry, write)
    except OSError:
        pass  # a read-only cache: parse again next time
    return listed, cfg, tokenizer, arch


def _cached(path: Path, entry: Path) -> tuple[list[Any], ModelConfig, Tokenizer, str]:
    cfg, _ = hf.read_config(entry)
    tokenizer = hf.read_tokenizer(entry, cfg)
    table = json.loads((entry / _TABLE).read_text(encoding="utf-8"))
    data = np.memmap(path, mode="r")
    tensors = []
    for t in table["tensors"]:
        kind = GGMLQuantizationType(int(t["type"]))
        dims = np.array(t["shape"], dtype=np.uint64)
        count = int(np.prod(dims))
        block, size = GGML_QUANT_SIZES[kind]
        shape: tuple[int, ...] = tuple(int(d) for d in reversed(t["shape"]))
        item = _ITEM.get(kind, np.uint8)
        if item is np.uint8:
            shape, count = quant_shape_to_byte_shape(shape, kind), count * size // block
        start = int(t["offset"])
        end = start + count * np.dtype(item).itemsize
        if end > data.size:
            raise ValueError(f"tensor {t['name']} runs past the end of {path}")
        view = data[start:end].view(item).reshape(shape)
        tensors.append(_Tensor(str(t["name"]), kind, dims, view))
    return tensors, cfg, tokenizer, str(table["arch"])
