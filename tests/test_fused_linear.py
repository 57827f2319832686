"""Fused linears of one input (``specpilot::gguf_matmul_multi``, its int8 twin
``gguf_matmul_q8_multi``, ``GGUFMultiLinear``): bit for bit the separate calls concatenated, for
every block type, mixed types in one call, row counts 1..9, one and two threads, both ISA paths,
tiles and biases; the fake kernels; and the whole native model (module and lean forwards, both
numerics profiles) with and without the fusion."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
import torch

from specpilot import kernels
from specpilot.loading.native import load_native
from specpilot.model import Transformer

from .test_kernels import ALL, ISAS, as_tensor, qt, random_weight
from .test_lean_step import _drive
from .test_native_load import files  # noqa: F401  (the tiny GGUF files fixture)

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=kernels.unavailable_reason() or "kernels unavailable"
)

K = 512


def parts_of(
    names: list[str], ns: list[int], seed: int, k: int = K
) -> list[tuple[torch.Tensor, int, int]]:
    return [
        (as_tensor(random_weight(nm, n, k, seed + i)), qt(nm), n)
        for i, (nm, n) in enumerate(zip(names, ns, strict=True))
    ]


def separate(x, parts, bias, isa, rt=0, ct=0):  # type: ignore[no-untyped-def]
    outs, off = [], 0
    for blocks, t, n in parts:
        b = None if bias is None else bias[off : off + n].contiguous()
        outs.append(kernels.gguf_matmul(x, blocks, t, n, K, b, isa, rt, ct))
        off += n
    return torch.cat(outs, dim=-1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_equals_separate_calls_every_type(name: str, threads: int) -> None:
    """The type under test between two others (mixed types in one call), widths that are not
    multiples of the column unit (12), rows 1..9, with and without bias, both ISA paths."""
    others = {"Q8_0": "Q6_K", "Q6_K": "Q4_1"}
    names = [others.get(name, "Q8_0"), name, "Q5_0"]
    parts = parts_of(names, [301, 77, 150], seed=len(name) * 7 + threads)
    total = sum(p[2] for p in parts)
    g = torch.Generator().manual_seed(threads)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in range(1, 10):
            x = torch.randn(m, K, generator=g)
            for bias in (None, torch.randn(total, generator=g)):
                for isa in ISAS:
                    got = kernels.gguf_matmul_multi(x, parts, K, bias, isa)
                    assert same_bits(got, separate(x, parts, bias, isa)), (m, isa, bias is None)
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_int8_equals_separate_int8_calls(name: str, threads: int) -> None:
    """The int8 profile's fused op (x quantized once) against separate gguf_matmul_q8 calls."""
    others = {"Q8_0": "Q4_0", "Q4_0": "Q6_K"}
    names = [others.get(name, "Q8_0"), name, "Q5_0"]
    parts = parts_of(names, [301, 77, 150], seed=len(name) * 5 + threads)
    fused_int8_equals_separate(parts, K, range(1, 10), threads)
    op = torch.ops.specpilot.gguf_matmul_q8_multi
    with pytest.raises(RuntimeError, match="no int8 kernel"):
        op(torch.randn(9, K), [parts[0][0]], [qt("F16")], [parts[0][2]], K)


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_int8_with_a_trailing_group_equals_separate_calls(threads: int) -> None:
    """Rows of 18 blocks (SmolLM2's k = 576: a trailing group of 2) at the blocks-across-lanes
    schedule's row counts: the fused op, whose parts each bound their own in-place reads,
    against separate calls, every weight type that has a trailing group."""
    k = 32 * 18
    parts = parts_of(["Q8_0", "Q4_1", "Q5_0", "Q4_0"], [37, 13, 29, 11], seed=60 + threads, k=k)
    fused_int8_equals_separate(parts, k, (3, 8, 16), threads)


def fused_int8_equals_separate(
    parts: list[tuple[torch.Tensor, int, int]], k: int, rows: Iterable[int], threads: int
) -> None:
    """The int8 fused op over ``parts`` equals separate gguf_matmul_q8 calls, bit for bit, at
    each row count, with and without bias, on every ISA path."""
    total = sum(p[2] for p in parts)
    op = torch.ops.specpilot.gguf_matmul_q8_multi
    g = torch.Generator().manual_seed(threads)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in rows:
            x = torch.randn(m, k, generator=g)
            for bias in (None, torch.randn(total, generator=g)):
                for isa in ISAS:
                    code = kernels.linear.isa_code(isa)
                    outs, off = [], 0
                    for blocks, t, n in parts:
                        b = None if bias is None else bias[off : off + n].contiguous()
                        outs.append(kernels.gguf_matmul_int8(x, blocks, t, n, k, b, code))
                        off += n
                    blocks, types = [p[0] for p in parts], [p[1] for p in parts]
                    got = op(x, blocks, types, [p[2] for p in parts], k, bias, code)
                    assert same_bits(got, torch.cat(outs, dim=-1)), (m, isa, bias is None)
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("tiles", [(1, 1), (2, 3), (3, 4), (4, 2), (8, 4)])
def test_fused_tiles_and_a_single_part(tiles: tuple[int, int]) -> None:
    parts = parts_of(["Q4_K", "F16", "Q4_0"], [25, 260, 12], seed=3)
    g = torch.Generator().manual_seed(1)
    for m in (1, 3, 6):
        x = torch.randn(m, K, generator=g)
        want = separate(x, parts, None, None)
        assert same_bits(kernels.gguf_matmul_multi(x, parts, K, None, None, *tiles), want)
        one = kernels.gguf_matmul_multi(x, parts[1:2], K, None, None, *tiles)
        assert same_bits(one, want[:, 25:285])


