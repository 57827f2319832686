"""Torch-only Llama-family decoder with a static KV cache and arbitrary attention masks.

In the spirit of gpt-fast's ``model.py``: a preallocated cache addressed by absolute slots,
``forward`` takes explicit positions (RoPE) and cache slots (where new K/V go), so the same call
serves prefill, one-token decode and tree verification (one row per draft node, an ancestor mask).

Numerics. Speculative decoding is lossless only if a verified row computes exactly what plain
decoding would; stock CPU kernels do not guarantee it (a GEMM row's bits depend on the rows in
the call, attention reductions on the key count). On CPU fp32 every row is made independent of
its batch by ``linear="onednn"`` (:mod:`specpilot.kernels.onednn`), or by the native GGUF kernels
and their fixed reduction order (:mod:`specpilot.kernels`), and by ``attention="fixed"`` (the
fp32 attention kernel of the same package: one fixed order per row, whatever the rows in the
call; the CPU default) or ``attention="exact"`` (fp64 cache and attention: rounded back to fp32
the result no longer depends on the summation order; masked keys add exact zeros; the fallback
without the kernels).

GPU paths (bf16/fp16) use the stock kernels; there token forcing still checks every output and
reports the logit margin where a near-tie flips.

Native steps (the row ops on, ``attention="fixed"``) run the lean forward of
:mod:`specpilot.kernels.step`: the same ops with the same bits, without the module glue.

Profiling: every kernel class runs in its named range (:mod:`specpilot.profiling`), in the
module forward and in the lean one alike, so a profile measures the forward that runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specpilot import kernels
from specpilot.config import ModelConfig, rope_inv_freq, window_mask
from specpilot.errors import ConfigError
from specpilot.kernels import rowops, step
from specpilot.kernels.attention import ops as attention_ops
from specpilot.kernels.linear import isa_code
from specpilot.kernels.onednn import PackedLinear, onednn_available
from specpilot.kernels.rowops import MLP, RMSNorm, qkv_stage
from specpilot.kernels.step import Packing
from specpilot.kvcache import KVCache
from specpilot.profiling import kernel_range

ATTENTION_KINDS = ("exact", "fixed", "sdpa")
LINEAR_KINDS = ("onednn", "torch")

class Attention(nn.Module):
    ROWOP = "rope_qk"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps, cfg.gemma) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps, cfg.gemma) if cfg.qk_norm else None
        qs = cfg.query_pre_attn_scalar
        self.scale = qs**-0.5 if qs else None  # None: SDPA's 1/sqrt(head_dim)
        self.qkv: PackedLinear | None = None
        self.rowop: tuple[Any, int] | None = None  # q/k norms + RoPE in one op (rowops.wire)
        self.cache: KVCache | None = None
        self.exact = False
        self.fixed: tuple[Any, float, int] | None = None
        """attention="fixed": (the specpilot::attention op, the fp32 scale, the ISA code)."""

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        slots: int | Tensor,
        kv_len: int,
        mask: Tensor | None,
        rows: slice | None = None,
        pack: Packing | None = None,
    ) -> Tensor:
        # x: (B, T, dim), or (1, R, dim) packed rows; cos/sin: (B, T, 1, head_dim) (packed
        # likewise); mask: (B, T, kv_len) bool or None, always in the padded layout
        b, t, _ = x.shape
        h = self.n_heads
        with kernel_range("qkv"):
            qk, v = qkv_stage(self, x, cos, sin)  # (B, T, H + Hk, hd) normed + rotated, v
        if pack is not None:  # linears ran on the real rows; attention on the padded layout
            qk, v = pack.unpack(qk), pack.unpack(v)
            b, t = pack.batch, pack.width
        q = qk[:, :, :h].transpose(1, 2)  # (B, H, T, hd)
        k = qk[:, :, h:].transpose(1, 2)  # (B, Hk, T, hd)
        v = v.transpose(1, 2)
        assert self.cache is not None, "call Transformer.setup_cache() first"
        with kernel_range("attention"):
            self.cache.write(slots, k, v, rows)
            r = slice(None) if rows is None else rows
            keys = self.cache.k[r, :, :kv_len]
            vals = self.cache.v[r, :, :kv_len]
            m = None if mask is None else mask.unsqueeze(1)  # (B, 1, T, kv_len)
            if self.fixed is not None:  # batch-invariant fp32 kernel (specpilot.kernels)
                op, scale, isa = self.fixed
                o = op(q, keys, vals, kv_len, mask, scale, isa)  # (B, H, T, hd)
            elif self.exact:
                o = F.scaled_dot_product_attention(
                    q.double(), keys, vals, attn_mask=m, enable_gqa=True, scale=self.scale
                ).to(x.dtype)
            else:
                o = F.scaled_dot_product_attention(
                    q, keys, vals, attn_mask=m, enable_gqa=True, scale=self.scale
                )
            o = o.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)  # (B, T, H*hd)
            if pack is not None:
                o = pack.pack(o)  # (1, R, H*hd)
        with kernel_range("o_proj"):
            return self.o_proj(o)


class Block(nn.Module):
    """Pre-norm block; Gemma adds a norm after attention and after the MLP (four in all)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gemma = cfg.gemma
        self.input_layernorm = RMSNorm(cfg.dim, cfg.rms_eps, cfg.gemma)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.rms_eps, cfg.gemma)
        if cfg.gemma:
            self.pre_feedforward_layernorm = RMSNorm(cfg.dim, cfg.rms_eps, True)
            self.post_feedforward_layernorm = RMSNorm(cfg.dim, cfg.rms_eps, True)
        self.mlp = MLP(cfg)
        self.ROWOP = None if cfg.gemma else "add_rms_norm"  # residual add + the next norm
        self.rowop: tuple[Any, int] | None = None

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        slots: int | Tensor,
        kv_len: int,
        mask: Tensor | None,
        rows: slice | None = None,
        pack: Packing | None = None,
    ) -> Tensor:
        with kernel_range("qkv"):
            a = self.input_layernorm(x)
        if self.gemma:
            a = self.self_attn(a, cos, sin, slots, kv_len, mask, rows, pack)
            with kernel_range("o_proj"):
                h = x + self.post_attention_layernorm(a)
            with kernel_range("gate_up"):
                a = self.pre_feedforward_layernorm(h)
            a = self.mlp(a)
            with kernel_range("down"):
                return h + self.post_feedforward_layernorm(a)
        if self.rowop is not None:  # the residual add and the next norm: one row op
            o = self.self_attn(a, cos, sin, slots, kv_len, mask, rows, pack)
            norm = self.post_attention_layernorm
            with kernel_range("gate_up"):
                h, a = self.rowop[0](o, x, norm.weight, norm.eps, False, self.rowop[1])
            return h + self.mlp(a)
        h = x + self.self_attn(a, cos, sin, slots, kv_len, mask, rows, pack)
        with kernel_range("gate_up"):
            a = self.post_attention_layernorm(h)
        return h + self.mlp(a)


