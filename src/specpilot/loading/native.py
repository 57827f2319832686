"""Native GGUF weights (``load_model(..., weights="native")``): projections over the file's blocks.

:func:`to_native` takes a model loaded the usual way from a GGUF file and swaps, in place, every
projection (q/k/v fused when they share a block type, o, gate/up fused likewise, down) and the
LM head for :class:`~specpilot.kernels.GGUFLinear` modules over the file's raw blocks, and the
token embedding for a :class:`~specpilot.kernels.GGUFEmbedding` (a lookup dequantizes only the
rows it reads). Every native linear follows the kernels' numerics contract, so rows are
batch-invariant by construction. Q/K rows are un-permuted as whole block rows (llama.cpp permutes
rows, never splits one). A 2-D tensor whose block type has no kernel is dequantized and runs
through the dense F32 kernel (same order); each such tensor is named in the returned notes.
Norms and biases stay as loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from torch import Tensor

from specpilot import kernels
from specpilot.errors import ModelLoadError
from specpilot.kernels.linear import QTYPES
from specpilot.loading.gguf_file import _PARSE_ERRORS, read_metadata, unpermute_qk
from specpilot.model import Transformer

Rows = tuple[Tensor, int, int, int]
"""(uint8 block rows (n, row_bytes), GGML type id, n, k)."""


def _rows(t: Any, heads: int | None, notes: list[str]) -> Rows:
    """The block rows of reader tensor ``t`` (un-permuted over ``heads`` when given)."""
    shape = [int(s) for s in t.shape.tolist()]
    if len(shape) != 2:
        raise ModelLoadError(f"tensor {t.name}: expected 2 dimensions, got {len(shape)}")
    k, n = shape
    qtype = int(t.tensor_type)
    try:
        if kernels.supports(qtype):
            raw = np.array(t.data, copy=True).view(np.uint8).reshape(-1)  # off the read-only map
            rows = kernels.check_blocks(torch.from_numpy(raw), qtype, n, k, t.name).view(n, -1)
        else:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(n, k)
            rows = torch.from_numpy(np.ascontiguousarray(w)).view(torch.uint8)
            notes.append(f"{t.name}: {t.tensor_type.name} has no native kernel, dequantized")
            qtype = QTYPES["F32"]
    except (*_PARSE_ERRORS, NotImplementedError) as e:
        raise ModelLoadError(f"tensor {t.name}: corrupt block data: {e}") from None
    if heads is not None:
        rows = rows[torch.from_numpy(unpermute_qk(np.arange(n), heads))]
    return rows.contiguous(), qtype, n, k


def _linear(parts: list[Rows], bias: Tensor | None, name: str) -> kernels.GGUFLinear:
    """One GGUFLinear over the rows of ``parts`` stacked (they share type and k)."""
    blocks = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
    n = sum(p[2] for p in parts)
    return kernels.GGUFLinear(blocks, parts[0][1], n, parts[0][3], bias, name=name)


def _fusable(parts: list[Rows]) -> bool:
    return len({(p[1], p[3]) for p in parts}) == 1


def _check(new: kernels.GGUFLinear, old: Any, name: str) -> None:
    want = tuple(old.weight.shape)
    if (new.out_features, new.in_features) != want:
        raise ModelLoadError(f"tensor {name}: shape {(new.out_features, new.in_features)} "
                             f"does not match the model's {want}")  # fmt: skip


def _attention(att: Any, get: Any, i: int, heads: tuple[int, int] | None) -> None:
    names = [f"blk.{i}.attn_{x}.weight" for x in ("q", "k", "v")]
    parts = [get(names[0], heads and heads[0]), get(names[1], heads and heads[1]),
             get(names[2], None)]  # fmt: skip
    mods = [att.q_proj, att.k_proj, att.v_proj]
    for p, m, nm in zip(parts, mods, names, strict=True):
        if (p[2], p[3]) != tuple(m.weight.shape):
            raise ModelLoadError(f"tensor {nm}: shape {(p[2], p[3])} does not match the model's "
                                 f"{tuple(m.weight.shape)}")  # fmt: skip
    biases = [m.bias for m in mods]
    if _fusable(parts):
        bias = None if biases[0] is None else torch.cat(biases)
        att.qkv = _linear(parts, bias, names[0])
        del att.q_proj, att.k_proj, att.v_proj
    else:
        att.q_proj, att.k_proj, att.v_proj = (
            _linear([p], b, nm) for p, b, nm in zip(parts, biases, names, strict=True)
        )
    name = f"blk.{i}.attn_output.weight"
    new = _linear([get(name, None)], att.o_proj.bias, name)
    _check(new, att.o_proj, name)
    att.o_proj = new


def _mlp(mlp: Any, get: Any, i: int) -> None:
    names = [f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"]
    parts = [get(nm, None) for nm in names]
    for p, m, nm in zip(parts, (mlp.gate_proj, mlp.up_proj), names, strict=True):
        if (p[2], p[3]) != tuple(m.weight.shape):
            raise ModelLoadError(f"tensor {nm}: shape {(p[2], p[3])} does not match the model")
    if _fusable(parts):
        mlp.gate_up = _linear(parts, None, names[0])
        del mlp.gate_proj, mlp.up_proj
    else:
        pairs = zip(parts, names, strict=True)
        mlp.gate_proj, mlp.up_proj = (_linear([p], None, nm) for p, nm in pairs)
    name = f"blk.{i}.ffn_down.weight"
    new = _linear([get(name, None)], None, name)
    _check(new, mlp.down_proj, name)
    mlp.down_proj = new


def to_native(model: Transformer, path: Path) -> tuple[str, ...]:
    """Swap ``model``'s projections, LM head and embedding for native ones over ``path``'s
    blocks (in place). Returns notes: tensors that had to be dequantized, or, when nothing was
    swapped (kernels unavailable, not CPU fp32), the one-line reason."""
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return ("native GGUF weights need CPU float32; using the fp32 weights",)
    if model.prepacked:
        raise ModelLoadError("to_native needs a model that was not prepacked")
    reason = kernels.unavailable_reason()
    if reason is not None:
        return (f"{reason}; using the fp32 weights",)
    try:
        reader = GGUFReader(path, "r")
        arch = read_metadata(reader)["general.architecture"]
        tensors = {t.name: t for t in reader.tensors}
    except _PARSE_ERRORS as e:
        raise ModelLoadError(f"corrupt or unreadable GGUF file {path}: {e}") from None
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
    head = emb if "output.weight" not in tensors else get("output.weight", None)
    new_head = _linear([head], None, "output.weight")
    _check(new_head, model.lm_head, "output.weight")
    model.lm_head = new_head
    model.model.embed_tokens = kernels.GGUFEmbedding(emb[0], emb[1], emb[2], emb[3],
                                                     "token_embd.weight")  # fmt: skip
    model.native = True
    return tuple(notes)
