"""``GGUFLinear``: a linear layer whose weight stays in its GGUF blocks, over the native kernels.

The functions here are the Python face of the ``specpilot::`` torch ops (see the package
docstring for the numerics contract): :func:`gguf_matmul`, :func:`gguf_matmul_multi` (several
linears of one input in one call, :class:`GGUFMultiLinear`), :func:`dequantize_rows`, plus the
checks that turn a wrong byte length into a :class:`~specpilot.errors.ModelLoadError` naming the
tensor. The ISA path is ``auto`` unless ``$SPECPILOT_KERNELS_ISA`` (or an ``isa`` argument) says
``portable``, ``avx2``, ``avx512`` (AVX-512 F/BW/DQ/VL with VNNI; the ops without an AVX-512
unit run their AVX2 path there) or ``amx`` (AVX-512 with the int8 profile's block dot products
on AMX-INT8 tiles; every other op runs its AVX-512 or AVX2 path there); every path gives the
same bits.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from specpilot.errors import ModelLoadError
from specpilot.kernels import build, int8

QTYPES = {
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 6,
    "Q8_0": 8,
    "Q4_K": 12,
    "Q6_K": 14,
    "BF16": 30,
}
"""GGML type id of every block type the kernels run in place."""
_BLOCK = {
    0: (1, 4),
    1: (1, 2),
    30: (1, 2),
    2: (32, 18),
    3: (32, 20),
    6: (32, 22),
    8: (32, 34),
    12: (256, 144),
    14: (256, 210),
}
"""type id -> (elements per block, bytes per block)."""
ISAS = {"auto": 0, "portable": 1, "avx2": 2, "avx512": 3, "amx": 4}
ROW_TILES = (1, 2, 3, 4, 8)
"""Row tiles of the native GEMM (most rows per micro-kernel; 3 lets 4 columns share 12
accumulators); 0 = the op's default."""
COL_TILES = (1, 2, 3, 4)
"""Column tiles (output columns per micro-kernel; 3 runs as 2 below 4 rows); 0 = the op's
default."""
ISA_ENV = "SPECPILOT_KERNELS_ISA"

def _ops() -> Any:
    """``torch.ops.specpilot``, built and loaded, fake kernels registered (else RuntimeError)."""
    return build.ops("gemm", _register_fakes)


def _register_fakes() -> None:
    @torch.library.register_fake("specpilot::gguf_matmul")
    def _(x, blocks, qtype, n, k, bias=None, isa=0, row_tile=0, col_tile=0):  # type: ignore[no-untyped-def]
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("specpilot::gguf_matmul_multi")
    def _(x, blocks, qtypes, ns, k, bias=None, isa=0, row_tile=0, col_tile=0):  # type: ignore[no-untyped-def]
        return x.new_empty((x.shape[0], sum(ns)))

    @torch.library.register_fake("specpilot::gguf_matmul_reference")
    def _(x, blocks, qtype, n, k, bias=None, lanes=8):  # type: ignore[no-untyped-def]
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("specpilot::gguf_dequantize")
    def _(blocks, qtype, n, k, rows):  # type: ignore[no-untyped-def]
        return blocks.new_empty((rows.numel(), k), dtype=torch.float32)


def available() -> bool:
    """True when the kernels built (or were cached) and loaded."""
    return build.load() is None


def runnable_isas() -> list[str]:
    """The ISA paths this CPU runs (``portable`` first, then ``avx2``, ``avx512``, ``amx``); []
    when the kernels are unavailable. Every one gives the same bits."""
    if not available():
        return []
    return [n for n, c in ISAS.items() if c and _ops().isa_available(c) == 1]


def unavailable_reason() -> str | None:
    """One line saying why the kernels cannot run here, or None when they can."""
    return build.load()


def supports(qtype: int) -> bool:
    """Whether tensors of GGML type ``qtype`` can stay in their blocks (else: dequantize them)."""
    return int(qtype) in _BLOCK


