"""Gemma 3 GGUF files (llama.cpp arch ``gemma3``): tensor names, config keys, the norm shift and
the SentencePiece-style tokenizer.

Tensors. Gemma's block has four norms; llama.cpp names them ``attn_norm`` (input),
``post_attention_norm``, ``ffn_norm`` (pre-feedforward) and ``post_ffw_norm``. Its converter
(``convert_hf_to_gguf.py``, ``Gemma3Model.modify_tensors``) stores every ``*norm.weight`` as
``w + 1`` (Gemma scales by ``1 + w``), so we subtract 1, as transformers'
``Gemma2TensorProcessor`` does. Q and K are not permuted for Gemma.

Config. ``gemma3.attention.sliding_window``; llama.cpp fixes the rest for Gemma 3 text models
(``llama-model.cpp``): every 6th layer is global (the others slide), sliding layers use RoPE base
10,000 (``rope.freq_base_swa`` when the file has it), and queries are scaled by
``1/sqrt(head_dim)`` (``1/sqrt(hidden/heads)`` for the 62-layer 27B model).

Tokenizer. ``tokenizer.ggml.model == "llama"`` with token scores and types but no merges. Rebuilt
as transformers' GGUF loader does (``integrations/gguf/gguf_tokenizer_mapping.py``,
``gemma_tokenizer``): runs of spaces stored as real spaces are respelled with ``▁``, merges are
recovered from the vocabulary ordered by position in the file (Gemma's scores do not follow the
merge order), a byte-fallback BPE with ``GemmaTokenizer``'s normalizer, pre-tokenizer and
decoder; control tokens become special added tokens, user-defined ones (``\\n\\n``) plain added
tokens; BOS is prepended to plain prompts when ``add_bos_token`` says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from specpilot.errors import ModelLoadError
from specpilot.tokenizer import Tokenizer

ARCH = "gemma3"

#: GGUF block tensor -> our module, where Gemma differs from the Llama map.
BLOCK_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

_LLAMACPP_SWA_PATTERN = 6
_LLAMACPP_SWA_BASE = 10000.0


def shifts_norm(gguf_name: str) -> bool:
    """True for the tensors llama.cpp stored as ``w + 1`` (every Gemma norm weight)."""
    return gguf_name.endswith("norm.weight")


def config_fields(meta: dict[str, Any], n_layers: int, head_dim: int, dim: int) -> dict[str, Any]:
    """The Gemma-only :class:`~specpilot.config.ModelConfig` fields of a ``gemma3`` file."""
    a = ARCH
    pattern = meta.get(f"{a}.attention.sliding_window_pattern", _LLAMACPP_SWA_PATTERN)
    if isinstance(pattern, list):  # per layer: True = sliding
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [bool((i + 1) % int(pattern)) for i in range(n_layers)]
    n_heads = meta.get(f"{a}.attention.head_count")
    scalar = dim // int(n_heads) if n_layers == 62 and n_heads else head_dim
    return {
        "layer_types": tuple("sliding_attention" if s else "full_attention" for s in sliding),
        "sliding_window": int(meta.get(f"{a}.attention.sliding_window", 0)),
        "rope_local_theta": float(meta.get(f"{a}.rope.freq_base_swa", _LLAMACPP_SWA_BASE)),
        "query_pre_attn_scalar": float(scalar),
        "final_logit_softcap": float(meta.get(f"{a}.final_logit_softcapping") or 0.0),
    }


def generate_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary: every split of a token into two vocabulary pieces,
    best score first (transformers' ``tokenization_utils_base.generate_merges``, same order)."""
    merges: list[tuple[str, str, float]] = []
    for merge, score in scores.items():
        local = [
            (merge[:i], merge[i:], score)
            for i in range(1, len(merge))
            if merge[:i] in vocab and merge[i:] in vocab
        ]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _respell(token: str) -> str:
    return "\u2581" * len(token) if " " in token and not token.strip() else token


def tokenizer_from_gguf(meta: dict[str, Any], source: Path) -> Tokenizer:
    """Rebuild a Gemma GGUF's tokenizer (see the module docstring)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "llama":
        raise ModelLoadError(
            f"{source}: Gemma GGUF tokenizer type {kind!r} is not supported (expected 'llama', "
            "SentencePiece-style)"
        )
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ModelLoadError(f"{source}: GGUF metadata lacks tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    respelled = [_respell(t) for t in tokens]
    vocab = {t: i for i, t in enumerate(respelled)}
    positions = {t: -float(i) for i, t in enumerate(respelled)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else "<unk>"
    try:
        bpe = models.BPE(
            vocab=vocab,
            merges=generate_merges(vocab, positions),
            fuse_unk=True,
            unk_token=unk,
            byte_fallback=True,
        )
    except Exception as e:  # the Rust constructor raises a bare Exception
        raise ModelLoadError(f"{source}: inconsistent GGUF vocabulary: {e}") from None
    backend = HFTokenizer(bpe)
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    control = [t for t, ty in zip(tokens, types, strict=False) if ty == 3]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    known = backend.get_vocab(with_added_tokens=True)
    user = [t for t, ty in zip(tokens, types, strict=False) if ty == 4 and t in known]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True)) and bos_id is not None
    if add_bos:
        bos = tokens[bos_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    eos = [
        meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta
    ]
    return Tokenizer(
        backend,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_id=bos_id,
        eos_ids=eos,
        add_bos=add_bos,
    )
