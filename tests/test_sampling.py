"""Sampling: logits processing, and that speculative sampling draws exactly from the target.

Chi-square goodness of fit over many seeded draws on a tiny vocabulary, for chain, deterministic
tree and stochastic tree verification (pure functions), plus one check through the engine.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from specpilot.drafters.base import DraftContext
from specpilot.engine import Engine, EngineConfig, GenerationConfig
from specpilot.errors import ConfigError
from specpilot.model import causal_mask
from specpilot.sampling import (
    SamplingParams,
    residual,
    target_probs,
    verify_chain_sampling,
    verify_tree_sampling,
)
from specpilot.tree import DraftTree, TreeSpec

from .conftest import tiny_model

V = 6
P_MIN = 1e-4
"""Reject the fit below this p-value; draws are seeded, so a pass is reproducible."""


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny models gain nothing from a second thread, and on a busy machine one is far faster."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells of zero expected count must be empty."""
    n = float(counts.sum())
    exp = probs.double() * n
    zero = exp < 1e-12
    assert int(counts[zero].sum()) == 0, "drew a token of zero target probability"
    keep = ~zero
    stat = float(((counts[keep].double() - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def _logits(seed: int, rows: int = 1, v: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, v, generator=g) * 1.5


def _dist(seed: int, v: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(v, generator=g, dtype=torch.float64) * 1.5, -1)


PARAMS = [SamplingParams(1.0), SamplingParams(0.7, top_k=4), SamplingParams(1.3, top_p=0.8)]


def test_target_probs_processing() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    p = target_probs(logits, SamplingParams(1.0, top_k=2))
    assert p[0] == 0 and p[3] == 0 and torch.isclose(p.sum(), torch.tensor(1.0, dtype=p.dtype))
    full = torch.softmax(logits.double(), -1)  # 0.64, 0.24, 0.09, 0.03
    p = target_probs(logits, SamplingParams(1.0, top_p=0.85))
    assert (p > 0).tolist() == [False, True, True, False]
    assert torch.allclose(p[1] / p[2], full[1] / full[2])
    assert torch.allclose(
        target_probs(logits, SamplingParams(0.5)), torch.softmax(2 * full.log(), -1)
    )
    r = residual(torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64), None, 0)
    assert r.tolist() == [0.0, 1.0, 0.0]


def test_params_validated() -> None:
    for bad in (dict(temperature=-0.1), dict(temperature=2.5), dict(temperature=float("nan")),
                dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)):  # fmt: skip
        with pytest.raises(ConfigError):
            SamplingParams(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        GenerationConfig(temperature=3.0)


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "topk", "topp"])
def test_chain_rejection_sampling_matches_target(params: SamplingParams) -> None:
    logits = _logits(1, rows=2)  # row 0 = root, row 1 = after the draft token
    q = _dist(2)
    p = target_probs(logits[0], params)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(V)
    accepted = 0
    for _ in range(4000):
        x = int(torch.multinomial(q, 1, generator=gen))
        acc = verify_chain_sampling([x], logits, params, gen, q=q[None])
        counts[acc.tokens[0]] += 1
        accepted += len(acc.path)
    assert chi2_pvalue(counts, p) > P_MIN
    expect = float(torch.minimum(p, q).sum())  # acceptance rate of speculative sampling
    assert abs(accepted / 4000 - expect) < 0.03


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "topk", "topp"])
def test_deterministic_tree_matches_target(params: SamplingParams) -> None:
    # root -> {a, 0, 4}; node 0 (token a, the target's likeliest) -> {1, 3}; point-mass drafts
    logits = _logits(3, rows=6)
    p0, p1 = target_probs(logits[0], params), target_probs(logits[1], params)
    a = int(p0.argmax())
    tree = DraftTree.from_parents([a, 0, 4, 1, 3], [-1, -1, -1, 0, 0])
    gen = torch.Generator().manual_seed(1)
    first = torch.zeros(V)
    second = torch.zeros(V)  # the token after a when a was committed first
    for _ in range(4000):
        acc = verify_tree_sampling(tree, logits, params, gen)
        first[acc.tokens[0]] += 1
        if acc.tokens[0] == a:
            second[acc.tokens[1]] += 1
    assert chi2_pvalue(first, p0) > P_MIN
    assert chi2_pvalue(second, p1) > P_MIN


