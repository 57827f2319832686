"""The lean native forward of a decoder (:class:`specpilot.model.Transformer`): every layer as a
flat sequence of op calls on (rows, dim) tensors, for the row ops + ``attention="fixed"`` setup.

The module forward spends a few ms per step on glue: nested ``nn.Module`` calls, views,
reshapes and transposes, the KV-cache slice copies and the separate residual adds. Here one
layer is: the fused q/k/v projection, ``specpilot::rope_attention`` (RoPE, the cache write and
the attention in one op: :mod:`specpilot.kernels.attention`), o_proj, the residual add + norm,
gate_up, the gated activation, down, and the residual add fused with the next layer's input norm
(the final norm after the last layer). Every op computes what the module path computes, on the
same inputs, so the bits are the same (``h + d`` and ``d + h`` are one IEEE addition).

The one op call emits no profiler ranges inside; with the class clock on
(:func:`specpilot.profiling.clocking`) it times its kernel classes itself, grouped as the Python
loop (which runs where the op does not apply) groups its ops in the cost model's kernel-class
ranges: ``qkv`` the projection and the input norm (fused with the previous layer's last residual
add), ``attention`` ``rope_attention`` (so RoPE counts as attention here, not as ``qkv`` as in
the module forward), ``o_proj``, ``gate_up`` the post-attention residual + norm and the gated
activation, ``down``, and ``lm_head`` the final norm.

:func:`plan` reads the layers once (op handles, weights, the caches); it duck-types the
Transformer (this layer sits below ``model``). :func:`run` is the forward itself. :class:`Packing`
(the real rows of a padded verify block) lives here for both forwards; ``specpilot.model``
exports it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specpilot.kernels import rowops, stack
from specpilot.kernels.attention import ops as attention_ops
from specpilot.kernels.linear import schedule_version
from specpilot.profiling import add_clock, class_clock, kernel_range


@dataclass(frozen=True)
class Packing:
    """The real rows of a padded (B, T) verify block: row-wise ops (norms, projections, RoPE,
    MLP, LM head) run on them only, attention on the padded layout (each row's result is the
    same bits either way: every row-wise kernel is batch-invariant)."""

    index: Tensor
    """(R,) long: positions of the real rows in the flattened (B * T) layout, ascending."""
    batch: int
    width: int

    def rows(self, a: Tensor) -> Tensor:
        """(B, T) -> (1, R)."""
        return a.reshape(-1)[self.index][None]

    def pack(self, a: Tensor) -> Tensor:
        """(B, T, ...) -> (1, R, ...)."""
        return a.reshape(self.batch * self.width, *a.shape[2:])[self.index][None]

    def unpack(self, a: Tensor) -> Tensor:
        """(1, R, ...) -> (B, T, ...), pad rows zero."""
        out = a.new_zeros(self.batch * self.width, *a.shape[2:])
        out[self.index] = a[0]
        return out.view(self.batch, self.width, *a.shape[2:])


@dataclass(frozen=True)
class Layer:
    """One decoder layer, read off its modules."""

    qkv: Callable[[Tensor], Tensor]
    """rows -> the q, k, v heads of each row (the fused projection, or the three concatenated)."""
    o_proj: Callable[[Tensor], Tensor]
    act: Callable[[Tensor], Tensor]
    """rows -> the gated activation (gate_up or gate and up, then the glu row op)."""
    down: Callable[[Tensor], Tensor]
    norms: tuple[Tensor, ...]
    """Llama: (input, post-attention); Gemma: (input, post-attention, pre-FF, post-FF)."""
    qk_norms: tuple[Tensor | None, Tensor | None]
    k_cache: Tensor
    v_cache: Tensor
    scale: float
    sliding: bool


@dataclass(frozen=True)
class Plan:
    layers: tuple[Layer, ...]
    final_norm: Tensor
    eps: float
    gemma: bool
    heads: tuple[int, int, int]
    """(query heads, kv heads, head_dim)."""
    isa: int
    """ISA code of the row ops (the modules' ``rowop``)."""
    attn_isa: int
    """ISA code of the attention (``Attention.fixed``)."""
    stack: stack.Stack | None = None
    """The layers as one ``specpilot::lean_run`` call (:mod:`specpilot.kernels.stack`), or
    None where it does not apply."""
    version: int = 0
    """:func:`~specpilot.kernels.linear.schedule_version` when read: a plan whose linears'
    tiles or profiles changed since is read again (:func:`current`)."""


def _qkv(att: Any) -> Callable[[Tensor], Tensor]:
    if att.qkv is not None:
        return att.qkv.forward  # type: ignore[no-any-return]
    q, k, v = att.q_proj.forward, att.k_proj.forward, att.v_proj.forward
    return lambda a: torch.cat([q(a), k(a), v(a)], dim=-1)


def _act(mlp: Any, glu: Any, isa: int) -> Callable[[Tensor], Tensor]:
    kind = mlp.kind
    if mlp.gate_up is not None:
        gate_up = mlp.gate_up.forward
        return lambda a: glu(gate_up(a), None, kind, isa)
    gate, up = mlp.gate_proj.forward, mlp.up_proj.forward
    return lambda a: glu(gate(a), up(a), kind, isa)


def current(model: Any, p: Plan | None) -> Plan | None:
    """The lean forward's plan of ``model``: ``p`` while it is still its view of the layers
    (``p`` is dropped when the cache is set up again or the row ops change), else a new
    :func:`plan`; None where the lean forward does not apply: the row ops off (native weights
    turn them on), attention not ``"fixed"`` with every layer's cache set up, or compiled.
    Called every forward: a kept plan costs three attribute reads, not a walk over the layers."""
    if not (model.rowops and model.attention == "fixed") or model.compiled is not None:
        return None
    if p is not None and p.version == schedule_version():
        return p
    if any(layer.self_attn.fixed is None for layer in model.model.layers):
        return None
    return plan(model)


def plan(model: Any) -> Plan:
    """The lean forward's view of ``model`` (call again after setup_cache or set_rowops)."""
    cfg = model.cfg
    version = schedule_version()
    isa = model.model.norm.rowop[1]
    glu = rowops.ops().glu.default
    layers = []
    for i, blk in enumerate(model.model.layers):
        att, mlp = blk.self_attn, blk.mlp
        norms = [blk.input_layernorm.weight, blk.post_attention_layernorm.weight]
        if cfg.gemma:
            norms += [blk.pre_feedforward_layernorm.weight, blk.post_feedforward_layernorm.weight]
        qk = (None, None) if att.q_norm is None else (att.q_norm.weight, att.k_norm.weight)
        layers.append(Layer(
            _qkv(att), att.o_proj.forward, _act(mlp, glu, isa), mlp.down_proj.forward,
            tuple(norms), qk, att.cache.k, att.cache.v, float(att.fixed[1]),
            bool(model._sliding[i]),
        ))  # fmt: skip
    return Plan(
        tuple(layers), model.model.norm.weight, float(cfg.rms_eps), bool(cfg.gemma),
        (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim), isa, att.fixed[2],
        stack.pack(model, isa, att.fixed[2]), version,
    )  # fmt: skip


@dataclass(frozen=True)
class Call:
    """One forward call's per-step inputs, shared by every layer."""

    tables: tuple[tuple[Tensor, Tensor, Tensor | None], ...]
    """(cos, sin, mask) of the full-attention layers, then of the sliding layers if any."""
    slots: Tensor | None
    slot0: int
    kv_len: int
    batch: int
    cache_row: int
    pack: Packing | None
    """The real rows of a padded call (pad rows are zeros in the attention), or None."""


def _attend(p: Plan, lay: Layer, c: Call, a: Tensor, op: Any) -> Tensor:
    """q/k/v projection, RoPE, cache write and attention of ``a`` (rows, dim)."""
    cos, sin, mask = c.tables[lay.sliding and len(c.tables) > 1]
    h, hk, hd = p.heads
    with kernel_range("qkv"):
        qkv = lay.qkv(a)
    qw, kw = lay.qk_norms
    if c.pack is not None:  # attention on the padded layout: pad rows are zeros
        full = qkv.new_zeros(c.pack.batch * c.pack.width, qkv.shape[-1])
        full[c.pack.index] = qkv
        qkv = full
    with kernel_range("attention"):
        o = op(qkv, cos, sin, qw, kw, p.eps, p.gemma, lay.k_cache, lay.v_cache, c.cache_row,
               c.batch, c.slots, c.slot0, c.kv_len, mask, lay.scale, h, hk, hd,
               p.attn_isa)  # fmt: skip
    if c.pack is not None:
        o = o[c.pack.index]
    with kernel_range("o_proj"):
        return lay.o_proj(o)


def run(p: Plan, x: Tensor, c: Call, want: set[int]) -> tuple[Tensor, dict[int, Tensor]]:
    """The decoder layers and the final norm on ``x`` (rows, dim): the normed final state and
    the requested layer inputs (``want``; index len(layers) is the normed final state). One op
    call for all the layers where :attr:`Plan.stack` applies; with the class clock on it times
    its kernel classes itself (:func:`specpilot.profiling.clocking`)."""
    if p.stack is not None:
        ints = (c.slot0, c.kv_len, c.batch, c.cache_row)
        pack = None if c.pack is None else (c.pack.index, c.pack.batch * c.pack.width)
        clock = class_clock()
        out = stack.run(p.stack, x, c.tables, c.slots, ints, want, pack, clock)
        add_clock(clock)
        return out
    ro = rowops.ops()
    rms, add_rms = ro.rms_norm.default, ro.add_rms_norm.default
    attend = attention_ops().rope_attention.default
    eps, isa, gemma = p.eps, p.isa, p.gemma
    hidden: dict[int, Tensor] = {}
    n = len(p.layers)
    with kernel_range("qkv"):
        a = rms(x, p.layers[0].norms[0], eps, gemma, isa)
    for i, lay in enumerate(p.layers):
        if i in want:
            hidden[i] = x
        o = _attend(p, lay, c, a, attend)
        nxt = kernel_range("qkv" if i + 1 < n else "lm_head")  # the next input norm
        if gemma:
            with kernel_range("gate_up"):
                h = x + rms(o, lay.norms[1], eps, True, isa)
                a = lay.act(rms(h, lay.norms[2], eps, True, isa))
            with kernel_range("down"):
                x = h + rms(lay.down(a), lay.norms[3], eps, True, isa)
            with nxt:
                a = rms(x, p.layers[i + 1].norms[0] if i + 1 < n else p.final_norm, eps, True,
                        isa)  # fmt: skip
            continue
        with kernel_range("gate_up"):
            h, a = add_rms(o, x, lay.norms[1], eps, False, isa)
            a = lay.act(a)
        with kernel_range("down"):
            d = lay.down(a)
        with nxt:
            x, a = add_rms(d, h, p.layers[i + 1].norms[0] if i + 1 < n else p.final_norm, eps,
                           False, isa)  # fmt: skip
    if n in want:
        hidden[n] = a
    return a, hidden


def call_inputs(
    model: Any,
    positions: Tensor,
    slots: int | Tensor,
    kv_len: int,
    mask: Tensor | None,
    cache_rows: slice | None,
    pack: Packing | None,
) -> Call:
    """The per-step inputs of a lean forward: the RoPE tables gathered once for every layer, at
    ``positions`` (B, T), the padded layout (attention runs on it also when packed)."""
    from specpilot.config import window_mask

    tables = [(model._cos[positions], model._sin[positions], mask)]
    if model._local is not None:
        local = window_mask(mask, positions, slots, kv_len, model.max_len,
                            model.cfg.sliding_window)  # fmt: skip
        tables.append((model._local[0][positions], model._local[1][positions], local))
    if cache_rows is not None and cache_rows.step not in (None, 1):
        raise ValueError(f"cache_rows must be a contiguous slice, got {cache_rows}")
    row0 = 0 if cache_rows is None or cache_rows.start is None else int(cache_rows.start)
    tab, slot0 = (None, int(slots)) if isinstance(slots, int) else (slots, 0)
    return Call(tuple(tables), tab, slot0, int(kv_len), int(positions.shape[0]), row0, pack)
