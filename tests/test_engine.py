"""Engine: speculative greedy equals plain greedy, bit for bit, for every tree shape."""

from __future__ import annotations

import random

import pytest
import torch

from specpilot.drafters.base import DraftContext
from specpilot.engine import Engine, EngineConfig, GenerationConfig
from specpilot.errors import ConfigError, ContextLengthError
from specpilot.model import Transformer, causal_mask
from specpilot.tree import DraftTree, TreeSpec

from .conftest import tiny_model

SPECS = [
    TreeSpec(kind="chain", k=4),
    TreeSpec(kind="static", paths=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))),
    TreeSpec(kind="dynamic", budget=12, topk=3, depth=5),
]


class OracleDrafter:
    """Knows the reference continuation; hides it among decoys at a random sibling rank."""

    name = "oracle"
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, reference: list[int], vocab: int, hit_rate: float, seed: int) -> None:
        self.ref, self.vocab, self.hit = reference, vocab, hit_rate
        self.rng = random.Random(seed)

    def begin(self, prompt: list[int]) -> None:
        self.p = len(prompt)

    def finish(self, tokens: list[int]) -> None:
        pass

    def propose(self, ctx: DraftContext) -> DraftTree:
        spec = ctx.spec
        done = len(ctx.tokens) - self.p  # generated tokens so far
        toks, parents, scores = [], [], []
        frontier = [(-1, True, 0.0)]  # (node, on the true path, score)
        for d in range(spec.max_depth):
            nxt = []
            for node, true_path, sc in frontier:
                want = self.ref[done + d] if done + d < len(self.ref) else -1
                put_true = true_path and want >= 0 and self.rng.random() < self.hit
                rank_true = self.rng.randrange(spec.branching) if put_true else -1
                for r in range(spec.branching):
                    tok = want if r == rank_true else self.rng.randrange(self.vocab)
                    if r != rank_true and tok == want:
                        tok = (tok + 1) % self.vocab
                    toks.append(tok)
                    parents.append(node)
                    scores.append(sc - 0.1 * (r + 1))
                    nxt.append((len(toks) - 1, r == rank_true, scores[-1]))
            frontier = sorted(nxt, key=lambda x: -x[2])[: spec.branching]
        cand = DraftTree.from_parents(toks, parents, scores)
        from specpilot.tree import shape_tree

        return shape_tree(cand, spec)


def _engine(model: Transformer) -> Engine:
    return Engine(model, EngineConfig(attention="exact", linear="onednn"))


@torch.no_grad()
def _naive_greedy(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """Greedy by recomputing the whole sequence each step (no cache reuse)."""
    seq = list(prompt)
    model.setup_cache(len(prompt) + n + 8, attention="exact")
    for _ in range(n):
        t = len(seq)
        out = model(
            torch.tensor([seq]),
            torch.arange(t)[None],
            0,
            t,
            causal_mask(0, t, t, "cpu"),
            logits_rows=slice(t - 1, t),
        )
        seq.append(int(out.logits[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_ar_equals_full_recompute(arch: str) -> None:
    model = tiny_model(arch, seed=3)
    eng = _engine(model)
    prompt = [5, 9, 2, 7, 7, 1]
    res = eng.generate(prompt, GenerationConfig(max_new_tokens=24, stop_on_eos=False))
    assert res.tau == 1.0 and res.steps == 23
    assert res.tokens == _naive_greedy(model, prompt, 24)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
@pytest.mark.parametrize("hit", [0.0, 0.6, 1.0])
def test_speculative_equals_ar(spec: TreeSpec, hit: float) -> None:
    model = tiny_model("llama", seed=1)
    eng = _engine(model)
    gen = GenerationConfig(max_new_tokens=40, stop_on_eos=False)
    for seed, prompt in enumerate([[3, 4, 5], [10, 20, 30, 40, 50, 60, 1], [7]]):
        ref = eng.generate(prompt, gen)
        drafter = OracleDrafter(ref.tokens, 64, hit, seed)
        res = eng.generate(prompt, gen, drafter=drafter, spec=spec)
        assert res.tokens == ref.tokens
        if hit == 0.0:
            assert res.tau == 1.0
        if hit == 1.0:
            assert res.tau >= (1.3 if spec.kind == "static" else 2.0)  # drafts get accepted


def test_cache_after_speculation_equals_ar_cache() -> None:
    """Compaction leaves exactly the entries plain decoding would have written."""
    spec = SPECS[2]
    model = tiny_model("qwen3", seed=5)
    eng = _engine(model)
    gen = GenerationConfig(max_new_tokens=30, stop_on_eos=False)
    prompt = [1, 2, 3, 4]
    ref = eng.generate(prompt, gen)
    n = len(prompt) + len(ref.tokens) - 1  # slots written by plain decoding
    ar_k = [layer.self_attn.cache.k[:, :, :n].clone() for layer in model.model.layers]
    res = eng.generate(prompt, gen, drafter=OracleDrafter(ref.tokens, 64, 0.7, 11), spec=spec)
    assert res.tokens == ref.tokens
    assert any(a > 0 for a in res.accept_lengths)
    for layer, k in zip(model.model.layers, ar_k, strict=False):
        m = min(n, len(prompt) + len(res.tokens) - 1)
        assert torch.equal(layer.self_attn.cache.k[:, :, :m], k[:, :, :m])


def test_stop_rules() -> None:
    model = tiny_model("llama", seed=1)
    eng = _engine(model)
    prompt = [3, 4, 5]
    free = eng.generate(prompt, GenerationConfig(max_new_tokens=20, stop_on_eos=False)).tokens
    eos = free[6]
    first = free.index(eos)
    res = eng.generate(prompt, GenerationConfig(max_new_tokens=20), eos_ids=(eos,))
    assert res.tokens == free[: first + 1] and res.stop_reason == "eos"
    spec_res = eng.generate(
        prompt,
        GenerationConfig(max_new_tokens=20),
        eos_ids=(eos,),
        drafter=OracleDrafter(free, 64, 1.0, 0),
        spec=SPECS[0],
    )
    assert spec_res.tokens == res.tokens
    short = eng.generate(
        prompt,
        GenerationConfig(max_new_tokens=5, stop_on_eos=False),
        drafter=OracleDrafter(free, 64, 1.0, 0),
        spec=SPECS[0],
    )
    assert short.tokens == free[:5] and short.stop_reason == "length"

    def detok(toks: list[int]) -> str:
        return " ".join(f"t{t}" for t in toks) + " "

    stop = f"t{free[3]} "
    cut = next(i for i in range(20) if stop in detok(free[: i + 1]))
    res = eng.generate(
        prompt,
        GenerationConfig(max_new_tokens=20, stop_on_eos=False, stop_strings=(stop,)),
        detok=detok,
        drafter=OracleDrafter(free, 64, 1.0, 0),
        spec=SPECS[0],
    )
    assert res.tokens == free[: cut + 1] and res.stop_reason == "stop"


def test_bad_input() -> None:
    model = tiny_model("llama", seed=1)
    eng = _engine(model)
    with pytest.raises(ContextLengthError):
        eng.generate(list(range(10)) * 50, GenerationConfig(max_new_tokens=100))
    with pytest.raises(ConfigError):
        GenerationConfig(max_new_tokens=0)
    with pytest.raises(ConfigError):
        TreeSpec(kind="chain", k=0)
    with pytest.raises(ConfigError):
        TreeSpec(kind="dynamic", budget=-3)
    with pytest.raises(ConfigError):
        EngineConfig(dtype="bfloat16")  # bf16 is for GPUs
    with pytest.raises(ConfigError):
        eng.generate([], GenerationConfig())
