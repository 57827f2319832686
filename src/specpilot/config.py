"""Model architecture config for the Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM2) and
Gemma 3 (text), and the position numerics it implies (RoPE frequencies, the sliding-window mask).

One frozen dataclass, built from a Hugging Face ``config.json`` dict or from GGUF metadata and
validated at the edge: bad values raise :class:`ConfigError` with an actionable message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from specpilot.errors import ConfigError

#: HF ``model_type`` -> our architecture name. All share the Llama block; the flags below differ.
ARCHITECTURES: dict[str, str] = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
}

LAYER_TYPES = ("full_attention", "sliding_attention")
"""Per-layer attention kinds (the Hugging Face ``layer_types`` spelling)."""

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder."""

    arch: str
    """One of :data:`ARCHITECTURES` values."""
    vocab_size: int
    dim: int
    """Hidden size."""
    n_layers: int
    n_heads: int
    n_kv_heads: int
    """Grouped-query attention: ``n_heads`` must be a multiple of it."""
    intermediate_size: int
    head_dim: int = 0
    """0 means ``dim // n_heads``."""
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    """HF ``rope_scaling`` as sorted (key, value) pairs (hashable); empty = plain RoPE."""
    max_position: int = 4096
    tie_embeddings: bool = False
    qkv_bias: bool = False
    """Qwen2 has biases on q/k/v projections."""
    qk_norm: bool = False
    """Qwen3 applies an RMSNorm per head to q and k before RoPE."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    layer_types: tuple[str, ...] = ()
    """Gemma 3: one of :data:`LAYER_TYPES` per layer; empty = every layer is full attention."""
    sliding_window: int = 0
    """Keys a sliding-attention query sees: positions ``(p - sliding_window, p]``."""
    rope_local_theta: float = 10000.0
    """RoPE base of the sliding layers (plain RoPE; ``rope_scaling`` is the global layers')."""
    query_pre_attn_scalar: float = 0.0
    """Attention scores are scaled by ``query_pre_attn_scalar ** -0.5``; 0 = ``head_dim``."""
    final_logit_softcap: float = 0.0
    """Gemma's ``tanh`` cap on the logits; 0 = none."""

    @property
    def gemma(self) -> bool:
        """Gemma block: (1 + w) norms, four per block, GeGLU (tanh), scaled embeddings."""
        return self.arch == "gemma3"

    def sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            if self.n_heads <= 0 or self.dim % self.n_heads:
                raise ConfigError(
                    f"hidden size {self.dim} is not divisible by {self.n_heads} heads"
                )
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"model config: {name} must be positive, got {getattr(self, name)}"
                )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model config: {self.n_heads} attention heads are not a multiple of "
                f"{self.n_kv_heads} key/value heads"
            )
        if self.head_dim % 2:
            raise ConfigError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.layer_types and (
            len(self.layer_types) != self.n_layers or not set(self.layer_types) <= set(LAYER_TYPES)
        ):
            raise ConfigError(
                f"model config: layer_types must list {self.n_layers} entries of "
                f"{', '.join(LAYER_TYPES)}, got {list(self.layer_types)}"
            )
        if "sliding_attention" in self.layer_types and self.sliding_window <= 0:
            raise ConfigError("model config: sliding layers need a positive sliding_window")
        rtype = self.rope_type
        if rtype not in ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope_scaling type {rtype!r}; supported: {', '.join(ROPE_TYPES)}"
            )

    @property
    def rope_type(self) -> str:
        d = dict(self.rope_scaling)
        return str(d.get("rope_type", d.get("type", "default")))

    @property
    def n_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        attn = self.dim * self.head_dim * (self.n_heads * 2 + self.n_kv_heads * 2)
        mlp = 3 * self.dim * self.intermediate_size
        emb = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        norms = (4 if self.gemma else 2) * self.dim + (2 * self.head_dim if self.qk_norm else 0)
        return self.n_layers * (attn + mlp + norms) + emb + self.dim

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict."""
        mtype = d.get("model_type")
        if mtype == "gemma3":
            raise ConfigError(
                "multimodal Gemma 3 (Gemma3ForConditionalGeneration) is not supported; use a "
                "text-only checkpoint (model_type gemma3_text, Gemma3ForCausalLM) or its GGUF"
            )
        if mtype not in ARCHITECTURES:
            raise ConfigError(
                f"unknown architecture {mtype!r} (config.json model_type); "
                f"supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        try:
            n_heads = int(d["num_attention_heads"])
            gemma = _gemma_fields(d) if mtype == "gemma3_text" else {}
            rope_scaling = gemma.pop("rope_full", None) or (
                d.get("rope_scaling") or d.get("rope_parameters") or {}
            )
            rope_theta = float(d.get("rope_theta", rope_scaling.get("rope_theta", 10000.0)))
            rope_scaling = {k: v for k, v in rope_scaling.items() if k != "rope_theta"}
            if rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
                rope_scaling = {}
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                arch=ARCHITECTURES[mtype],
                vocab_size=int(d["vocab_size"]),
                dim=int(d["hidden_size"]),
                n_layers=int(d["num_hidden_layers"]),
                n_heads=n_heads,
                n_kv_heads=int(d.get("num_key_value_heads") or n_heads),
                intermediate_size=int(d["intermediate_size"]),
                head_dim=int(d.get("head_dim") or 0),
                rms_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=tuple(sorted(rope_scaling.items())),
                max_position=int(d.get("max_position_embeddings", 4096)),
                tie_embeddings=bool(d.get("tie_word_embeddings", mtype == "gemma3_text")),
                qkv_bias=bool(d.get("attention_bias", mtype == "qwen2")),
                qk_norm=mtype in ("qwen3", "gemma3_text"),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
                **gemma,
            )
        except KeyError as e:
            raise ConfigError(f"config.json is missing required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config.json has a malformed field: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        """The equivalent Hugging Face ``config.json`` dict (used by the HF peer and tests)."""
        d: dict[str, Any] = {
            "model_type": "gemma3_text" if self.gemma else self.arch,
            "architectures": [
                {
                    "llama": "LlamaForCausalLM",
                    "mistral": "MistralForCausalLM",
                    "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM",
                    "gemma3": "Gemma3ForCausalLM",
                }[self.arch]
            ],
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "intermediate_size": self.intermediate_size,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
        }
        if self.rope_scaling:
            d["rope_scaling"] = dict(self.rope_scaling)
        d["attention_bias"] = self.qkv_bias
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = list(self.eos_token_ids)
        if self.gemma:
            d.update(_gemma_hf(self))
        return d


def _gemma_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 keys of a ``gemma3_text`` config.json as ModelConfig fields (plus ``rope_full``:
    the global layers' RoPE dict). Reads the transformers 5 ``rope_parameters`` per layer type
    and the older ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` spelling."""
    if d.get("attn_logit_softcapping") is not None:
        raise ConfigError("Gemma attention logit soft-capping is not supported")
    act = d.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"Gemma 3 with hidden_activation {act!r} is not supported")
    if d.get("use_bidirectional_attention"):
        raise ConfigError("bidirectional Gemma 3 (use_bidirectional_attention) is not supported")
    n = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if not types:
        pattern = int(d.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    rope = d.get("rope_parameters") or {}
    full = dict(rope.get("full_attention") or d.get("rope_scaling") or {})
    full.setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
    local = dict(rope.get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default":
        raise ConfigError("Gemma 3: scaled RoPE on the sliding layers is not supported")
    return {
        "rope_full": full,
        "layer_types": tuple(types),
        "sliding_window": int(d.get("sliding_window") or 0),
        "rope_local_theta": float(local.get("rope_theta", d.get("rope_local_base_freq", 1e4))),
        "query_pre_attn_scalar": float(d.get("query_pre_attn_scalar") or 0.0),
        "final_logit_softcap": float(d.get("final_logit_softcapping") or 0.0),
    }


def _gemma_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The Gemma 3 keys of :meth:`ModelConfig.to_hf` (transformers 5 and older spellings)."""
    full = {"rope_type": "default", **dict(cfg.rope_scaling), "rope_theta": cfg.rope_theta}
    qs = cfg.query_pre_attn_scalar or cfg.head_dim
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": list(cfg.layer_types),
        "sliding_window": cfg.sliding_window,
        "query_pre_attn_scalar": int(qs) if float(qs).is_integer() else qs,  # HF: an int
        "final_logit_softcapping": cfg.final_logit_softcap or None,
        "attn_logit_softcapping": None,
        "rope_local_base_freq": cfg.rope_local_theta,
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta},
        },
    }


def window_mask(
    mask: Tensor | None, positions: Tensor, slots: int | Tensor, kv_len: int, size: int, window: int
) -> Tensor:
    """``mask`` restricted to keys at positions ``> p - window`` for a query at position ``p``.

    By position, not slot: the keys this call writes (``slots``) are at ``positions`` (tree nodes:
    prefix length + depth); every other cached key is at its slot (the committed prefix, which
    the verify step keeps contiguous). ``size``: the cache's slot count. No data-dependent branch
    (CUDA graphs capture it): short contexts get a mask that excludes nothing.
    """
    b = positions.shape[0]
    kpos = torch.arange(size, device=positions.device).repeat(b, 1)  # (B, size)
    if isinstance(slots, int):
        kpos[:, slots : slots + positions.shape[1]] = positions
    elif slots.dim() == 1:
        kpos[:, slots] = positions
    else:
        kpos.scatter_(1, slots, positions)
    keep = kpos[:, None, :kv_len] > positions[:, :, None] - window  # (B, T, kv_len)
    return keep if mask is None else mask & keep


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> tuple[torch.Tensor, float]:
    """Inverse frequencies, fp32 ``(head_dim/2,)``, and the cos/sin scale ("attention factor").
    ``local``: the sliding layers' plain RoPE (base ``rope_local_theta``).

    Computed in fp32 with the same operation order as the Hugging Face reference so logits match
    bit for bit where the kernels allow. Scaling types: linear position interpolation
    (Chen et al. 2023), Llama 3.1 wavelength bands, YaRN (Peng et al. 2023).
    """
    hd = cfg.head_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    base = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    sc = dict(cfg.rope_scaling)
    rtype = cfg.rope_type
    if rtype == "default" or local:
        return base, 1.0
    factor = float(sc.get("factor", 1.0))
    if rtype == "linear":
        return base / factor, 1.0
    if rtype == "llama3":
        low = float(sc.get("low_freq_factor", 1.0))
        high = float(sc.get("high_freq_factor", 4.0))
        old_ctx = float(sc.get("original_max_position_embeddings", 8192))
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / base
        inv = torch.where(wavelen > low_wl, base / factor, base)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv / factor + smooth * inv
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(medium, smoothed, inv), 1.0
    # yarn
    old_ctx = float(sc.get("original_max_position_embeddings", cfg.max_position))
    beta_fast = float(sc.get("beta_fast", 32.0))
    beta_slow = float(sc.get("beta_slow", 1.0))
    mscale = sc.get("attention_factor")
    if mscale is None:
        mscale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def corr_dim(n_rot: float) -> float:
        return (hd * math.log(old_ctx / (n_rot * 2 * math.pi))) / (2 * math.log(cfg.rope_theta))

    lo = max(math.floor(corr_dim(beta_fast)), 0)
    hi = min(math.ceil(corr_dim(beta_slow)), hd - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(hd // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    extrap = 1 - ramp
    inv = (base / factor) * (1 - extrap) + base * extrap
    return inv, float(mscale)
