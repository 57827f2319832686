"""GGUF files (llama.cpp): dequantize to fp32, rename to Hugging Face names, rebuild the tokenizer.

Weights. Every tensor is dequantized with ``gguf.quants.dequantize`` and renamed
(``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.q_proj.weight``, ...). llama.cpp's
converter permutes the rows of the Q and K projections of Llama-architecture models (llama.cpp
rotates interleaved pairs, Hugging Face rotates halves: ``convert_hf_to_gguf.py``,
``LlamaModel.permute``); :func:`unpermute_qk` undoes it, as transformers'
``LlamaTensorProcessor._reverse_permute_weights`` does. Qwen2/Qwen3 files are not permuted.
Gemma 3 (names, norm shift, config keys, tokenizer): :mod:`specpilot.loading.gemma_gguf`.

Config. From the ``<arch>.*`` keys (block_count, embedding_length, attention.head_count, ...);
the embedding is tied when the file has no ``output.weight``.

Tokenizer. Byte-level BPE (``tokenizer.ggml.model == "gpt2"``) rebuilt with the ``tokenizers``
library from ``tokenizer.ggml.tokens`` and ``merges``; the pre-tokenizer follows
``tokenizer.ggml.pre`` (llama.cpp ``llama-vocab.cpp``; transformers
``integrations/gguf/gguf_tokenizer_mapping.py``). Control tokens (type 3) become special added
tokens so ``<|im_start|>`` stays one id.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from torch import Tensor

from specpilot.config import ModelConfig
from specpilot.errors import ModelLoadError
from specpilot.loading import gemma_gguf
from specpilot.tokenizer import Tokenizer

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", gemma_gguf.ARCH)

_PARSE_ERRORS = (ValueError, OSError, IndexError, KeyError, EOFError, struct.error)
"""What GGUFReader / dequantize raise on a truncated or garbage file."""

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """Our (Hugging Face) parameter name for a GGUF tensor name; None if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    names = {**_BLOCK_NAMES, **gemma_gguf.BLOCK_NAMES} if arch == gemma_gguf.ARCH else _BLOCK_NAMES
    if m is None or m.group(2) not in names:
        return None
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute(w, n_head)`` on the rows of a Q or K weight (or bias).

    llama.cpp views the rows as ``(n_head, 2, head_dim/2)`` and swaps the last two axes, so each
    head's rows go from halves ``[x0..x(d/2-1), y0..y(d/2-1)]`` to pairs ``[x0, y0, x1, y1, ...]``.
    """
    rows = w.shape[0]
    assert rows % (2 * n_head) == 0, (w.shape, n_head)
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# -- metadata ------------------------------------------------------------------------------------


def _field_value(field: Any) -> Any:
    """A GGUF key's value as Python (str, int, float, bool, or a list of those)."""
    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        if len(types) > 1 and types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if not field.data:
            return []
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    value = field.parts[field.data[0]][0].item()
    return bool(value) if types[0] == GGUFValueType.BOOL else value


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    return {name: _field_value(field) for name, field in reader.fields.items()}


def _get(meta: dict[str, Any], key: str, source: Path) -> Any:
    if key not in meta:
        raise ModelLoadError(f"{source}: GGUF metadata lacks required key {key!r}")
    return meta[key]


