"""The small network behind the trained drafters: decoder layers over target features.

Shared by the feature-level head (EAGLE, Li et al. 2024; EAGLE-3, Li et al. 2025) and the block
drafter (DFlash). Both read the target's hidden states at a few tapped layers (low / mid / high,
as EAGLE-3) and the target's frozen token embedding and LM head, which are attached at run time
(:meth:`FeatureNet.attach`) and never saved.

Entries. The drafter's sequence is one *entry* per committed position ``j``: its input fuses the
target's tapped hidden states at ``j`` (which predict token ``j+1``) with the embedding of token
``j+1``; its output predicts token ``j+2``::

    x_j = in_proj([norm_e(embed(t[j+1])) ; norm_g(g_j)]),  g_j = fuse(concat(taps_j))

With ``tap_norm`` each tapped state is RMS-normalized (no weight) before the fuse: Gemma 3's
residual stream reaches ~1e5 at its middle layer against ~5 at its final normed state, a spread
of scales a linear fuse from a small initialization cannot learn past.

For deeper draft tokens the head uses its own output state in place of ``g`` (EAGLE-3's
training-time test); the block drafter appends ``block`` mask rows that see every entry and each
other (non-causal within the block).

Attention is plain SDPA over explicit keys with a boolean mask (True = may attend), so the same
layer serves training (whole sequences) and drafting (a KV cache plus scratch rows).

Native targets. When the target runs on native GGUF weights (:mod:`specpilot.loading.native`),
:meth:`FeatureNet.attach` takes its modules instead of dense tensors and never asks for their fp32
``.weight`` (a 113 MB copy for SmolLM2's embedding): embedding lookups run through the target's
:class:`~specpilot.kernels.GGUFEmbedding` (only the rows read are dequantized) and the LM head is a
:class:`~specpilot.kernels.GGUFLinear` over the block rows of the draft vocabulary (the target's
head itself when the draft vocabulary is the whole one), run by the native GEMM. That path is
inference only (no gradient reaches the drafter through it; training attaches dense tensors). The
drafter's logits then follow the kernels' summation order rather than oneDNN's, so drafts may differ
slightly from those over dense tensors; the target verifies every token, so the output does not.
The drafter's own linears follow the target's numerics profile there (:meth:`FeatureNet.pack`):
F16 blocks of its fp16-exact weights in the fp32 profile, Q8_0 blocks in the int8 one.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specpilot import kernels
from specpilot.errors import DrafterError

KINDS = ("head", "block")


@dataclass(frozen=True)
class FeatureNetConfig:
    """Shape of a trained drafter; saved as ``config.json`` (with the target's identity)."""

    kind: str
    """"head" (one token per forward, trees by expansion) or "block" (B tokens per forward)."""
    dim: int
    """Hidden size; must equal the target's."""
    vocab_size: int
    """The target's vocabulary size."""
    taps: tuple[int, ...]
    """Target hidden-state indices read (index i < n_layers: input of layer i; n_layers: final
    normed state)."""
    n_layers: int = 1
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 1536
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    block: int = 0
    """Block drafter: tokens predicted per forward (0 for the head)."""
    draft_vocab: int = 0
    """Tokens of the reduced output vocabulary (0 = the whole target vocabulary)."""
    tap_norm: bool = False
    """RMS-normalize each tapped state (no weight) before the fuse (see the module docstring)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form facts stored with the drafter (target fingerprint, training figures)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise DrafterError(f"drafter kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("dim", "vocab_size", "n_layers", "n_heads", "n_kv_heads", "head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise DrafterError(f"drafter config: {name} must be a positive integer")
        if self.n_heads % self.n_kv_heads:
            raise DrafterError("drafter config: n_heads must be a multiple of n_kv_heads")
        if not self.taps:
            raise DrafterError("drafter config: at least one tapped layer is needed")
        if self.kind == "block" and self.block < 2:
            raise DrafterError("a block drafter needs block >= 2")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["taps"] = list(self.taps)
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> FeatureNetConfig:
        known = set(FeatureNetConfig.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise DrafterError(f"drafter config.json has unknown fields {unknown}")
        try:
            return FeatureNetConfig(**{**d, "taps": tuple(int(t) for t in d["taps"])})
        except (TypeError, KeyError, ValueError) as e:
            raise DrafterError(f"drafter config.json is malformed: {e}") from None


def fast_linear(mod: nn.Module, name: str, x: Tensor) -> Tensor:
    """``getattr(mod, name)(x)``, through its packed copy when :meth:`FeatureNet.pack` made one,
    autograd is off and the weight has not changed since."""
    lin = getattr(mod, name)
    packed = getattr(mod, "fast", {}).get(name)
    if packed is not None and not torch.is_grad_enabled() and packed[0] == lin.weight._version:
        return packed[1](x)
    return lin(x)


def _bf16_gemm() -> bool:
    """Whether oneDNN runs bf16 GEMMs natively on this CPU (AVX512-BF16 / AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class _Bf16Linear(nn.Module):
    """fp32 in, fp32 out, bf16 prepacked weights (the drafter's LM head: halves its bytes; the
    drafter's numbers never reach the output, the target verifies every token)."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(
            weight.detach().to(torch.bfloat16).contiguous(), 8
        )

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        m = x2.shape[0]
        pad = -m % 16 if m > 16 else 0  # oneDNN builds a kernel per row count (~1.5 ms each):
        if pad:  # a prompt's catch-up of any length reuses one of a few
            x2 = torch.cat([x2, x2.new_zeros(pad, self.in_features)])
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, None, "none", [], "")
        return y[:m].float().reshape(*x.shape[:-1], self.out_features)


BF16_FROM_ROWS = 16
"""Calls of at least this many rows (a drafter catching up on a prompt or on skipped steps) run
its F16 linears on oneDNN's bf16 GEMM where the CPU has one (:class:`_RowSwitch`); tests raise
it to keep the F16 kernel's row-count-invariant bits."""
BF16_FROM_ROWS_Q8 = 64
"""The same for Q8_0 linears (the int8 profile): on a 2-core EPYC Zen 4 the shipped head's six
linears took 1,056 / 2,058 / 3,846 us as Q8_0 against 1,149 / 1,756 / 3,030 us on bf16 at 32 /
64 / 128 rows (``bench/drafter_linears.py``), Q8_0 ahead below."""


class _RowSwitch:
    """A drafter linear on the native kernels (F16 blocks of fp16-exact weights: their exact
    values; or Q8_0 blocks in the int8 profile) for calls of fewer than :data:`BF16_FROM_ROWS`
    (Q8_0: :data:`BF16_FROM_ROWS_Q8`) rows; oneDNN bf16 (AMX) from there on, where the F16
    kernel's fp32 FMAs bound it (2 threads, 2048x576 alone: 48 vs 56 us at 1 row, 193 vs 79 us
    at 12, 457 vs 135 us at 36; in a head's steady drafts of 4 sequences, 8-12 rows a call,
    switching from 4 or 8 rows gained nothing, while the catch-up on a prompt went from 26 to
    15.5 ms). The two round differently, so a draft may depend on how many rows its call had;
    the target verifies every token, so the output does not."""

    def __init__(self, native: kernels.GGUFLinear, weight: Tensor) -> None:
        self.native, self.bf16 = native, _Bf16Linear(weight)
        self.in_features = native.in_features
        self.q8 = native.qtype == kernels.QTYPES["Q8_0"]
        self._native = native.forward  # called directly: a module call costs ~5 us, ~20 a step
        self._bf16 = self.bf16.forward

    def __call__(self, x: Tensor) -> Tensor:
        rows = x.numel() // self.in_features
        most = BF16_FROM_ROWS_Q8 if self.q8 else BF16_FROM_ROWS
        return self._native(x) if rows < most else self._bf16(x)  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=16)
def _inv_freq(hd: int, theta: float, device: torch.device) -> Tensor:
    """(hd/2,) fp32 rotary frequencies (computed once per shape; a drafting step calls
    :func:`rope` twice per layer and depth); a normal tensor even when first asked for under
    inference mode, so training may use it too."""
    with torch.inference_mode(False), torch.no_grad():
        return 1.0 / (theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))