@pytest.mark.parametrize("same_q", [True, False], ids=["iid", "per-sibling-q"])
def test_stochastic_tree_matches_target(same_q: bool) -> None:
    """SpecInfer's recursive rejection sampling over 3 sampled siblings."""
    params = SamplingParams(1.0)
    logits = _logits(4, rows=4)
    p = target_probs(logits[0], params)
    qs = [_dist(5)] * 3 if same_q else [_dist(5), _dist(6), _dist(7)]
    q = torch.stack(qs)  # (3, V)
    gen = torch.Generator().manual_seed(2)
    counts = torch.zeros(V)
    for _ in range(4000):
        toks = [int(torch.multinomial(qi, 1, generator=gen)) for qi in qs]
        tree = DraftTree.from_parents(toks, [-1, -1, -1], q=q)
        counts[verify_tree_sampling(tree, logits, params, gen).tokens[0]] += 1
    assert chi2_pvalue(counts, p) > P_MIN


def test_chi2_detects_a_wrong_distribution() -> None:
    """The test has power: accepting every draft (no rejection test) is caught."""
    p, q = target_probs(_logits(1)[0], SamplingParams(1.0)), _dist(2)
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.multinomial(q, 3000, replacement=True, generator=gen), None, V)
    assert chi2_pvalue(counts.float(), p) < P_MIN


class SamplingDrafter:
    """Samples a 3-node tree from a fixed distribution q (stochastic drafts), or proposes fixed
    tokens (deterministic drafts)."""

    name = "sampling-test"
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, q: torch.Tensor | None, seed: int) -> None:
        self.q = q
        self.gen = torch.Generator().manual_seed(seed)

    def begin(self, prompt: list[int]) -> None:
        pass

    def finish(self, tokens: list[int]) -> None:
        pass

    def propose(self, ctx: DraftContext) -> DraftTree:
        if self.q is None:
            return DraftTree.from_parents([1, 2, 0], [-1, -1, 0])
        toks = torch.multinomial(self.q, 3, replacement=True, generator=self.gen).tolist()
        # two siblings sampled i.i.d. from q under the root, one child under the first
        return DraftTree.from_parents(toks, [-1, -1, 0], q=self.q.expand(3, -1).float())


@torch.no_grad()
def _exact_two_token(model, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """Exact target probability of each (t1, t2) continuation, flattened t1 * V + t2."""
    v = model.cfg.vocab_size
    model.setup_cache(len(prompt) + 4, attention="exact")

    def last(seq: list[int]) -> torch.Tensor:
        t = len(seq)
        out = model(torch.tensor([seq]), torch.arange(t)[None], 0, t, causal_mask(0, t, t, "cpu"))
        return target_probs(out.logits[0, -1], params)

    p1 = last(prompt)
    return torch.cat([p1[a] * last([*prompt, a]) for a in range(v)]).reshape(v * v)


def test_engine_sampling_matches_target() -> None:
    """Through Engine.generate with a drafter that samples a tree of drafts."""
    vocab = 4
    model = tiny_model("llama", seed=2, vocab=vocab, std=0.5)
    eng = Engine(model, EngineConfig(attention="exact"))
    prompt = [1, 3, 2]
    exact = _exact_two_token(model, prompt, SamplingParams(1.0))
    drafter = SamplingDrafter(torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64), seed=9)
    spec = TreeSpec(kind="static", paths=((0,), (1,), (0, 0)))
    counts = torch.zeros(vocab * vocab)
    accepted = 0
    for seed in range(1200):
        gen = GenerationConfig(max_new_tokens=2, stop_on_eos=False, temperature=1.0, seed=seed)
        res = eng.generate(prompt, gen, drafter=drafter, spec=spec)
        counts[res.tokens[0] * vocab + res.tokens[1]] += 1
        accepted += sum(res.accept_lengths)
    assert accepted > 150  # speculation is actually exercised
    assert chi2_pvalue(counts, exact) > P_MIN


def test_seeded_sampling_is_reproducible() -> None:
    model = tiny_model("llama", seed=1)
    eng = Engine(model, EngineConfig(attention="exact"))
    drafter = SamplingDrafter(None, 0)
    spec = TreeSpec(kind="static", paths=((0,), (1,), (0, 0)))

    def run(seed: int, spec_on: bool) -> list[int]:
        gen = GenerationConfig(max_new_tokens=24, stop_on_eos=False, temperature=0.9, seed=seed)
        return eng.generate(
            [3, 4, 5], gen, drafter=drafter if spec_on else None, spec=spec if spec_on else None
        ).tokens

    assert run(7, True) == run(7, True)
    assert run(7, False) == run(7, False)
    assert run(7, True) != run(8, True)
    greedy = eng.generate([3, 4, 5], GenerationConfig(max_new_tokens=24, stop_on_eos=False))
    zero_t = GenerationConfig(max_new_tokens=24, stop_on_eos=False, temperature=0.0, seed=3)
    assert eng.generate([3, 4, 5], zero_t, drafter=drafter, spec=spec).tokens == greedy.tokens