def test_fused_output_shape_and_zero_rows() -> None:
    parts = parts_of(["Q8_0", "Q4_1"], [13, 40], seed=5)
    x = torch.randn(2, 3, K)
    y = kernels.gguf_matmul_multi(x, parts, K)
    assert y.shape == (2, 3, 53)
    assert same_bits(y.reshape(6, 53), separate(x.reshape(6, K), parts, None, None))
    assert kernels.gguf_matmul_multi(torch.empty(0, K), parts, K).shape == (0, 53)


def test_fused_bad_input_is_rejected() -> None:
    parts = parts_of(["Q8_0", "Q4_1"], [13, 40], seed=6)
    blocks, types, ns = [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts]
    op = torch.ops.specpilot.gguf_matmul_multi
    x = torch.randn(1, K)
    with pytest.raises(RuntimeError, match="one type and one n"):
        op(x, blocks, types[:1], ns, K)
    with pytest.raises(RuntimeError, match="bias must be"):
        op(x, blocks, types, ns, K, torch.zeros(13))
    with pytest.raises(RuntimeError, match="blocks hold"):
        op(x, blocks, types, [14, 40], K)
    with pytest.raises(RuntimeError, match="x must be"):
        op(torch.randn(1, K + 32), blocks, types, ns, K)


def test_fused_op_has_a_fake_kernel() -> None:
    parts = parts_of(["Q5_0", "Q8_0"], [24, 12], seed=7)
    args = (torch.randn(3, K), [p[0] for p in parts], [p[1] for p in parts], [24, 12], K)
    kernels.gguf_matmul_multi(args[0], parts, K)  # loads the ops and registers the fakes
    torch.library.opcheck(torch.ops.specpilot.gguf_matmul_multi.default, args)
    kernels.int8.q8_multi_op()  # registers the int8 fakes
    torch.library.opcheck(torch.ops.specpilot.gguf_matmul_q8_multi.default, args)


def test_multi_linear_module_is_its_parts_concatenated() -> None:
    shapes = [("Q5_0", 64), ("Q5_0", 16), ("Q8_0", 16)]
    lins = [
        kernels.GGUFLinear(as_tensor(random_weight(nm, n, K, i)), qt(nm), n, K, torch.randn(n))
        for i, (nm, n) in enumerate(shapes)
    ]
    fused = kernels.GGUFMultiLinear(lins)
    assert fused.out_features == 96 and fused.in_features == K
    for shape in [(1, K), (4, K), (2, 5, K)]:
        x = torch.randn(*shape)
        assert same_bits(fused(x), torch.cat([m(x) for m in lins], dim=-1))
    kernels.linear.set_schedule(fused, (1, 2), (4, 3))
    assert all(m.tiles == ((1, 2), (4, 3)) for m in lins)
    x = torch.randn(5, K)
    assert same_bits(fused(x), torch.cat([m(x) for m in lins], dim=-1))
    lins[0].profile = "int8"  # mixed profiles: the parts' own ops
    assert same_bits(fused(x), torch.cat([m(x) for m in lins], dim=-1))
    for m in lins:
        m.profile = "int8"  # the fused int8 op
    assert fused._fused_op(list(fused.parts)) is kernels.int8.q8_multi_op()
    assert same_bits(fused(x), torch.cat([m(x) for m in lins], dim=-1))
    assert torch.equal(fused.weight, torch.cat([m.weight for m in lins]))
    fused.parts[1] = torch.nn.Identity()  # a part swapped out: the parts' own forwards
    want = torch.cat([lins[0](x), x, lins[2](x)], dim=-1)
    assert same_bits(fused(x), want)
    with pytest.raises(ValueError, match="one input width"):
        kernels.GGUFMultiLinear([lins[0], kernels.GGUFLinear(
            as_tensor(random_weight("Q8_0", 4, 256, 0)), qt("Q8_0"), 4, 256)])  # fmt: skip


def unfuse(m: Transformer) -> int:
    """Replace every GGUFMultiLinear of ``m`` by its parts as separate modules."""
    count = 0
    for layer in m.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        if isinstance(att.qkv, kernels.GGUFMultiLinear):
            att.q_proj, att.k_proj, att.v_proj = att.qkv.parts
            att.qkv = None
            count += 1
        if isinstance(mlp.gate_up, kernels.GGUFMultiLinear):
            mlp.gate_proj, mlp.up_proj = mlp.gate_up.parts
            mlp.gate_up = None
            count += 1
    return count


@pytest.mark.parametrize("name", ["llama", "gemma3"])
@pytest.mark.parametrize(("lean", "numerics"), [(True, "fp32"), (False, "fp32"), (True, "int8")])
def test_model_bits_with_and_without_fusion(
    name: str,
    lean: bool,
    numerics: str,
    files: dict[str, Path],  # noqa: F811
) -> None:
    fused, plain = load_native(files[name])[0], load_native(files[name])[0]
    fused.set_numerics(numerics)
    plain.set_numerics(numerics)
    assert any(isinstance(mod, kernels.GGUFMultiLinear) for mod in fused.modules())
    assert unfuse(plain) >= 1  # the mixed-type layers were fused at load
    if not lean:
        fused._lean_plan = lambda: None
        plain._lean_plan = lambda: None
    with torch.inference_mode():
        got, want = _drive(fused, fused.cfg.vocab_size), _drive(plain, plain.cfg.vocab_size)
    assert (fused._plan is not None) == lean
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert same_bits(a, b), i
    assert np.isfinite(got[0].numpy()).all()