def row_bytes(qtype: int, k: int) -> int:
    elems, nbytes = _BLOCK[int(qtype)]
    if k % elems:
        raise ValueError(f"k={k} is not a multiple of the block size {elems}")
    return k // elems * nbytes


def isa_code(isa: str | None = None) -> int:
    name = isa if isa is not None else os.environ.get(ISA_ENV, "auto")
    if name not in ISAS:
        raise ValueError(f"unknown kernel ISA {name!r}; use one of {', '.join(ISAS)}")
    return ISAS[name]


def check_blocks(blocks: Tensor, qtype: int, n: int, k: int, name: str) -> Tensor:
    """``blocks`` as a contiguous uint8 tensor; ModelLoadError naming ``name`` if malformed."""
    if not supports(qtype):
        raise ModelLoadError(f"tensor {name}: GGML type {qtype} has no native kernel")
    elems = _BLOCK[int(qtype)][0]
    if n <= 0 or k <= 0 or k % elems:
        raise ModelLoadError(
            f"tensor {name}: shape ({n}, {k}) does not fit blocks of {elems} elements"
        )
    flat = blocks.detach().contiguous().view(torch.uint8).reshape(-1)
    want = n * row_bytes(qtype, k)
    if flat.numel() != want:
        raise ModelLoadError(
            f"tensor {name}: truncated or corrupt block data: {flat.numel()} bytes, "
            f"a ({n}, {k}) tensor of this type needs {want}"
        )
    return flat


def gguf_matmul(
    x: Tensor,
    blocks: Tensor,
    qtype: int,
    n: int,
    k: int,
    bias: Tensor | None = None,
    isa: str | None = None,
    row_tile: int = 0,
    col_tile: int = 0,
) -> Tensor:
    """``y[..., n] = x[..., k] . W^T (+ bias)`` with W in GGUF blocks, under the contract."""
    lead = x.shape[:-1]
    y = _ops().gguf_matmul(
        x.reshape(-1, k), blocks, int(qtype), n, k, bias, isa_code(isa), row_tile, col_tile
    )
    return y.reshape(*lead, n)


def gguf_matmul_reference(
    x: Tensor,
    blocks: Tensor,
    qtype: int,
    n: int,
    k: int,
    bias: Tensor | None = None,
    lanes: int = 8,
) -> Tensor:
    """The plain single-thread reference order with ``lanes`` lanes (8 is the contract)."""
    return _ops().gguf_matmul_reference(x.reshape(-1, k), blocks, int(qtype), n, k, bias, lanes)


def dequantize_rows(blocks: Tensor, qtype: int, n: int, k: int, rows: Tensor) -> Tensor:
    """fp32 rows ``rows`` of the (n, k) weight, bit-identical to ``gguf.quants.dequantize``."""
    return _ops().gguf_dequantize(blocks, int(qtype), n, k, rows.reshape(-1))


def reader_blocks(tensor: Any) -> tuple[Tensor, int, int, int]:
    """(raw bytes, type id, n, k) of a 2-D ``gguf.GGUFReader`` tensor, without dequantizing."""
    shape = [int(s) for s in tensor.shape.tolist()]
    if len(shape) != 2:
        raise ModelLoadError(f"tensor {tensor.name}: expected 2 dimensions, got {len(shape)}")
    k, n = shape
    raw = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(-1)
    return torch.from_numpy(raw.copy()), int(tensor.tensor_type), n, k


_VERSION = [0]


def _changed() -> None:
    _VERSION[0] += 1


def schedule_version() -> int:
    """A counter bumped by every change of a GGUFLinear's tiles or numerics profile: a view of
    the linears taken once (the lean forward's op plan, :mod:`specpilot.kernels.step`) is stale
    when it moved."""
    return _VERSION[0]


