"""Analytic roofline: FLOPs and bytes per decode step for each kernel class, and their floors.

A kernel class cannot run faster than its *floor* (Williams et al. 2009, "Roofline"; the SpecPilot
paper's Phase 0)::

    floor = max(FLOPs / (alpha * peak FLOP/s), bytes / (beta * peak bandwidth))

with alpha = 0.60 and beta = 0.90 by default (the share of the datasheet peak a good kernel
reaches). Counts are per decode step of the current plan, for a Llama-family block (nanoGPT's
``estimate_mfu`` and the "Transformer Inference Arithmetic" conventions: a multiply-add is 2
FLOPs; an ideal kernel moves each weight, input and output once).

Symbols: R rows per step (draft nodes + 1); RK = rows x keys of the call, R (K + R), the score
entries a masked attention kernel computes; K keys already in the cache (the committed prefix);
L layers, D hidden size, H / Hk query / key-value heads, hd head dim, I intermediate size, V
vocabulary; w / a bytes per weight / activation element (a native GGUF model: w its layers'
block bytes per weight, the LM head's own, :func:`native_weight_bytes`); c bytes per cached K
or V element (8 for ``exact`` attention, which keeps an fp64 cache). Per layer (x L), except
the LM head:

  qkv        FLOPs 2 R D (H+2Hk) hd + 4 R D (RMSNorm) + 3 R (H+Hk) hd (RoPE)
                   [+ 4 R (H+Hk) hd q/k norm] [+ R (H+2Hk) hd bias]
             bytes w (D (H+2Hk) hd + D) + a R (D + (H+2Hk) hd) + a 2 R hd (RoPE tables)
  attention  FLOPs 4 H hd RK (QK^T and PV; softmax not counted, the usual convention)
             bytes c Hk hd 2 (K + R) (read the cache, write the new rows) + a 2 R H hd
  o_proj     FLOPs 2 R H hd D;  bytes w H hd D + a R (H hd + D)
  gate_up    FLOPs 2 R D 2I + 4 R D (RMSNorm) + 5 R I (SiLU(g) * u: exp, add, div, 2 mul)
             bytes w (2 I D + D) + a R (D + I)
  down       FLOPs 2 R I D;  bytes w I D + a R (I + D)
  lm_head    FLOPs 2 R D V + 4 R D (final RMSNorm)   (once, not per layer)
             bytes w (V D + D) + a R D + 4 R V (fp32 logits)
  recurrent  0 (linear-attention / recurrent layers; none in a Llama-family model)

``prefill`` is its own class: the same formulas with R = P prompt rows, RK = P (P + 1) / 2
causal pairs, K = 0 (nothing cached before), one LM-head row; per prompt, summed over the prompts
and *amortized per decode step* (divided by the number of decode steps) so that it sits in the
same per-step table. ``drafter``: training-free drafters (lookup, suffix) get a floor of 0 (their
useful arithmetic is negligible); a drafter that runs a network - a specpilot draft model, or
the trained head / block drafter (:func:`trained_drafter_work`) - reads its weights once and
does 2 FLOPs per weight and row (at least one row) per draft forward: ``drafter`` work =
forwards per step x (W bytes, 2 P FLOPs). Attention FLOPs of ``exact`` attention are fp64 and
are held against the device's fp64 peak. In the int8-activation numerics profile the GEMM
FLOPs of the linears that run the int8 kernel (the 2 x weights x rows terms above, in the share
of weight elements :func:`native_int8_share` finds) are integer block dot products, held
against the device's int8 GEMM peak (:attr:`Hardware.int8_peak`): on a CPU with VNNI it is
several times the fp32 one, and a floor from the fp32 peak is no floor for them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from specpilot.config import ModelConfig

NORM_FLOPS = 4
"""FLOPs per element of an RMSNorm (square, sum, scale by rsqrt, multiply by the weight)."""
ROPE_FLOPS = 3
"""FLOPs per element of RoPE (x cos + rotate(x) sin)."""
ACT_FLOPS = 5
"""FLOPs per element of SiLU(gate) * up (exp, add, divide, multiply, multiply)."""
LOGIT_BYTES = 4
"""Logits are returned in fp32."""

STEP_CLASSES = ("qkv", "attention", "o_proj", "gate_up", "down", "lm_head", "recurrent")
ALL_CLASSES = (*STEP_CLASSES, "drafter", "prefill")


@dataclass(frozen=True)
class Work:
    """Arithmetic and memory traffic of one kernel class (per decode step unless stated)."""

    flops: float
    bytes: float
    fp64_flops: float = 0.0
    """Part of ``flops`` done in fp64 (held against the fp64 peak)."""
    int8_flops: float = 0.0
    """Part of ``flops`` done as int8 integer dot products (held against the int8 peak)."""

    def __add__(self, other: Work) -> Work:
        return Work(
            self.flops + other.flops,
            self.bytes + other.bytes,
            self.fp64_flops + other.fp64_flops,
            self.int8_flops + other.int8_flops,
        )

    def scaled(self, k: float) -> Work:
        return Work(self.flops * k, self.bytes * k, self.fp64_flops * k, self.int8_flops * k)


ZERO = Work(0.0, 0.0)


@dataclass(frozen=True)
class StepShape:
    """What one decode step processes, averaged over the measured steps."""

    rows: float
    """R: mean rows per target forward (draft nodes + the root)."""
    row_keys: float
    """RK: mean over steps of rows x keys of the call, R (K + R)."""
    keys: float
    """K: mean number of cached keys read per step (the committed prefix)."""


@dataclass(frozen=True)
class Dtypes:
    weight: float = 4
    """Bytes per weight element of the layers' linears (a native GGUF model: their block bytes
    per element, e.g. 0.625 for Q4_1)."""
    act: int = 4
    """Bytes per activation element."""
    cache: int = 4
    """Bytes per cached K/V element (8 for ``exact`` attention)."""
    head_weight: float | None = None
    """Bytes per LM-head weight element; None: ``weight`` (a native model's head has its own
    block type, e.g. a Q8_0 tied embedding: 1.0625)."""
    int8: float = 0.0
    """Share of the layers' linear weight elements whose GEMM runs the int8 kernel (0 outside
    the int8 numerics profile)."""
    head_int8: float = 0.0
    """The same share for the LM head."""

    @property
    def fp64_attention(self) -> bool:
        return self.cache == 8


def layer_work(cfg: ModelConfig, shape: StepShape, dt: Dtypes) -> dict[str, Work]:
    """Per-class work of ONE forward over ``shape`` (all layers; LM head on every row)."""
    r, rk, k = shape.rows, shape.row_keys, shape.keys
    d, hd, h, hk = cfg.dim, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    i, v, n = cfg.intermediate_size, cfg.vocab_size, cfg.n_layers
    w, a, c = dt.weight, dt.act, dt.cache
    qkv_out = (h + 2 * hk) * hd
    qkv_f = 2 * r * d * qkv_out + NORM_FLOPS * r * d + ROPE_FLOPS * r * (h + hk) * hd
    qkv_b = w * (d * qkv_out + d) + a * r * (d + qkv_out) + a * 2 * r * hd
    if cfg.qk_norm:
        qkv_f += NORM_FLOPS * r * (h + hk) * hd
        qkv_b += w * 2 * hd
    if cfg.qkv_bias:
        qkv_f += r * qkv_out
        qkv_b += w * qkv_out
    att_f = 4 * h * hd * rk
    att_b = c * hk * hd * 2 * (k + r) + a * 2 * r * h * hd
    q8 = dt.int8
    out = {
        "qkv": Work(qkv_f, qkv_b, 0.0, q8 * 2 * r * d * qkv_out),
        "attention": Work(att_f, att_b, att_f if dt.fp64_attention else 0.0),
        "o_proj": Work(
            2 * r * h * hd * d, w * h * hd * d + a * r * (h * hd + d), 0.0, q8 * 2 * r * h * hd * d
        ),
        "gate_up": Work(
            2 * r * d * 2 * i + NORM_FLOPS * r * d + ACT_FLOPS * r * i,
            w * (2 * i * d + d) + a * r * (d + i),
            0.0,
            q8 * 2 * r * d * 2 * i,
        ),
        "down": Work(2 * r * i * d, w * i * d + a * r * (i + d), 0.0, q8 * 2 * r * i * d),
    }
    out = {name: wk.scaled(n) for name, wk in out.items()}
    hw = dt.head_weight if dt.head_weight is not None else w
    out["lm_head"] = Work(
        2 * r * d * v + NORM_FLOPS * r * d,
        hw * v * d + w * d + a * r * d + LOGIT_BYTES * r * v,
        0.0,
        dt.head_int8 * 2 * r * d * v,
    )
    out["recurrent"] = ZERO
    return out


def step_work(cfg: ModelConfig, shape: StepShape, dt: Dtypes) -> dict[str, Work]:
    """Per-class work of one decode step (the classes of :data:`STEP_CLASSES`)."""
    return layer_work(cfg, shape, dt)


def prefill_work(cfg: ModelConfig, prompt_lens: list[int], dt: Dtypes) -> Work:
    """Total work of prefilling every prompt (causal pairs only, one LM-head row each)."""
    total = ZERO
    for p in prompt_lens:
        body = layer_work(cfg, StepShape(rows=p, row_keys=p * (p + 1) / 2, keys=0), dt)
        head = layer_work(cfg, StepShape(rows=1, row_keys=1, keys=0), dt)["lm_head"]
        for name, wk in body.items():
            total = total + (head if name == "lm_head" else wk)
    return total


def draft_model_work(params: int, forwards_per_step: float, weight_bytes: int) -> Work:
    """A draft model's floor: its weights read once and 2 FLOPs per weight (one row) per draft
    forward."""
    return Work(2.0 * params * forwards_per_step, float(params) * weight_bytes * forwards_per_step)


def _native_linears(model: Any) -> Iterator[tuple[int, int, Any]]:
    """(0 for a layer's linear / 1 for the LM head, weight elements, module) of every module of
    ``model`` holding GGUF blocks (``blocks``, ``in_features``, ``out_features``)."""
    for name, mod in model.named_modules():
        if getattr(mod, "blocks", None) is None or not hasattr(mod, "in_features"):
            continue
        n = int(mod.in_features) * int(mod.out_features)
        if name.split(".")[-1] == "lm_head":
            yield 1, n, mod
        elif ".layers." in f".{name}.":
            yield 0, n, mod


def native_weight_bytes(model: Any) -> tuple[float, float] | None:
    """Bytes per weight element (layers' linears, LM head) of a model whose linears hold GGUF
    blocks (modules with ``blocks``, ``in_features``, ``out_features``): the blocks as stored,
    scales included; None when it has none (an fp32 / bf16 model: its dtype's size applies)."""
    nbytes, elems = [0, 0], [0, 0]
    for i, n, mod in _native_linears(model):
        nbytes[i] += mod.blocks.numel() * mod.blocks.element_size()
        elems[i] += n
    if elems[0] == 0:
        return None
    layer = nbytes[0] / elems[0]
    return layer, (nbytes[1] / elems[1] if elems[1] else layer)


def native_int8_share(model: Any) -> tuple[float, float]:
    """Share of the weight elements (layers' linears, LM head) of a native model whose GEMM runs
    the int8-activation kernel (modules with ``blocks`` and a true ``int8``); (0, 0) for a
    model without any."""
    elems, q8 = [0, 0], [0, 0]
    for i, n, mod in _native_linears(model):
        elems[i] += n
        q8[i] += n if getattr(mod, "int8", False) else 0
    return (q8[0] / elems[0] if elems[0] else 0.0, q8[1] / elems[1] if elems[1] else 0.0)


def trained_net(drafter: Any, depth: int = 3) -> Any | None:
    """The trained drafter inside ``drafter`` (itself, or wrapped by union / hybrid / adaptive
    drafters): the object with a ``net`` and a ``forwards`` counter; None without one."""
    if hasattr(drafter, "net") and isinstance(getattr(drafter, "forwards", None), int):
        return drafter
    if depth == 0:
        return None
    for name in ("trained", "primary", "fallback", "inner"):
        inner = getattr(drafter, name, None)
        if inner is not None and (found := trained_net(inner, depth - 1)) is not None:
            return found
    return None


def trained_drafter_work(net: object, forwards_per_step: float) -> Work:
    """Floor of a trained head / block drafter (a FeatureNet): every forward runs the input
    projection, its layers and the attached LM-head rows (every forward is followed by logits of
    at least one row), so reads those weights once and does 2 FLOPs per weight of each. The
    fuse projection (committed tokens only) and the embedding lookup are left out: a floor may
    only undercount. Weight bytes are as packed (a bf16 LM head counts 2 bytes per weight; a
    native target's rows their GGUF block bytes, F16-packed linears 2, Q8_0 ones 34 per 32; int8
    profile linears count their operations against the int8 peak)."""
    import torch

    from specpilot.kernels.linear import QTYPES, row_bytes

    assert isinstance(net, torch.nn.Module)
    params, nbytes, q8 = 0, 0, 0
    half = getattr(net, "half_weights", False)  # linears packed as F16 (a native target)
    q8_0 = getattr(net, "q8_weights", False)  # as Q8_0 in the int8 profile (34 B / 32 weights)
    for name, w in net.named_parameters():
        if name.startswith(("in_proj", "layers.")):
            params += w.numel()
            if q8_0 and w.dim() == 2:
                nbytes += w.shape[0] * row_bytes(QTYPES["Q8_0"], w.shape[1])
                q8 += w.numel()
            else:
                nbytes += w.numel() * (2 if half and w.dim() == 2 else w.element_size())
    head = getattr(net, "head", None)
    if isinstance(head, torch.Tensor):
        packed = getattr(net, "head_fn", None)
        size = 2 if type(packed).__name__ == "_Bf16Linear" else head.element_size()
        params += head.numel()
        nbytes += head.numel() * size
    native_head = getattr(net, "native", (None, None))[1]
    if native_head is not None:  # a native target's LM-head rows, read in their GGUF blocks
        params += native_head.out_features * native_head.in_features
        nbytes += native_head.blocks.numel()
        if getattr(native_head, "int8", False):  # integer dot products: the int8 peak
            q8 += native_head.out_features * native_head.in_features
    k = forwards_per_step
    return Work(2.0 * params * k, float(nbytes) * k, 0.0, 2.0 * q8 * k)


def floor_s(
    work: Work,
    peak_flops: float,
    peak_bw: float,
    alpha: float,
    beta: float,
    peak_flops_fp64: float | None = None,
    peak_ops_int8: float | None = None,
) -> float:
    """Roofline floor in seconds: max(compute time, memory time) at the derated peaks (fp64 and
    int8 FLOPs against their own peaks; the model dtype's where those are not given)."""
    f64 = peak_flops_fp64 if peak_flops_fp64 else peak_flops
    i8 = peak_ops_int8 if peak_ops_int8 else peak_flops
    rest = work.flops - work.fp64_flops - work.int8_flops
    compute = (rest / peak_flops + work.fp64_flops / f64 + work.int8_flops / i8) / alpha
    memory = work.bytes / (beta * peak_bw)
    return max(compute, memory)