@dataclass(frozen=True)
class ForwardOut:
    logits: Tensor | None
    """(B, R, vocab) for the requested rows (R = T unless ``logits_rows`` was given)."""
    hidden: tuple[Tensor, ...]
    """Requested hidden states, each (B, T, dim); index i < n_layers is the input of layer i,
    index n_layers is the final normed state (the Hugging Face ``hidden_states`` convention)."""


class Transformer(nn.Module):
    """Parameter names follow Hugging Face (``model.layers.0.self_attn.q_proj.weight``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        # a meta skeleton (the loaders) skips the init: normal_ on meta imports torch._dynamo
        meta = torch.empty(0).is_meta
        emb = torch.empty(cfg.vocab_size, cfg.dim) if meta else None
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=emb)
        self.model.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.model.norm = RMSNorm(cfg.dim, cfg.rms_eps, cfg.gemma)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self._sliding = tuple(cfg.sliding(i) for i in range(cfg.n_layers))
        self._local: tuple[Tensor, Tensor] | None = None  # sliding layers' RoPE tables
        self.max_len = 0
        self.batch = 0
        self.attention = "sdpa"
        self._cos: Tensor | None = None
        self._sin: Tensor | None = None
        self._head_plain: Tensor | None = None
        self._full_head: Tensor | None = None
        self.compiled: tuple[str, bool] | None = None
        """(scope, dynamic) of :meth:`compile_forward`, None when not compiled."""
        self._native = False
        self._plan: step.Plan | None = None  # the lean forward's view of the layers
        self.rowops = False
        """Norms, RoPE, residual + norm and the gated activation run as the C++ row ops
        (:mod:`specpilot.kernels.rowops`); on with native weights, see :meth:`set_rowops`."""

    @property
    def numerics(self) -> str:
        """Numerics profile of the native GGUF kernels: ``fp32`` (default) or ``int8``."""
        return str(self.__dict__.get("_numerics", "fp32"))

    def set_numerics(self, profile: str) -> None:
        """Run every native GGUF linear in numerics ``profile`` (:mod:`specpilot.kernels.int8`);
        ConfigError for an unknown profile, or ``int8`` on weights that are not native."""
        from specpilot.kernels.int8 import PROFILES
        from specpilot.kernels.linear import GGUFLinear

        if profile not in PROFILES:
            choices = ", ".join(PROFILES)
            raise ConfigError(f"numerics must be one of {choices}, got {profile!r}")
        if profile != "fp32" and not self.native:
            raise ConfigError(
                f"numerics {profile} runs on the native GGUF kernels: load a .gguf model with "
                "--weights native (these weights are dequantized fp32), or use --numerics fp32"
            )
        for mod in self.modules():
            if isinstance(mod, GGUFLinear):
                mod.profile = profile
        self._numerics = profile

    def tie_weights(self) -> None:
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def setup_cache(self, max_len: int, batch: int = 1, attention: str | None = None) -> None:
        """Allocate the KV cache and RoPE tables for ``max_len`` slots (reused if big enough)."""
        if attention is not None:
            if attention not in ATTENTION_KINDS:
                raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
            if attention != self.attention:
                self.max_len = 0
            self.attention = attention
        if max_len <= self.max_len and batch == self.batch:
            return
        cfg = self.cfg
        exact = self.attention == "exact"
        fixed = self._fixed_attention() if self.attention == "fixed" else None
        cache_dtype = torch.float64 if exact else self.dtype
        for layer in self.model.layers:
            layer.self_attn.cache = KVCache(
                batch, cfg.n_kv_heads, max_len, cfg.head_dim, cache_dtype, self.device
            )
            layer.self_attn.exact = exact
            att = layer.self_attn
            att.fixed = None if fixed is None else (fixed[0], att.scale or fixed[1], fixed[2])
        self._plan = None
        self._cos, self._sin = self._rope_tables(max_len, local=False)
        self._local = self._rope_tables(max_len, local=True) if any(self._sliding) else None
        self.max_len, self.batch = max_len, batch

    def _fixed_attention(self) -> tuple[Any, float, int]:
        """(op, default scale, ISA code) of ``attention="fixed"``: CPU fp32 and the kernels."""
        if self.device.type != "cpu" or self.dtype != torch.float32:
            raise ValueError("attention='fixed' runs on CPU float32 only")
        reason = kernels.unavailable_reason()
        if reason is not None:
            raise ValueError(f"attention='fixed' needs the native kernels: {reason}")
        return attention_ops().attention.default, self.cfg.head_dim**-0.5, isa_code()

    def _rope_tables(self, max_len: int, local: bool) -> tuple[Tensor, Tensor]:
        inv_freq, scale = rope_inv_freq(self.cfg, local)
        pos = torch.arange(max_len, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * scale).to(device=self.device, dtype=self.dtype)
        return cos, (emb.sin() * scale).to(device=self.device, dtype=self.dtype)

    def prepack(self, linear: str = "onednn") -> None:
        """Fuse q/k/v and gate/up and prepack all projections for oneDNN (CPU fp32 only).

        One-way: afterwards the module no longer has the per-projection Hugging Face weights.
        """
        if linear not in LINEAR_KINDS:
            raise ValueError(f"linear must be one of {LINEAR_KINDS}, got {linear!r}")
        if linear == "torch" or self.device.type != "cpu" or self.dtype != torch.float32:
            return
        if not onednn_available() or self._head_plain is not None or self.native:
            return
        for layer in self.model.layers:
            att, mlp = layer.self_attn, layer.mlp
            w = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
            bias = None
            if att.q_proj.bias is not None:
                bias = torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias])
            att.qkv = PackedLinear(w, bias)
            att.o_proj = PackedLinear(att.o_proj.weight, None)
            del att.q_proj, att.k_proj, att.v_proj
            mlp.gate_up = PackedLinear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), None)
            mlp.down_proj = PackedLinear(mlp.down_proj.weight, None)
            del mlp.gate_proj, mlp.up_proj
        self._head_plain = self.lm_head.weight
        self.lm_head = PackedLinear(self.lm_head.weight, None)
        self._plan = None

    @property
    def native(self) -> bool:
        """Projections run on GGUF blocks (specpilot.loading.native); prepack leaves them.
        Setting it also turns the row ops on or off (:meth:`set_rowops`)."""
        return self._native

    @native.setter
    def native(self, on: bool) -> None:
        self._native = bool(on)
        self.set_rowops(self._native)

    def set_rowops(self, on: bool) -> bool:
        """Run the norms, RoPE (with q/k norms), residual add + norm and the gated activation as
        the C++ row ops under their fixed order (on) or as the torch formulas (off). On needs CPU
        float32 and built kernels; returns whether they are on. The fp32 weights keep the torch
        formulas by default (their Hugging Face parity); native weights turn the ops on."""
        on = bool(on) and self.device.type == "cpu" and self.dtype == torch.float32
        self.rowops = on and rowops.available()
        rowops.wire(self.modules(), self.rowops)
        self._plan = None
        return self.rowops

    @property
    def prepacked(self) -> bool:
        """Whether :meth:`prepack` replaced the projections by oneDNN-packed ones (one-way)."""
        return self._head_plain is not None

    def set_head_rows(self, keep: int) -> None:
        """Compute logits for token ids ``[0, keep)`` only (a reduced draft vocabulary);
        reversible: the full head is kept and a later call may choose another ``keep``."""
        if self._full_head is None:
            self._full_head = self.head_weight()
        keep = min(keep, self._full_head.shape[0])
        w = self._full_head[:keep].contiguous()  # (keep, dim)
        if self.prepacked:
            self.lm_head = PackedLinear(w, None)
        else:
            head = nn.Linear(w.shape[1], keep, bias=False, device=w.device, dtype=w.dtype)
            head.weight = nn.Parameter(w, requires_grad=False)
            self.lm_head = head

    def compile_forward(self, scope: str, dynamic: bool) -> None:
        """torch.compile (Inductor) the decoder blocks (``scope="layers"``: one compile reused by
        every layer) or the whole forward (``"forward"``); prepacked linears stay eager. Once per
        model: a second call with other settings raises ValueError."""
        key = (scope, dynamic)
        if self.compiled == key:
            return
        if self.compiled is not None:
            raise ValueError(f"the model was compiled with {self.compiled} already")
        if scope not in ("layers", "forward"):
            raise ValueError(f"scope must be layers or forward, got {scope!r}")
        for mod in self.modules():
            if isinstance(mod, PackedLinear):  # oneDNN packed weights: not lowerable by Inductor
                mod.forward = torch.compiler.disable(mod.forward)
        if scope == "layers":
            for layer in self.model.layers:
                layer.forward = torch.compile(layer.forward, dynamic=dynamic)
        else:
            self.forward = torch.compile(self.forward, dynamic=dynamic)
        self.compiled = key

    def head_weight(self) -> Tensor:
        """The plain LM-head matrix ``(vocab, dim)`` (drafters that share it read it here)."""
        return self._head_plain if self._head_plain is not None else self.lm_head.weight

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        slots: int | Tensor,
        kv_len: int,
        mask: Tensor | None = None,
        logits_rows: Tensor | slice | None = None,
        hidden_layers: tuple[int, ...] = (),
        cache_rows: slice | None = None,
        pack: Packing | None = None,
    ) -> ForwardOut:
        """Run new tokens against the cache.

        tokens:    (B, T) token ids
        positions: (B, T) absolute positions (RoPE); tree nodes use prefix length + depth
        slots:     cache slots to write the new K/V to: an int (contiguous from it), (T,) long,
                   or (B, T) long (per-row slots: batched sequences of different lengths)
        kv_len:    attend to cache slots [0, kv_len)
        mask:      (B, T, kv_len) bool, True = may attend; None = every row sees all kv_len keys
        logits_rows: which of the T rows need logits (None = all); ``slice(0, 0)`` = none
        cache_rows: the B cache rows (batch entries) this call uses; None = all of them
        pack:      run every row-wise op on the real rows ``pack.index`` of the (B, T) layout
                   only (attention keeps the padded layout); logits and hidden states are then
                   (1, R, .) in packed order
        """
        assert self._cos is not None, "call setup_cache() first"
        assert tokens.shape == positions.shape, (tokens.shape, positions.shape)
        assert kv_len <= self.max_len, f"kv_len {kv_len} exceeds cache size {self.max_len}"
        ids, rope_pos = tokens, positions
        if pack is not None:  # (1, R): the real rows
            ids, rope_pos = pack.rows(tokens), pack.rows(positions)
        x = self.model.embed_tokens(ids)  # (B, T, dim) or (1, R, dim)
        if self.cfg.gemma:  # scaled in the model dtype, as Hugging Face does
            x = x * torch.tensor(self.cfg.dim**0.5).to(x.dtype)
        want = set(hidden_layers)
        plan = self._lean_plan()
        if plan is not None:  # the flat op sequence (kernels.step), the same bits
            call = step.call_inputs(self, positions, slots, kv_len, mask, cache_rows, pack)
            a, hidden = step.run(plan, x.view(-1, x.shape[-1]), call, want)
            x = a.view(x.shape)
            hidden = {i: h.view(x.shape) for i, h in hidden.items()}
        else:
            x, hidden = self._layers(x, rope_pos, positions, slots, kv_len, mask, cache_rows, pack,
                                     want)  # fmt: skip
        logits = None
        if not (isinstance(logits_rows, slice) and logits_rows == slice(0, 0)):
            rows = x if logits_rows is None else x[:, logits_rows]
            with kernel_range("lm_head"):
                logits = self.lm_head(rows).float()
                if self.cfg.final_logit_softcap:
                    cap = self.cfg.final_logit_softcap
                    logits = torch.tanh(logits / cap) * cap
        return ForwardOut(logits, tuple(hidden[i] for i in hidden_layers))

    def _lean_plan(self) -> step.Plan | None:
        """The lean forward's plan when it applies (row ops, fixed attention); it emits the
        kernel-class ranges itself when they are on (the cost model profiles the same ops)."""
        self._plan = step.current(self, self._plan)
        return self._plan

    def _layers(
        self, x: Tensor, rope_pos: Tensor, positions: Tensor, slots: int | Tensor, kv_len: int,
        mask: Tensor | None, cache_rows: slice | None, pack: Packing | None, want: set[int],
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """The module forward of the layers and the final norm: (normed state, hidden)."""
        full = (self._cos[rope_pos].unsqueeze(2), self._sin[rope_pos].unsqueeze(2), mask)
        local = full  # cos/sin (B, T, 1, head_dim) and the mask of the sliding layers
        if self._local is not None:
            local = (
                self._local[0][rope_pos].unsqueeze(2),
                self._local[1][rope_pos].unsqueeze(2),
                window_mask(mask, positions, slots, kv_len, self.max_len, self.cfg.sliding_window),
            )
        hidden: dict[int, Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in want:
                hidden[i] = x
            cos, sin, m = local if self._sliding[i] else full
            x = layer(x, cos, sin, slots, kv_len, m, cache_rows, pack)
        with kernel_range("lm_head"):
            x = self.model.norm(x)
        if self.cfg.n_layers in want:
            hidden[self.cfg.n_layers] = x
        return x, hidden

    def compact_cache(self, src: Tensor, dst: int, row: int | None = None) -> None:
        """Move cache slots ``src`` to ``dst, dst+1, ...`` in every layer (batch row ``row``,
        None = every row): commits an accepted tree path onto the prefix."""
        for layer in self.model.layers:
            assert layer.self_attn.cache is not None
            layer.self_attn.cache.compact(src, dst, row)

    def move_cache_row(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` cache slots of batch row ``src`` into row ``dst`` (every layer)."""
        for layer in self.model.layers:
            assert layer.self_attn.cache is not None
            layer.self_attn.cache.move_row(src, dst, n)


def causal_mask(start: int, t: int, kv_len: int, device: torch.device) -> Tensor:
    """(1, t, kv_len) bool: row i (position start+i) sees slots [0, start + i]."""
    rows = torch.arange(start, start + t, device=device)[:, None]
    cols = torch.arange(kv_len, device=device)[None, :]
    return (cols <= rows).unsqueeze(0)


def init_weights(model: Transformer, seed: int, std: float = 0.02) -> None:
    """Deterministic random weights for tests and tiny models."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