def _scalar_heads(value: Any, key: str, source: Path) -> int:
    """Head counts may be stored per layer; we support only uniform ones."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ModelLoadError(f"{source}: per-layer {key} {sorted(set(value))} is not supported")
        value = value[0]
    return int(value)


def _rope_scaling(meta: dict[str, Any], arch: str, source: Path) -> dict[str, Any]:
    rtype = meta.get(f"{arch}.rope.scaling.type", "none")
    if rtype in ("none", None):
        return {}
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    if rtype == "linear":
        return {"rope_type": "linear", "factor": factor}
    if rtype == "yarn":
        d: dict[str, Any] = {"rope_type": "yarn", "factor": factor}
        orig = meta.get(f"{arch}.rope.scaling.original_context_length")
        if orig is not None:
            d["original_max_position_embeddings"] = int(orig)
        for k in ("beta_fast", "beta_slow"):
            v = meta.get(f"{arch}.rope.scaling.yarn_{k}")
            if v is not None:
                d[k] = float(v)
        return d
    raise ModelLoadError(f"{source}: unsupported GGUF rope scaling type {rtype!r}")


def config_from_gguf(
    meta: dict[str, Any], shapes: dict[str, tuple[int, ...]], source: Path
) -> ModelConfig:
    """``ModelConfig`` from GGUF metadata and tensor shapes (``shapes`` uses GGUF names)."""
    arch = _get(meta, "general.architecture", source)
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"{source}: unsupported GGUF architecture {arch!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    if "rope_freqs.weight" in shapes:
        raise ModelLoadError(
            f"{source}: per-dimension RoPE factors (rope_freqs, Llama 3.1 scaling) are not "
            "supported from GGUF; load the Hugging Face model directory instead"
        )
    name = str(meta.get("general.name", "")).lower()
    ours = "mistral" if arch == "llama" and "mistral" in name else arch
    n_heads = _scalar_heads(
        _get(meta, f"{arch}.attention.head_count", source), "head_count", source
    )
    n_kv = _scalar_heads(
        meta.get(f"{arch}.attention.head_count_kv", n_heads), "head_count_kv", source
    )
    if "token_embd.weight" not in shapes:
        raise ModelLoadError(f"{source}: GGUF file has no token_embd.weight tensor")
    tok = "tokenizer.ggml."
    eos = [
        meta[tok + k] for k in ("eos_token_id", "eot_token_id", "eom_token_id") if tok + k in meta
    ]
    head_dim = int(meta.get(f"{arch}.attention.key_length", 0))
    dim = int(_get(meta, f"{arch}.embedding_length", source))
    n_layers = int(_get(meta, f"{arch}.block_count", source))
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != (head_dim or dim // n_heads):
        raise ModelLoadError(
            f"{source}: partial rotary embeddings (rope.dimension_count "
            f"{rope_dims}) are not supported"
        )
    gemma = {}
    if arch == gemma_gguf.ARCH:
        gemma = gemma_gguf.config_fields(meta, n_layers, head_dim or dim // n_heads, dim)
    return ModelConfig(
        arch=ours,
        vocab_size=int(shapes["token_embd.weight"][0]),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        intermediate_size=int(_get(meta, f"{arch}.feed_forward_length", source)),
        head_dim=head_dim,
        rms_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=tuple(sorted(_rope_scaling(meta, arch, source).items())),
        max_position=int(meta.get(f"{arch}.context_length", 4096)),
        tie_embeddings="output.weight" not in shapes,
        qkv_bias="blk.0.attn_q.bias" in shapes,
        qk_norm="blk.0.attn_q_norm.weight" in shapes,
        bos_token_id=meta.get(tok + "bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos)),
        **gemma,
    )


# -- tokenizer -----------------------------------------------------------------------------------

#: tokenizer.ggml.pre -> split regex applied before byte-level encoding (llama-vocab.cpp).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = ("default", "gpt2", "gpt-2", "phi-2", "roberta-bpe")
_DIGITS_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b")
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx")
_QWEN2_PRE = ("qwen2", "deepseek-r1-qwen", "megrez")
SUPPORTED_PRE = _GPT2_PRE + _DIGITS_PRE + _LLAMA3_PRE + _QWEN2_PRE


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (byte-level BPE alphabet)."""
    bs = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def tokenizer_from_gguf(meta: dict[str, Any], source: Path) -> Tokenizer:
    """Rebuild the byte-level BPE tokenizer described by GGUF metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"{source}: GGUF tokenizer type {kind!r} is not supported (only byte-level BPE, "
            "'gpt2'); load the Hugging Face model directory instead"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in SUPPORTED_PRE:
        raise ModelLoadError(
            f"{source}: GGUF pre-tokenizer {pre!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_PRE)}"
        )
    tokens: list[str] = _get(meta, "tokenizer.ggml.tokens", source)
    merges_raw: list[str] = _get(meta, "tokenizer.ggml.merges", source)
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens outside the byte alphabet (rare mislabelled specials) are respelled byte by byte.
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ")) for m in merges_raw]
    if any(len(m) != 2 for m in merges):
        raise ModelLoadError(f"{source}: malformed tokenizer.ggml.merges entry")
    try:
        bpe = models.BPE(
            vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=pre in _LLAMA3_PRE
        )
    except Exception as e:  # the Rust constructor raises a bare Exception (e.g. unknown token)
        raise ModelLoadError(f"{source}: inconsistent GGUF vocabulary/merges: {e}") from None
    backend = HFTokenizer(bpe)
    if pre in _QWEN2_PRE:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    # 3 = CONTROL (<|im_start|>): special; 4 = USER_DEFINED (<think>): always matched whole.
    control = [t for t, ty in zip(tokens, types, strict=False) if ty == 3 and t in vocab]
    user = [t for t, ty in zip(tokens, types, strict=False) if ty == 4 and t in vocab]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    eos = [
        meta[k]
        for k in (
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        )
        if k in meta
    ]
    return Tokenizer(
        backend, chat_template=meta.get("tokenizer.chat_template"), bos_id=bos_id, eos_ids=eos
    )


# -- the whole file ------------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFContents:
    cfg: ModelConfig
    state: dict[str, Tensor]
    """HF-named fp32 tensors (no ``lm_head.weight`` when tied)."""
    tokenizer: Tokenizer


def _parse_failure(path: Path, err: Exception) -> str:
    """The error for a GGUF file GGUFReader cannot map: the first tensor whose data runs past the
    end of the file, when the tensor table is readable (numpy's own message says nothing)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    size = path.stat().st_size if path.exists() else 0
    found: list[tuple[str, int]] = []

    class _TableOnly(GGUFReader):
        def _build_tensors(self, start: int, fields: list[Any]) -> None:
            for f in fields:
                name, dims, kind, off = f.parts[1], f.parts[3], f.parts[4][0], f.parts[5][0]
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(kind))]
                end = int(start + off) + int(np.prod(dims)) * type_size // block
                found.append((bytes(name).decode("utf-8", "replace"), end))

    try:
        _TableOnly(path, "r")
    except Exception:  # the header or the tensor table itself is cut or garbage
        if "magic" in str(err).lower() or "version" in str(err).lower():
            return f"{path} is not a GGUF file this reader supports: {err}"
        return f"GGUF file {path} is truncated or corrupt: its header cannot be read ({size} bytes)"
    for name, end in found:
        if end > size:
            return (
                f"GGUF file {path} is truncated or corrupt: tensor {name} needs bytes up to "
                f"{end}, the file has {size}; download or convert the model again"
            )
    return f"corrupt or unreadable GGUF file {path}: {err}"


