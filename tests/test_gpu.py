"""GPU paths (bf16/fp16 on CUDA). Deselected by default; run with ``pytest -m gpu`` on a GPU."""

from __future__ import annotations

import pytest
import torch

from specpilot.engine import Engine, EngineConfig, GenerationConfig
from specpilot.forcing import Reference, check
from specpilot.tree import TreeSpec

from .conftest import tiny_model
from .test_engine import OracleDrafter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["chain", "dynamic"])
def test_speculative_matches_ar_on_gpu(dtype: str, kind: str) -> None:
    model = tiny_model("qwen3", seed=4).to(device="cuda", dtype=getattr(torch, dtype))
    eng = Engine(model, EngineConfig(device="cuda", dtype=dtype))
    assert eng.attention == "sdpa"
    gen = GenerationConfig(max_new_tokens=48, stop_on_eos=False, record_margins=True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = eng.generate(prompt, gen)
    spec = TreeSpec(kind=kind, k=4, budget=12, topk=3, depth=5)
    res = eng.generate(
        prompt,
        GenerationConfig(max_new_tokens=48, stop_on_eos=False),
        drafter=OracleDrafter(ref.tokens, 64, 0.8, 0),
        spec=spec,
    )
    # GPU kernels are not batch-invariant: a divergence is acceptable only at a near-tie.
    report = check(
        [Reference("p", tuple(ref.tokens), tuple(ref.margins))],
        {"p": res.tokens},
        strict=False,
        near_tie=0.05 if dtype != "float32" else 1e-3,
    )
    assert report.ok, report.summary()
    assert res.tau > 1.5


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_fixed_width_is_bit_identical_on_gpu(graphs: bool) -> None:
    """Stock GPU kernels at one shape per call: plain decoding and chain verification fill
    bit-identical KV caches (bench/gpu_check.py measures that they differ without it)."""
    from .test_fastverify import plain_vs_chain, stock_model

    model = stock_model().to(device="cuda", dtype=torch.bfloat16)
    cfg = EngineConfig(device="cuda", dtype="bfloat16", fixed_width=6, cuda_graphs=graphs)
    eng = Engine(model, cfg)
    assert plain_vs_chain(eng, model) == (4, 4)
    assert eng._fast is not None and (eng._fast.replays > 0) == graphs


def test_fixed_width_batched_rows_are_plain_rows_on_gpu() -> None:
    from .test_fastverify import batched_rows_match, stock_model

    assert batched_rows_match(stock_model().to(device="cuda", dtype=torch.bfloat16), 5)
