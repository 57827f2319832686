"""The lean forward's decoder layers as one op call: ``specpilot::lean_run`` through a plan read
once (``torch.classes.specpilot.LeanPlan``; ``csrc/forward_ops.cpp``).

:func:`specpilot.kernels.step.run` calls ~8 ops a layer from Python: on SmolLM2's 30 layers
~240 dispatches and their glue, 1.3-2 ms of a 9-18 ms step on a 2-core Xeon (BENCHMARKS.md). The
op here runs the same op functions in the same order on the same arguments in C++, so its outputs
have the same bits (tests/test_lean_step.py); what it saves is only the Python between them.

:func:`pack` reads the layers once into flat lists (the weights, the caches, an integer plan and
the floats; the layout is in the op's source), holds them read in C++, and returns None where
the op does not apply: a linear that is not a :class:`~specpilot.kernels.linear.GGUFLinear` (or a
fused :class:`~specpilot.kernels.linear.GGUFMultiLinear` of them) running one op, parts that mix
numerics profiles or biases. The step falls back to the Python loop then. With the class clock
on (:func:`specpilot.profiling.clocking`) the op times its own kernel classes (its ``clock``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from specpilot.kernels import int8
from specpilot.kernels.linear import GGUFLinear, GGUFMultiLinear

STACK_ENV = "SPECPILOT_LEAN_STACK"
"""``0`` turns the op off (the Python loop runs every step): for before/after timings."""


@dataclass(frozen=True)
class Stack:
    """``specpilot::lean_run`` and its plan for one model."""

    n_layers: int
    op: Any
    """``specpilot::lean_run``: a forward through :attr:`plan`."""
    plan: Any
    """The plan read once in C++ (``torch.classes.specpilot.LeanPlan``) from :func:`pack`'s flat
    lists (their layout is in the op's source): a forward converts only its call inputs (the
    ~300 tensors of the lists took ~0.1 ms a call)."""


class _Lists:
    """Tensors and integers as the op reads them: a tensor is named by its index."""

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []
        self.caches: list[Tensor] = []
        self.ints: list[int] = []

    def tensor(self, t: Tensor | None) -> int:
        if t is None:
            return -1
        self.tensors.append(t)
        return len(self.tensors) - 1

    def cache(self, t: Tensor) -> int:
        self.caches.append(t)
        return len(self.caches) - 1

    def linear(self, mod: nn.Module | None) -> bool:
        """Append ``mod``'s record; False when the op cannot run it."""
        if isinstance(mod, GGUFMultiLinear):
            parts = list(mod.parts)
        elif isinstance(mod, GGUFLinear):
            parts = [mod]
        else:
            return False
        if not all(isinstance(p, GGUFLinear) for p in parts):
            return False
        if len({p.bias is None for p in parts}) != 1 or len({p.in_features for p in parts}) != 1:
            return False
        bias = None
        if parts[0].bias is not None:
            bias = mod.bias if isinstance(mod, GGUFMultiLinear) else parts[0].bias
        head = parts[0]
        (rt1, ct1), (rtm, ctm) = head.tiles
        self.ints += [len(parts), head.in_features, self.tensor(bias), head.isa, rt1, ct1, rtm, ctm]
        for p in parts:
            q8 = p.profile == "int8" and int8.int8_supports(p.qtype)
            self.ints += [self.tensor(p.blocks), p.qcode, p.out_features, int(q8)]
            self.ints.append(self.tensor(p.bias) if len(parts) > 1 else -1)
        return True


def pack(model: Any, isa: int, attn_isa: int) -> Stack | None:
    """The op's arguments for ``model`` (a Transformer on the lean forward), or None when some
    layer has a linear it does not run (or :data:`STACK_ENV` is ``0``)."""
    from specpilot.kernels.rowops import ops

    if os.environ.get(STACK_ENV) == "0":
        return None
    cfg = model.cfg
    out = _Lists()
    out.ints += [cfg.n_layers, int(cfg.gemma), isa, attn_isa, cfg.n_heads, cfg.n_kv_heads]
    out.ints += [cfg.head_dim, -1, out.tensor(model.model.norm.weight)]
    floats = [float(cfg.rms_eps)]
    kinds = set()
    for i, blk in enumerate(model.model.layers):
        att, mlp = blk.self_attn, blk.mlp
        qkv = att.qkv if att.qkv is not None else _joined(att)
        if qkv is None or not out.linear(qkv) or not out.linear(att.o_proj):
            return None
        fused = mlp.gate_up is not None
        out.ints.append(int(fused))
        mlps = (mlp.gate_up,) if fused else (mlp.gate_proj, mlp.up_proj)
        if not all(out.linear(m) for m in (*mlps, mlp.down_proj)):
            return None
        norms = [blk.input_layernorm.weight, blk.post_attention_layernorm.weight]
        if cfg.gemma:
            norms += [blk.pre_feedforward_layernorm.weight, blk.post_feedforward_layernorm.weight]
        out.ints += [len(norms), *(out.tensor(w) for w in norms)]
        qk = (None, None) if att.q_norm is None else (att.q_norm.weight, att.k_norm.weight)
        out.ints += [out.tensor(qk[0]), out.tensor(qk[1])]
        out.ints += [out.cache(att.cache.k), out.cache(att.cache.v), int(model._sliding[i])]
        floats.append(float(att.fixed[1]))
        kinds.add(mlp.kind)
    if len(kinds) != 1:
        return None
    out.ints[7] = int(kinds.pop())
    ops()  # the library (and its class) loaded
    plan = torch.classes.specpilot.LeanPlan(out.tensors, out.caches, out.ints, floats)
    op = torch.ops.specpilot.lean_run.default
    # the op's C++ entry: an op taking a script object goes through TorchBindOpOverload, whose
    # Python __call__ first walks every argument for fake script objects (torch.compile's; never
    # passed here), ~5 us a forward
    return Stack(cfg.n_layers, getattr(op, "_op", op), plan)


def _joined(att: Any) -> GGUFMultiLinear | None:
    """Separate q/k/v GGUFLinears as one fused record (the op's multi-part call gives the bits
    of the three calls concatenated); None when they are not all GGUFLinears."""
    parts = [att.q_proj, att.k_proj, att.v_proj]
    if not all(isinstance(p, GGUFLinear) for p in parts):
        return None
    try:
        return GGUFMultiLinear(parts)
    except ValueError:  # different input widths, or biases on some parts only
        return None


def run(
    s: Stack,
    x: Tensor,
    tables: tuple[tuple[Tensor, Tensor, Tensor | None], ...],
    slots: Tensor | None,
    ints: tuple[int, int, int, int],
    want: set[int],
    pack: tuple[Tensor, int] | None = None,
    clock: Tensor | None = None,
) -> tuple[Tensor, dict[int, Tensor]]:
    """The layers and the final norm on ``x`` (rows, dim), as :func:`step.run`: the normed final
    state and the wanted layer inputs. ``tables``: (cos, sin, mask) of the full-attention and
    (if any) the sliding layers; ``ints``: (slot0, kv_len, batch, cache_row); ``pack``: the
    real rows of a padded call and the rows of its padded layout (the attention runs on it);
    ``clock``: seconds per kernel class are added to it (:func:`~specpilot.profiling.class_clock`).
    """
    local = tables[1] if len(tables) > 1 else (None, None, None)
    index, padded = pack if pack is not None else (None, 0)
    call = [*tables[0], *local, slots, index]
    keep = sorted(i for i in want if 0 <= i <= s.n_layers)
    out = s.op(s.plan, x, call, [*ints, padded], keep, clock)
    return out[0], dict(zip(keep, out[1:], strict=True))