def read_header(path: Path) -> tuple[list[Any], ModelConfig, Tokenizer, str]:
    """A GGUF file's reader tensors (memory-mapped, nothing read yet), config, tokenizer and
    architecture. ModelLoadError names the file on any defect (a truncated tensor by name)."""
    try:
        reader = GGUFReader(path, "r")
        meta = read_metadata(reader)
        tensors = list(reader.tensors)
    except _PARSE_ERRORS as e:
        raise ModelLoadError(_parse_failure(path, e)) from None
    cfg = config_from_gguf(meta, tensor_shapes(tensors), path)
    arch = meta["general.architecture"]
    gemma = arch == gemma_gguf.ARCH
    tokenizer = (gemma_gguf.tokenizer_from_gguf if gemma else tokenizer_from_gguf)(meta, path)
    return tensors, cfg, tokenizer, arch


def tensor_shapes(tensors: list[Any]) -> dict[str, tuple[int, ...]]:
    """GGUF name -> shape in our (row-major, Hugging Face) order."""
    return {t.name: tuple(int(s) for s in reversed(t.shape.tolist())) for t in tensors}


def fp32_tensor(t: Any, shape: tuple[int, ...], cfg: ModelConfig, arch: str, path: Path) -> Tensor:
    """Reader tensor ``t`` dequantized to fp32 as our model holds it (Gemma norms shifted by -1,
    Llama Q/K rows un-permuted); ModelLoadError naming the tensor on corrupt data."""
    try:
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32, copy=True)
    except (*_PARSE_ERRORS, NotImplementedError) as e:
        raise ModelLoadError(
            f"corrupt GGUF file {path}: cannot dequantize {t.name} ({t.tensor_type.name}): {e}"
        ) from None
    if w.size != int(np.prod(shape)):  # the data ends before the header says
        raise ModelLoadError(
            f"GGUF file {path} is truncated or corrupt: tensor {t.name} has {w.size} values, "
            f"its header says {shape}; download or convert the model again"
        )
    w = w.reshape(shape)
    if arch == gemma_gguf.ARCH and gemma_gguf.shifts_norm(t.name):
        w = w - np.float32(1.0)
    if arch == "llama" and ".attn_q." in t.name:
        w = unpermute_qk(w, cfg.n_heads)
    elif arch == "llama" and ".attn_k." in t.name:
        w = unpermute_qk(w, cfg.n_kv_heads)
    return torch.from_numpy(w)


def read_gguf(path: Path) -> GGUFContents:
    """Parse, dequantize and convert a GGUF file. ModelLoadError names the file on any defect."""
    tensors, cfg, tokenizer, arch = read_header(path)
    shapes = tensor_shapes(tensors)
    state: dict[str, Tensor] = {}
    unknown = []
    for t in tensors:
        name = hf_name(t.name, arch)
        if name is None:
            unknown.append(t.name)
            continue
        state[name] = fp32_tensor(t, shapes[t.name], cfg, arch, path)
    if unknown:
        raise ModelLoadError(
            f"{path}: GGUF tensors with no counterpart in our model: {', '.join(unknown[:4])}"
        )
    return GGUFContents(cfg, state, tokenizer)
