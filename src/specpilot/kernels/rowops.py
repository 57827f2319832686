"""Row-wise ops of a decoder step over the C++ kernels: RMSNorm, residual add + RMSNorm, RoPE on
q and k (with Gemma's q/k norms), and the gated activations SiLU(g) * u and GELU-tanh(g) * u;
the model's row-wise layers (:class:`RMSNorm`, the gated :class:`MLP`) over them or torch.

Each is one ``specpilot::`` torch op (``csrc/rowops*.cpp``) that computes a row from that row
only, in the fixed order the package docstring states (the row-op contract), so its bits do not
depend on the number of rows, the thread count or the ISA path. Fake kernels are registered so
``torch.compile`` traces them. :func:`available` is False (and :func:`unavailable_reason` says
why in one line) when the kernels could not be built; callers then keep the torch formulas.

A module that can run a row op names it in its ``ROWOP`` attribute; :func:`wire` hands it the op
(``rowop``: the op handle and the ISA code) or None (the torch formula). Parameter names follow
Hugging Face either way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specpilot.config import ModelConfig
from specpilot.kernels import build
from specpilot.kernels.linear import isa_code
from specpilot.profiling import kernel_range

GLU_KINDS = {"silu": 0, "gelu_tanh": 1}
"""``glu`` activation codes: SiLU (SwiGLU) and GELU with the tanh approximation (GeGLU)."""

def ops() -> Any:
    """``torch.ops.specpilot`` with the row ops loaded and their fakes registered (else
    RuntimeError with the one-line reason)."""
    return build.ops("rowops", _register_fakes)


def _register_fakes() -> None:
    @torch.library.register_fake("specpilot::rms_norm")
    def _(x, w, eps, offset=False, isa=0):  # type: ignore[no-untyped-def]
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("specpilot::add_rms_norm")
    def _(x, residual, w, eps, offset=False, isa=0):  # type: ignore[no-untyped-def]
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        return out, torch.empty_like(out)

    @torch.library.register_fake("specpilot::rope_qk")
    def _(q, k, k_offset, cos, sin, n_q, n_k, head_dim, q_norm=None, k_norm=None, eps=1e-6,
          offset=False, isa=0):  # type: ignore[no-untyped-def]  # fmt: skip
        rows = q.numel() // q.shape[-1]
        return q.new_empty((rows, n_q + n_k, head_dim))

    @torch.library.register_fake("specpilot::glu")
    def _(gate, up=None, kind=0, isa=0):  # type: ignore[no-untyped-def]
        n = gate.shape[-1] if up is not None else gate.shape[-1] // 2
        return gate.new_empty((*gate.shape[:-1], n))


def available() -> bool:
    """True when the C++ kernels (row ops included) built and loaded."""
    return build.load() is None


def unavailable_reason() -> str | None:
    """One line saying why the row ops cannot run here, or None when they can."""
    return build.load()


def rms_norm(
    x: Tensor, w: Tensor, eps: float, offset: bool = False, isa: str | None = None
) -> Tensor:
    """``x * rsqrt(mean(x^2) + eps) * w`` over the last dimension (``1 + w`` with ``offset``)."""
    return ops().rms_norm(x, w, float(eps), bool(offset), isa_code(isa))


def add_rms_norm(
    x: Tensor,
    residual: Tensor,
    w: Tensor,
    eps: float,
    offset: bool = False,
    isa: str | None = None,
) -> tuple[Tensor, Tensor]:
    """``(h, rms_norm(h))`` with ``h = x + residual``: the residual add and the next norm."""
    h, y = ops().add_rms_norm(x, residual, w, float(eps), bool(offset), isa_code(isa))
    return h, y


def rope_qk(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    n_q: int,
    n_k: int,
    head_dim: int,
    k_offset: int = 0,
    q_norm: Tensor | None = None,
    k_norm: Tensor | None = None,
    eps: float = 1e-6,
    offset: bool = False,
    isa: str | None = None,
) -> Tensor:
    """RoPE (rotate-half layout) on ``n_q`` q heads and ``n_k`` k heads of every row: returns
    (rows, n_q + n_k, head_dim), q heads first. Row r's q heads are the first ``n_q *
    head_dim`` elements of ``q``'s row r, its k heads start at column ``k_offset`` of ``k``'s
    row r (pass the fused qkv output as both with ``k_offset = n_q * head_dim``); ``cos`` and
    ``sin`` hold (rows, head_dim). With ``q_norm`` / ``k_norm`` each head is RMS-normed first."""
    return ops().rope_qk(
        q, k, int(k_offset), cos, sin, int(n_q), int(n_k), int(head_dim), q_norm, k_norm,
        float(eps), bool(offset), isa_code(isa),
    )  # fmt: skip


def glu(
    gate: Tensor, up: Tensor | None = None, kind: str = "silu", isa: str | None = None
) -> Tensor:
    """``act(gate) * up``; with ``up`` None, ``gate`` is the fused gate_up output (its last
    dimension's first half the gate, the second half up). ``kind``: silu or gelu_tanh."""
    if kind not in GLU_KINDS:
        raise ValueError(f"unknown gated activation {kind!r}; use one of {', '.join(GLU_KINDS)}")
    return ops().glu(gate, up, GLU_KINDS[kind], isa_code(isa))


def wire(modules: Iterable[nn.Module], on: bool) -> None:
    """Give every module that names a row op (``ROWOP``) the op and the ISA code (on) or None
    (off: the torch formulas). On needs :func:`available`."""
    handles = ops() if on else None
    isa = isa_code()
    for mod in modules:
        name = getattr(mod, "ROWOP", None)
        if name:
            mod.rowop = None if handles is None else (getattr(handles, name).default, isa)


class RMSNorm(nn.Module):
    ROWOP = "rms_norm"

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset  # Gemma: the scale is 1 + weight, in fp32
        self.weight = nn.Parameter(torch.ones(dim))
        self.rowop: tuple[Any, int] | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.rowop is not None:
            return self.rowop[0](x, self.weight, self.eps, self.offset, self.rowop[1])
        dtype = x.dtype
        w = 1.0 + self.weight.float() if self.offset else self.weight
        if dtype == torch.float32:  # one fused op, bitwise equal to the formula below in fp32
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * w).to(dtype) if self.offset else self.weight * h.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def qkv_stage(att: Any, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The q/k/v stage of an attention module (``specpilot.model.Attention``): projections, q/k
    norms and RoPE; returns q/k (B, T, H + Hk, hd), q heads first, and v (B, T, Hk, hd). With
    ``att.rowop`` set, the norms and RoPE are one row op, else the torch formulas."""
    b, t, _ = x.shape
    h, hk, hd = att.n_heads, att.n_kv, att.head_dim
    if att.rowop is not None:
        op, isa = att.rowop
        qn, kn = att.q_norm, att.k_norm
        norms = (None, None, 1e-6, False) if qn is None else (qn.weight, kn.weight, qn.eps,
                                                               qn.offset)  # fmt: skip
        if att.qkv is not None:
            qkv = att.qkv(x)
            qk = op(qkv, qkv, h * hd, cos, sin, h, hk, hd, *norms, isa)
            v = qkv[..., (h + hk) * hd :].view(b, t, hk, hd)
        else:
            qk = op(att.q_proj(x), att.k_proj(x), 0, cos, sin, h, hk, hd, *norms, isa)
            v = att.v_proj(x).view(b, t, hk, hd)
        return qk.view(b, t, h + hk, hd), v
    if att.qkv is not None:  # fused projection (after prepack, or native)
        qkv = att.qkv(x)  # (B, T, (H + 2 Hk) hd)
        qk = qkv[..., : (h + hk) * hd].view(b, t, h + hk, hd)
        v = qkv[..., (h + hk) * hd :].view(b, t, hk, hd)
    else:
        q = att.q_proj(x).view(b, t, h, hd)
        qk = torch.cat([q, att.k_proj(x).view(b, t, hk, hd)], dim=2)  # (B, T, H + Hk, hd)
        v = att.v_proj(x).view(b, t, hk, hd)
    if att.q_norm is not None:
        qk = torch.cat([att.q_norm(qk[:, :, :h]), att.k_norm(qk[:, :, h:])], dim=2)
    return (qk * cos) + (rotate_half(qk) * sin), v  # RoPE on q and k at once


def gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    """Gated MLP: SwiGLU, or GeGLU (GELU-tanh) for Gemma; ``gate_up`` once fused."""

    ROWOP = "glu"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)
        self.act = gelu_tanh if cfg.gemma else F.silu  # GeGLU (Gemma) or SwiGLU
        self.kind = GLU_KINDS["gelu_tanh" if cfg.gemma else "silu"]
        self.gate_up: nn.Module | None = None
        self.rowop: tuple[Any, int] | None = None

    def forward(self, x: Tensor) -> Tensor:
        with kernel_range("gate_up"):
            if self.rowop is not None:
                op, isa = self.rowop
                if self.gate_up is not None:
                    act = op(self.gate_up(x), None, self.kind, isa)
                else:
                    act = op(self.gate_proj(x), self.up_proj(x), self.kind, isa)
            elif self.gate_up is not None:  # fused projection (after prepack)
                gu = self.gate_up(x)
                i = gu.shape[-1] // 2
                act = self.act(gu[..., :i]) * gu[..., i:]
            else:
                act = self.act(self.gate_proj(x)) * self.up_proj(x)
        with kernel_range("down"):
            return self.down_proj(act)
