"""``specpilot::rope_attention`` (RoPE + KV-cache write + attention of one layer in one op) is
bit-identical to the three steps it fuses: ``rope_qk``, :meth:`KVCache.write` and the fixed
attention; for one row, tree-scattered slots, batched per-row slots with a cache row offset, and
Gemma's q/k norms with a sliding-window mask; on the portable, AVX2 and (where the CPU has it)
AVX-512 paths, which also give each other's bits."""

from __future__ import annotations

import pytest
import torch

from specpilot import kernels
from specpilot.kernels import rowops
from specpilot.kvcache import KVCache

pytestmark = pytest.mark.skipif(not rowops.available(), reason="native kernels unavailable")

ISAS = [i for i in ("portable", "avx2", "avx512") if i in kernels.runnable_isas()]

H, HK, HD, LEN = 6, 2, 16, 40


def _inputs(b: int, t: int, seed: int, norms: bool) -> dict:
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, t, (H + 2 * HK) * HD, generator=g)
    cos, sin = torch.randn(b, t, 1, HD, generator=g), torch.randn(b, t, 1, HD, generator=g)
    nw = None
    if norms:
        nw = (torch.randn(HD, generator=g), torch.randn(HD, generator=g), 1e-6, True)
    return {"qkv": qkv, "cos": cos, "sin": sin, "norms": nw, "g": g}


def _cache(batch: int, seed: int) -> KVCache:
    c = KVCache(batch, HK, LEN, HD, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    c.k.copy_(torch.randn(c.k.shape, generator=g))
    c.v.copy_(torch.randn(c.v.shape, generator=g))
    return c


def _reference(inp, cache, slots, kv_len, mask, rows, scale, isa):  # type: ignore[no-untyped-def]
    from specpilot.kernels.attention import fixed_attention

    qkv, (b, t, _) = inp["qkv"], inp["qkv"].shape
    qw, kw, eps, off = inp["norms"] or (None, None, 1e-6, False)
    qk = rowops.rope_qk(qkv, qkv, inp["cos"], inp["sin"], H, HK, HD, H * HD, qw, kw, eps, off,
                        isa).view(b, t, H + HK, HD)  # fmt: skip
    v = qkv[..., (H + HK) * HD :].view(b, t, HK, HD)
    cache.write(slots, qk[:, :, H:].transpose(1, 2), v.transpose(1, 2), rows)
    r = slice(None) if rows is None else rows
    o = fixed_attention(qk[:, :, :H].transpose(1, 2), cache.k[r, :, :kv_len],
                        cache.v[r, :, :kv_len], kv_len, mask, scale, isa)  # fmt: skip
    return o.transpose(1, 2).reshape(b, t, H * HD)


def _fused(inp, cache, slots, kv_len, mask, rows, scale, isa):  # type: ignore[no-untyped-def]
    from specpilot.kernels.attention import rope_attention

    b = inp["qkv"].shape[0]
    row0 = 0 if rows is None else rows.start
    return rope_attention(inp["qkv"], inp["cos"], inp["sin"], cache.k, cache.v, slots, kv_len,
                          mask, H, HK, HD, b, row0, scale, inp["norms"], isa)  # fmt: skip


def _check(b, t, slots, kv_len, mask, rows=None, cache_b=None, norms=False, scale=None):  # type: ignore[no-untyped-def]  # fmt: skip
    first = None
    for isa in ISAS:
        inp = _inputs(b, t, 7, norms)
        ref_c, new_c = _cache(cache_b or b, 3), _cache(cache_b or b, 3)
        want = _reference(inp, ref_c, slots, kv_len, mask, rows, scale, isa)
        got = _fused(inp, new_c, slots, kv_len, mask, rows, scale, isa)
        assert got.shape == want.shape
        assert torch.equal(got, want), isa
        assert torch.equal(new_c.k, ref_c.k) and torch.equal(new_c.v, ref_c.v), isa
        first = got if first is None else first
        assert torch.equal(got.view(torch.int32), first.view(torch.int32)), isa


def test_one_row_contiguous_slot() -> None:
    _check(1, 1, 11, 12, None)


def test_prefill_block_causal_mask() -> None:
    from specpilot.model import causal_mask

    _check(1, 9, 0, 9, causal_mask(0, 9, 9, torch.device("cpu")))


def test_tree_scattered_slots() -> None:
    slots = torch.tensor([20, 21, 22, 23, 24, 25, 26])
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(1, 7, 27, generator=g) > 0.3
    mask[:, :, 0] = True
    _check(1, 7, slots, 27, mask)
    perm = torch.tensor([30, 5, 17, 2, 29, 11, 8])  # not contiguous, not sorted
    _check(1, 7, perm, 31, mask[:, :, :27].repeat(1, 1, 2)[:, :, :31])


def test_batched_per_row_slots_and_cache_rows() -> None:
    slots = torch.tensor([[10, 11, 12, 39], [4, 5, 39, 39], [20, 21, 22, 23]])  # 39: scratch
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(3, 4, 24, generator=g) > 0.4
    mask[:, :, 0] = True
    _check(3, 4, slots, 24, mask, rows=slice(1, 4), cache_b=5)
    _check(3, 4, slots, 24, mask)


def test_gemma_norms_and_sliding_window() -> None:
    from specpilot.config import window_mask
    from specpilot.model import causal_mask

    pos = torch.arange(30, 33)[None]
    full = causal_mask(30, 3, 33, torch.device("cpu"))
    local = window_mask(full, pos, 30, 33, LEN, 8)
    assert local is not None and not torch.equal(local, full)  # the window cuts keys off
    _check(1, 3, 30, 33, local, norms=True, scale=0.125)
    _check(1, 1, 32, 33, local[:, 2:], norms=True, scale=0.125)


def test_rejects_bad_slots_and_shapes() -> None:
    from specpilot.kernels.attention import rope_attention

    inp = _inputs(1, 2, 0, False)
    c = _cache(1, 0)
    args = (inp["qkv"], inp["cos"], inp["sin"], c.k, c.v)
    with pytest.raises(RuntimeError, match="exceed"):
        rope_attention(*args, LEN - 1, LEN, None, H, HK, HD)
    with pytest.raises(RuntimeError, match="outside"):
        rope_attention(*args, torch.tensor([0, LEN]), LEN, None, H, HK, HD)
    with pytest.raises(RuntimeError, match="rows of"):
        rope_attention(inp["qkv"][..., :-1], *args[1:], 0, 2, None, H, HK, HD)
    with pytest.raises(RuntimeError, match="batch rows"):
        rope_attention(*args, 0, 2, None, H, HK, HD, batch=3)