class GGUFLinear(nn.Module):
    """``y = x W^T + b`` with W kept as raw GGUF blocks (a uint8 buffer) and run natively."""

    def __init__(
        self,
        blocks: Tensor,
        qtype: int,
        out_features: int,
        in_features: int,
        bias: Tensor | None = None,
        name: str = "weight",
    ) -> None:
        super().__init__()
        self.qtype = int(qtype)
        self.out_features, self.in_features = int(out_features), int(in_features)
        self.register_buffer(
            "blocks", check_blocks(blocks, self.qtype, out_features, in_features, name)
        )
        if bias is not None and bias.numel() != out_features:
            raise ModelLoadError(
                f"tensor {name}: bias has {bias.numel()} elements, expected {out_features}"
            )
        b = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self.register_buffer("bias", b)
        self._isa = isa_code()
        # built and loaded now, so forward is one op call (torch.compile traces it)
        self._op = _ops().gguf_matmul.default
        self._profile = int8.DEFAULT_PROFILE
        self.qcode = self.qtype
        """The type the op is given: ``qtype``, flagged :data:`int8.PACKED` while the blocks are
        in the AVX-512 path's packed layout (:attr:`packed`)."""
        self._dense: Tensor | None = None
        self.tiles: tuple[tuple[int, int], tuple[int, int]] = ((0, 0), (0, 0))
        """(row tile, column tile) of one-row calls and of multi-row calls; see set_schedule."""

    @classmethod
    def from_reader_tensor(cls, tensor: Any, bias: Tensor | None = None) -> GGUFLinear:
        blocks, qtype, n, k = reader_blocks(tensor)
        return cls(blocks, qtype, n, k, bias, name=str(tensor.name))

    def forward(self, x: Tensor) -> Tensor:
        n, k = self.out_features, self.in_features
        if x.dim() == 2 and x.dtype == torch.float32:  # the common case: no reshapes
            rt, ct = self.tiles[x.shape[0] > 1]
            return self._op(x, self.blocks, self.qcode, n, k, self.bias, self._isa, rt, ct)
        x2 = x.reshape(-1, k).to(torch.float32)
        rt, ct = self.tiles[x2.shape[0] > 1]
        y = self._op(x2, self.blocks, self.qcode, n, k, self.bias, self._isa, rt, ct)
        return y.reshape(*x.shape[:-1], n)

    @property
    def isa(self) -> int:
        """The op's ISA code (:func:`isa_code`); setting it re-applies the numerics profile (the
        packed layout runs on the AVX-512 path only)."""
        return self._isa

    @isa.setter
    def isa(self, code: int) -> None:
        self._isa = int(code)
        self.profile = self._profile

    @property
    def packed(self) -> bool:
        """Whether the blocks are in the AVX-512 path's packed layout: Q4_0 / Q4_1 / Q8_0
        weights in the int8 profile where that path runs (the same bytes reordered, so the
        transposition and scale gather of its schedule are done once; :func:`int8.pack`).
        ``$SPECPILOT_Q8_PACK`` ``0`` keeps the GGUF order. Either layout gives the same bits."""
        return self.qcode != self.qtype

    def _set_packed(self, on: bool) -> None:
        if on == self.packed:
            return
        n, k = self.out_features, self.in_features
        self.blocks.copy_(int8.pack(self.blocks, self.qtype, n, k, unpack=not on))
        self.qcode = self.qtype | int8.PACKED if on else self.qtype

    def gguf_blocks(self) -> Tensor:
        """The blocks in GGUF order (a copy while :attr:`packed`, else the buffer itself)."""
        if not self.packed:
            return self.blocks
        return int8.pack(self.blocks, self.qtype, self.out_features, self.in_features, True)

    def set_schedule(
        self, single: tuple[int, int] = (0, 0), multi: tuple[int, int] = (0, 0)
    ) -> None:
        """The GEMM's (row tile, column tile) for one-row calls (plain decoding) and for
        multi-row calls (verify, prefill); 0 = the op's default (one row: 1 x 4, two: 2 x 4,
        three: 3 x 4, from four rows 4 x 3: decoded panels, except four rows of a 32-element
        block type (Q4_0/Q4_1/Q5_0/Q8_0), which decode in registers; a remainder in blocks of 3).
        Tiles change the schedule only, never a bit of the output (the numerics contract).
        ValueError for a tile outside :data:`ROW_TILES` / :data:`COL_TILES`."""
        for rt, ct in (single, multi):
            if rt not in (0, *ROW_TILES) or ct not in (0, *COL_TILES):
                raise ValueError(
                    f"kernel tiles ({rt}, {ct}): row tile must be 0 or one of {ROW_TILES}, "
                    f"column tile 0 or one of {COL_TILES}"
                )
        self.tiles = ((int(single[0]), int(single[1])), (int(multi[0]), int(multi[1])))
        _changed()

    @property
    def profile(self) -> str:
        """The numerics profile, ``fp32`` (default) or ``int8`` (:mod:`specpilot.kernels.int8`);
        a weight type without an int8 kernel runs its fp32-activation kernel in either."""
        return self._profile

    @profile.setter
    def profile(self, name: str) -> None:
        int8.check_profile(name)
        use_q8 = name == "int8" and int8.int8_supports(self.qtype)
        pack = use_q8 and int8.packs(self.qtype, self.out_features, self._isa)
        self._set_packed(pack)
        self._op = int8.q8_op() if use_q8 else _ops().gguf_matmul.default
        self._profile = name
        _changed()

    @property
    def int8(self) -> bool:
        """True when the GEMM runs the int8-activation kernel (the ``int8`` profile and a weight
        type it covers)."""
        return self._profile == "int8" and int8.int8_supports(self.qtype)

    @property
    def weight(self) -> Tensor:
        """The fp32 weight (n, k), dequantized on first access and kept (for drafters that
        share it); the forward never uses it."""
        if self._dense is None:
            rows = torch.arange(self.out_features)
            self._dense = dequantize_rows(
                self.gguf_blocks(), self.qtype, self.out_features, self.in_features, rows
            )
        return self._dense

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, qtype={self.qtype}"


