"""The int8-activation numerics profile: Q8 activation blocks and integer block dot products.

The Python face of the ``specpilot::q8_quantize`` and ``specpilot::gguf_matmul_q8`` ops (the
contract is in the package docstring, next to the fp32 one): :data:`PROFILES` names the numerics
profiles, :func:`int8_supports` says which weight types have an int8 kernel (the others keep the
fp32-activation kernel in this profile), :func:`quantize_rows` gives the Q8 blocks of x, and
:func:`gguf_matmul_int8` runs the profile's GEMM.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

from specpilot.kernels import build

PROFILES = ("fp32", "int8")
"""Numerics profiles of the native kernels: fp32 activations (the default) or int8 (Q8 blocks)."""
DEFAULT_PROFILE = "fp32"
INT8_QTYPES = frozenset({2, 3, 6, 8, 12, 14})
"""GGML type ids with an int8-activation kernel: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K."""
PACKED = 0x100
"""Flag on a type id whose blocks are in the AVX-512 path's packed layout (:func:`pack`)."""
PACK_ENV = "SPECPILOT_Q8_PACK"
"""``0``: never pack (the GGUF order on every path; the same bits either way)."""


def register_fakes() -> None:
    """Fake (meta) kernels so torch.compile can trace the int8 ops."""

    @torch.library.register_fake("specpilot::gguf_matmul_q8")
    def _(x, blocks, qtype, n, k, bias=None, isa=0, row_tile=0, col_tile=0):  # type: ignore[no-untyped-def]
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("specpilot::gguf_matmul_q8_multi")
    def _(x, blocks, qtypes, ns, k, bias=None, isa=0, row_tile=0, col_tile=0):  # type: ignore[no-untyped-def]
        return x.new_empty((x.shape[0], sum(ns)))

    @torch.library.register_fake("specpilot::q8_pack")
    def _(blocks, qtype, n, k, unpack=False):  # type: ignore[no-untyped-def]
        return torch.empty_like(blocks)

    @torch.library.register_fake("specpilot::q8_quantize")
    def _(x):  # type: ignore[no-untyped-def]
        m, k = x.shape
        return (
            x.new_empty((m, k), dtype=torch.int8),
            x.new_empty((m, k // 32)),
            x.new_empty((m, k // 32)),
        )


def check_profile(profile: str) -> str:
    """``profile`` if it names a numerics profile, else ValueError with the choices."""
    if profile not in PROFILES:
        raise ValueError(f"unknown numerics profile {profile!r}; use one of {', '.join(PROFILES)}")
    return profile


def int8_supports(qtype: int) -> bool:
    """Whether GGML type ``qtype`` has an int8-activation kernel."""
    return int(qtype) in INT8_QTYPES


def _ops() -> Any:
    """``torch.ops.specpilot``, built and loaded, int8 fakes registered (else RuntimeError)."""
    return build.ops("int8", register_fakes)


def q8_op() -> Any:
    """The int8 GEMM op overload (the same signature as ``specpilot::gguf_matmul``)."""
    return _ops().gguf_matmul_q8.default


def q8_multi_op() -> Any:
    """The fused int8 op overload (``specpilot::gguf_matmul_q8_multi``: several linears of one
    x, quantized once; the signature of ``specpilot::gguf_matmul_multi``)."""
    return _ops().gguf_matmul_q8_multi.default


def packs(qtype: int, n: int, isa: int) -> bool:
    """Whether an (n, k) weight of ``qtype`` runs packed with ISA code ``isa``: Q4_0 / Q4_1 /
    Q8_0, n even, the AVX-512 path picked (not AMX), and :data:`PACK_ENV` not ``0``."""
    if os.environ.get(PACK_ENV) == "0" or n % 2:
        return False
    return bool(_ops().q8_packs(int(qtype), int(isa)))


PREFETCH_COLUMNS = (0, 4, 8, 16, 32, 64)
"""Software prefetch distances of the int8 GEMMs' weight stream, in columns, that the
``kernel_prefetch`` mechanism tries (0: each schedule's own, 8 columns in GGUF order and 16 in
the packed layout)."""


def set_prefetch(columns: int) -> int:
    """Stream every int8 GEMM's weights ``columns`` output columns ahead of the one being computed
    (software prefetch; 0: each schedule's own distance), for all calls in this process, as
    ``torch.set_num_threads`` sets the thread count; returns the previous setting. A schedule
    choice: no output changes by a bit (tests/test_kernels_packed.py). ValueError for a negative
    or absurd distance."""
    if not isinstance(columns, int) or isinstance(columns, bool) or not 0 <= columns <= 1 << 20:
        raise ValueError(f"prefetch distance must be an integer number of columns >= 0, got "
                         f"{columns!r}")  # fmt: skip
    return int(_ops().q8_prefetch(columns))


def prefetch() -> int:
    """The int8 GEMMs' prefetch distance in columns (0: each schedule's own)."""
    return int(_ops().q8_prefetch(-1))


def pack(blocks: Tensor, qtype: int, n: int, k: int, unpack: bool = False) -> Tensor:
    """The (n, k) ``qtype`` (Q4_0 / Q4_1 / Q8_0) ``blocks`` reordered into the AVX-512 path's
    packed layout (per pair of columns and group of 8 blocks, the 4 vectors (Q8_0: 8) its
    schedule reads, then the group's 16 scales (and mins); the trailing blocks compacted the same
    way: csrc/gemm_q8.h), or back with ``unpack``: a new tensor of the same size. The GEMM runs
    either layout to the same bits, the packed one given ``qtype | PACKED``."""
    return _ops().q8_pack(blocks, int(qtype), int(n), int(k), bool(unpack))


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(q int8 (m, k), d (m, k/32), s (m, k/32)) of the rows of x, as the int8 GEMM sees them."""
    return _ops().q8_quantize(x.reshape(-1, x.shape[-1]).to(torch.float32))


def dequantize_q8(q: Tensor, d: Tensor) -> Tensor:
    """The fp64 values the quantized rows stand for, ``q * d`` per block of 32."""
    m, k = q.shape
    return (q.double().reshape(m, k // 32, 32) * d.double().unsqueeze(-1)).reshape(m, k)


def gguf_matmul_int8(
    x: Tensor,
    blocks: Tensor,
    qtype: int,
    n: int,
    k: int,
    bias: Tensor | None = None,
    isa: int = 0,
    row_tile: int = 0,
    col_tile: int = 0,
) -> Tensor:
    """``y[..., n] = q8(x)[..., k] . W^T (+ bias)`` with W in GGUF blocks, int8 profile;
    ``isa`` is the op's code (0 auto, 1 portable, 2 avx2: ``linear.isa_code``)."""
    lead = x.shape[:-1]
    y = _ops().gguf_matmul_q8(
        x.reshape(-1, k), blocks, int(qtype), n, k, bias, int(isa), row_tile, col_tile
    )
    return y.reshape(*lead, n)