def rope(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """Rotary embedding of ``x`` (..., T, H, hd) at positions ``pos`` (..., T)."""
    hd = x.shape[-1]
    ang = pos.to(torch.float32)[..., None] * _inv_freq(hd, float(theta), x.device)
    c, s = ang.cos(), ang.sin()  # (..., T, hd/2)
    cos = torch.cat([c, c], -1).unsqueeze(-2).to(x.dtype)  # (..., T, 1, hd)
    sin = torch.cat([s, s], -1).unsqueeze(-2).to(x.dtype)
    h = hd // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos + rot * sin


class DraftLayer(nn.Module):
    """A Llama decoder layer whose attention takes extra keys/values and an explicit mask."""

    def __init__(self, cfg: FeatureNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, hk, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.norm1 = nn.RMSNorm(cfg.dim, eps=cfg.rms_eps)
        self.qkv = nn.Linear(cfg.dim, (h + 2 * hk) * hd, bias=False)
        self.o = nn.Linear(h * hd, cfg.dim, bias=False)
        self.norm2 = nn.RMSNorm(cfg.dim, eps=cfg.rms_eps)
        self.gate_up = nn.Linear(cfg.dim, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)

    def kv(self, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, H, T, hd), k and v (B, Hk, T, hd) of ``x`` (B, T, dim) at ``pos`` (B, T)."""
        c = self.cfg
        b, t, _ = x.shape
        qkv = fast_linear(self, "qkv", self.norm1(x))
        q = qkv[..., : c.n_heads * c.head_dim].view(b, t, c.n_heads, c.head_dim)
        k = qkv[..., c.n_heads * c.head_dim : (c.n_heads + c.n_kv_heads) * c.head_dim]
        k = k.reshape(b, t, c.n_kv_heads, c.head_dim)
        v = qkv[..., (c.n_heads + c.n_kv_heads) * c.head_dim :].reshape(
            b, t, c.n_kv_heads, c.head_dim
        )
        q = rope(q, pos, c.rope_theta).transpose(1, 2)
        k = rope(k, pos, c.rope_theta).transpose(1, 2)
        return q, k, v.transpose(1, 2)

    def finish(self, x: Tensor, q: Tensor, keys: Tensor, vals: Tensor, mask: Tensor) -> Tensor:
        """Attention of ``q`` over ``keys``/``vals`` (B, Hk, S, hd) under ``mask`` (B, T, S),
        then the MLP; returns the layer output (B, T, dim)."""
        b, _, t, _ = q.shape
        o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask[:, None], enable_gqa=True)
        h = x + fast_linear(self, "o", o.transpose(1, 2).reshape(b, t, -1))
        gu = fast_linear(self, "gate_up", self.norm2(h))
        i = gu.shape[-1] // 2
        return h + fast_linear(self, "down", F.silu(gu[..., :i]) * gu[..., i:])


class FeatureNet(nn.Module):
    """Fuse + input projection + ``n_layers`` draft layers + norm; LM head rows attached."""

    def __init__(self, cfg: FeatureNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.dim
        self.fuse = nn.Linear(len(cfg.taps) * d, d, bias=False)
        self.norm_e = nn.RMSNorm(d, eps=cfg.rms_eps)
        self.norm_g = nn.RMSNorm(d, eps=cfg.rms_eps)
        self.in_proj = nn.Linear(2 * d, d, bias=False)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(d, eps=cfg.rms_eps)
        if cfg.kind == "block":
            self.mask_emb = nn.Parameter(torch.zeros(d))
        n_ids = cfg.draft_vocab or cfg.vocab_size
        # built on the meta device (trained.build_net), arange would run torch's Python
        # reference, whose checks import sympy (~36 MB resident); the load assigns the ids then
        meta = torch.get_default_device().type == "meta"
        ids = torch.empty(n_ids, dtype=torch.long) if meta else torch.arange(n_ids)
        self.register_buffer("vocab_ids", ids, persistent=True)
        self.embed: Tensor | None = None
        """(vocab, dim) the target's token embedding (frozen, attached; None when native)."""
        self.head: Tensor | None = None
        """(draft_vocab, dim) the target's LM-head rows of ``vocab_ids`` (frozen, attached;
        None when native)."""
        self.head_fn: Any = None
        """Optional fast callable for inference (a prepacked linear over ``head``)."""
        self.half_weights = False
        """Whether :meth:`pack` runs every linear on F16 copies (2 bytes a weight)."""
        self.q8_weights = False
        """Whether :meth:`pack` runs every linear on Q8_0 copies in the int8 profile (34 bytes
        per 32 weights): a native target in the int8 numerics profile."""
        self.rownorm: Any = None
        """Optional (x, weight) -> RMSNorm(x) for inference on the native row ops (set by a
        drafter with a :class:`~specpilot.drafters.lean.LeanForward`; used without autograd)."""
        self.native: tuple[Any, Any] = (None, None)
        """(embedding, LM head) native modules of a GGUF target used in place of ``embed`` /
        ``head`` (a tuple, so they are not registered: never saved, moved or counted here)."""

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                elif name == "mask_emb":
                    p.copy_(torch.randn(p.shape, generator=g) * std)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
                    if name.endswith("o.weight") or name.endswith("down.weight"):
                        p.mul_(0.5)

    def attach(self, embed: Tensor | nn.Module, head: Tensor | nn.Module) -> None:
        """Share the target's embedding and full LM head: dense (vocab, dim) tensors, or a native
        target's :class:`~specpilot.kernels.GGUFEmbedding` / :class:`~specpilot.kernels.GGUFLinear`
        used in place (see the module docstring; a drafter that is not float32 reads their
        ``.weight``)."""
        dims = (_width(embed, "embedding_dim"), _width(head, "in_features"))
        if dims != (self.cfg.dim, self.cfg.dim):
            raise DrafterError(
                f"drafter hidden size {self.cfg.dim} does not match the target's {dims[0]}"
            )
        dt = self.norm.weight.dtype  # the drafter's own dtype (targets may run in bf16)
        in_place = dt == torch.float32
        emb_mod = embed if in_place and isinstance(embed, kernels.GGUFEmbedding) else None
        head_mod = head if in_place and isinstance(head, kernels.GGUFLinear) else None
        self.embed = None if emb_mod is not None else _dense(embed).detach().to(dt)
        self.head = None
        if head_mod is not None:
            head_mod = draft_rows(head_mod, self.vocab_ids)
        else:
            w = _dense(head).detach()
            self.head = w[self.vocab_ids.to(w.device)].to(dt).contiguous()
        self.native = (emb_mod, head_mod)
        self.head_fn = None

    @property
    def attached(self) -> bool:
        """Whether the target's embedding and LM head are attached (dense or native)."""
        return (self.embed is not None or self.native[0] is not None) and (
            self.head is not None or self.native[1] is not None
        )

    def pack(self) -> bool:
        """Inference-only fast copies of every linear (fp32 CPU): oneDNN-prepacked (the LM-head
        rows in bf16 where the CPU has native bf16 GEMMs); on a native target (the kernels are
        built) a weight that fp16 holds exactly (a shipped drafter's) runs as an F16
        :class:`~specpilot.kernels.GGUFLinear` instead (half the bytes, the same values), with
        calls of several rows on oneDNN's bf16 GEMM where the CPU has one (:class:`_RowSwitch`);
        on a native target in the int8 numerics profile every linear runs as a Q8_0 GGUFLinear
        in that profile instead (:func:`_q8_linear`; :attr:`q8_weights`; bf16 from
        :data:`BF16_FROM_ROWS_Q8` rows). The GEMV -> GEMM switch of stock linears repacks
        weights per call, which dominated drafting. Used only without autograd and while the
        weights are unchanged (a training step bumps their version and the module itself is
        used again). Returns whether anything was packed; :attr:`half_weights` and
        :attr:`q8_weights` say whether all the linears run on F16 or Q8_0 weights."""
        from specpilot.kernels.onednn import PackedLinear, onednn_available

        if self.norm.weight.device.type != "cpu" or self.norm.weight.dtype != torch.float32:
            return False
        half = self.native[1] is not None
        q8 = half and bool(getattr(self.native[1], "int8", False))
        versions = (tuple(p._version for p in self.parameters()), q8)
        if getattr(self, "_packed_at", None) == versions:
            return True  # packed already, weights and profile unchanged (a shared net: one pack)
        onednn = onednn_available()
        if not (half or onednn):
            return False
        kinds = set()
        bf16 = onednn and _bf16_gemm()
        for mod in (self, *self.layers):
            mod.fast = {}
            for name, lin in mod.named_children():
                if not isinstance(lin, nn.Linear):
                    continue
                fast = _q8_linear(lin) if q8 else None
                if fast is None and half:
                    fast = _half_linear(lin)
                if fast is None and onednn:
                    fast = PackedLinear(lin.weight, lin.bias)
                q8_0 = isinstance(fast, kernels.GGUFLinear) and fast.qtype == kernels.QTYPES["Q8_0"]
                kinds.add("Q8_0" if q8_0 else type(fast).__name__)
                if isinstance(fast, kernels.GGUFLinear) and bf16 and lin.bias is None:
                    fast = _RowSwitch(fast, lin.weight)
                if fast is not None:
                    mod.fast[name] = (lin.weight._version, fast)
        self.half_weights = kinds == {"GGUFLinear"}
        self.q8_weights = kinds == {"Q8_0"}
        if self.head is not None and onednn:
            self.head_fn = _Bf16Linear(self.head) if _bf16_gemm() else PackedLinear(self.head, None)
        self._packed_at = versions
        return True

    def feature(self, taps: Tensor) -> Tensor:
        """The fused feature ``g`` (B, T, dim) of tapped states (B, T, n_taps, dim)."""
        b, t, n, d = taps.shape
        if self.cfg.tap_norm:
            taps = F.rms_norm(taps, (d,), eps=self.cfg.rms_eps)
        return fast_linear(self, "fuse", taps.reshape(b, t, n * d))

    def entries(self, taps: Tensor, next_tokens: Tensor) -> Tensor:
        """Entry inputs (B, T, dim) from tapped states (B, T, n_taps, dim) and tokens (B, T)."""
        return self.step_input(self.feature(taps), next_tokens)

    def step_input(self, g: Tensor, tokens: Tensor) -> Tensor:
        """Layer input from a feature ``g`` (B, T, dim) and the token that follows it (B, T)."""
        if self.native[0] is not None:
            e = self.native[0](tokens)
        else:
            assert self.embed is not None, "attach() the target's embedding first"
            e = F.embedding(tokens, self.embed)
        return fast_linear(
            self,
            "in_proj",
            torch.cat([self._norm(self.norm_e, e), self._norm(self.norm_g, g)], dim=-1),
        )

    def _norm(self, mod: nn.RMSNorm, x: Tensor) -> Tensor:
        """``mod(x)``, on the native row op when :attr:`rownorm` is set and autograd is off."""
        if self.rownorm is not None and not torch.is_grad_enabled():
            return self.rownorm(x, mod.weight)  # type: ignore[no-any-return]
        return mod(x)  # type: ignore[no-any-return]

    def logits(self, h: Tensor) -> Tensor:
        """Draft-vocabulary logits (..., draft_vocab) of layer outputs ``h`` (..., dim)."""
        x = self._norm(self.norm, h)
        if self.native[1] is not None:
            return self.native[1](x)
        assert self.head is not None, "attach() the target's LM head first"
        if self.head_fn is not None and not torch.is_grad_enabled():
            return self.head_fn(x)
        return x @ self.head.T


def _width(table: Tensor | nn.Module, attr: str) -> int:
    """The hidden size of a dense (n, dim) table or of a native module (its ``attr``)."""
    return int(table.shape[-1]) if isinstance(table, Tensor) else int(getattr(table, attr))


def _dense(table: Tensor | nn.Module) -> Tensor:
    """A dense table as is; a module's fp32 ``.weight`` (a native one makes a copy)."""
    return table if isinstance(table, Tensor) else table.weight


def _q8_linear(lin: nn.Linear) -> kernels.GGUFLinear | None:
    """``lin`` quantized to Q8_0 blocks (``gguf.quants.quantize``: one fp16 scale per 32
    weights) and run in the int8 profile, as the target's linears are there (~1.6x faster than
    the F16 kernel at 1-16 rows, half its bytes); None when the input width is not a multiple
    of 32. The drafter's numbers change by the quantization; the output cannot (the target
    verifies every token)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    w = lin.weight.detach().to(torch.float32)
    out, k = w.shape
    if k % 32:
        return None
    blocks = torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType.Q8_0)).reshape(-1)
    fast = kernels.GGUFLinear(blocks, kernels.QTYPES["Q8_0"], out, k, lin.bias, name="drafter")
    fast.profile = "int8"
    return fast


def _half_linear(lin: nn.Linear) -> kernels.GGUFLinear | None:
    """``lin`` as an F16 GGUFLinear when fp16 holds its weight exactly, else None."""
    w = lin.weight.detach()
    half = w.to(torch.float16)
    if not torch.equal(half.to(w.dtype), w):
        return None
    out, k = w.shape
    blocks = half.contiguous().view(torch.uint8).reshape(-1)
    return kernels.GGUFLinear(blocks, kernels.QTYPES["F16"], out, k, lin.bias, name="drafter")


def draft_rows(head: kernels.GGUFLinear, ids: Tensor) -> kernels.GGUFLinear:
    """The LM head restricted to rows ``ids`` (the draft vocabulary), still in GGUF blocks: the
    target's module itself when ``ids`` are all its rows in order, else a GGUFLinear over a copy
    of those block rows (same type, numerics profile and schedule as ``head``)."""
    n = head.out_features
    ids = ids.to(torch.long).cpu()
    if ids.numel() == n and torch.equal(ids, torch.arange(n)):
        return head
    rows = head.gguf_blocks().view(n, -1)[ids].reshape(-1)
    bias = None if head.bias is None else head.bias[ids]
    sub = kernels.GGUFLinear(rows, head.qtype, ids.numel(), head.in_features, bias,
                             name="draft vocabulary rows")  # fmt: skip
    sub.profile = head.profile
    sub.set_schedule(*head.tiles)
    return sub