def gguf_matmul_multi(
    x: Tensor,
    parts: list[tuple[Tensor, int, int]],
    k: int,
    bias: Tensor | None = None,
    isa: str | None = None,
    row_tile: int = 0,
    col_tile: int = 0,
) -> Tensor:
    """Several linears of one x in one op call: ``cat([gguf_matmul(x, b, t, n, k) for (b, t, n)
    in parts], -1) (+ bias)``, bit for bit (each column by the same kernel as the separate call),
    one thread fork-join for all; the parts may differ in block type. ``bias``: sum of n."""
    lead = x.shape[:-1]
    blocks, qtypes, ns = [p[0] for p in parts], [int(p[1]) for p in parts], [p[2] for p in parts]
    y = _ops().gguf_matmul_multi(
        x.reshape(-1, k), blocks, qtypes, ns, k, bias, isa_code(isa), row_tile, col_tile
    )
    return y.reshape(*lead, sum(ns))


class GGUFMultiLinear(nn.Module):
    """Linears of one input fused into one op call (``specpilot::gguf_matmul_multi``): the
    output is the parts' outputs concatenated, ``cat([p(x) for p in parts], -1)``, bit for bit,
    with one fork-join instead of one per part (q/k/v of different block types, e.g. Gemma 3's
    Q5_0 q/k and Q8_0 v). The parts stay modules (their tiles and numerics profile are set as
    any GGUFLinear's; the first part's tiles apply). All parts in the int8 profile run
    ``specpilot::gguf_matmul_q8_multi`` (x quantized once); mixed profiles, a type without an
    int8 kernel or a part swapped for another module run the parts' own forwards."""

    def __init__(self, parts: list[GGUFLinear]) -> None:
        super().__init__()
        if not parts or len({p.in_features for p in parts}) != 1:
            raise ValueError("GGUFMultiLinear needs one or more parts with one input width")
        if len({p.bias is None for p in parts}) != 1:
            raise ValueError("GGUFMultiLinear needs a bias on every part or on none")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self._qtypes = [p.qtype for p in parts]
        self._ns = [p.out_features for p in parts]
        b = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
        self.register_buffer("bias", b, persistent=False)
        self._op = _ops().gguf_matmul_multi.default

    def _fused_op(self, parts: list[nn.Module]) -> Any:
        """The fused op the parts allow (fp32 or int8 profile, all alike), else None."""
        if not all(isinstance(p, GGUFLinear) for p in parts):
            return None
        profiles = {p._profile for p in parts}  # type: ignore[union-attr]
        if profiles == {"fp32"}:
            return self._op
        if profiles == {"int8"} and all(int8.int8_supports(t) for t in self._qtypes):
            return int8.q8_multi_op()
        return None

    def forward(self, x: Tensor) -> Tensor:
        parts = list(self.parts)
        op = self._fused_op(parts)
        if op is None:  # mixed profiles, a type without an int8 kernel, a part swapped out
            return torch.cat([p(x) for p in parts], dim=-1)
        head, k = parts[0], self.in_features
        x2 = x if x.dim() == 2 and x.dtype == torch.float32 else x.reshape(-1, k).float()
        rt, ct = head.tiles[x2.shape[0] > 1]
        blocks = [p.blocks for p in parts]
        qcodes = [p.qcode for p in parts]  # type: ignore[union-attr]
        y = op(x2, blocks, qcodes, self._ns, k, self.bias, head.isa, rt, ct)
        return y if x2 is x else y.reshape(*x.shape[:-1], self.out_features)

    @property
    def int8(self) -> bool:
        """True when the GEMM runs the int8-activation kernel (the ``int8`` profile and a weight
        type it covers)."""
        return self._profile == "int8" and int8.int8_supports(self.qtype)

    @property
    def weight(self) -> Tensor:
        """The parts' fp32 weights stacked (see GGUFLinear.weight); the forward never uses it."""
        return torch.cat([p.weight for p in self.parts])

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, qtypes={self._qtypes}"


def set_schedule(
    module: nn.Module, single: tuple[int, int] = (0, 0), multi: tuple[int, int] = (0, 0)
) -> int:
    """:meth:`GGUFLinear.set_schedule` on every GGUFLinear in ``module`` (e.g. a whole
    :class:`specpilot.model.Transformer`); returns how many it set (0: no native weights)."""
    mods = [m for m in module.modules() if isinstance(m, GGUFLinear)]
    for m in mods:
        m.set_schedule(single, multi)
    return len(mods)


class GGUFEmbedding(nn.Module):
    """Token embedding over GGUF blocks: a lookup dequantizes only the rows it reads."""

    def __init__(
        self, blocks: Tensor, qtype: int, num: int, dim: int, name: str = "weight"
    ) -> None:
        super().__init__()
        self.qtype, self.num_embeddings, self.embedding_dim = int(qtype), int(num), int(dim)
        self.register_buffer("blocks", check_blocks(blocks, self.qtype, num, dim, name))
        self.qcode = self.qtype
        """The type the lookup op is given: flagged :data:`int8.PACKED` while a tied LM head
        keeps the shared blocks packed (each row is then read from its unpacked pair)."""
        self._op = _ops().gguf_dequantize.default
        self._dense: Tensor | None = None

    def forward(self, tokens: Tensor) -> Tensor:
        rows = self._op(self.blocks, self.qcode, self.num_embeddings, self.embedding_dim, tokens)
        return rows.reshape(*tokens.shape, self.embedding_dim)

    @property
    def int8(self) -> bool:
        """True when the GEMM runs the int8-activation kernel (the ``int8`` profile and a weight
        type it covers)."""
        return self._profile == "int8" and int8.int8_supports(self.qtype)

    @property
    def weight(self) -> Tensor:
        """The fp32 table, dequantized on first access and kept (see GGUFLinear.weight)."""
        if self._dense is None:
            rows = torch.arange(self.num_embeddings)
            self._dense = self(rows)
        return self._dense
