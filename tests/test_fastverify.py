"""Verify-step switches (specpilot.fastverify): on-device acceptance equals greedy verification,
buffered and padded (CUDA-graph-shaped) steps decode exactly like plain AR, CUDA graphs on GPU."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from specpilot.drafters import make_drafter
from specpilot.engine import Engine, EngineConfig, GenerationConfig
from specpilot.errors import ConfigError
from specpilot.fastverify import FastVerifier, accept_on_device, width_bucket
from specpilot.tree import DraftTree, TreeSpec, tree_mask, verify_greedy

from .runtime_helpers import GEN, PROMPTS, loaded, references

SPECS = [
    TreeSpec(kind="chain", k=4),
    TreeSpec(kind="static", paths=((0,), (1,), (0, 0), (0, 1), (0, 0, 0))),
    TreeSpec(kind="dynamic", budget=10, topk=3, depth=5),
]


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    parents = [rng.randrange(-1, i) for i in range(n)]
    return DraftTree.from_parents([rng.randrange(vocab) for _ in range(n)], parents)


def test_accept_on_device_matches_verify_greedy() -> None:
    """Random trees over a 3-token vocabulary (many matches, duplicate siblings); the target's
    choice at a row is a function of the row's token path, as for a real model."""
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randrange(1, 12)
        tree = _random_tree(rng, n, vocab=3)
        salt = rng.random()
        toks, par = tree.tokens.tolist(), tree.parents.tolist()

        def choice(path: tuple[int, ...], salt: float = salt) -> int:
            return hash((salt, path)) % 3

        def path_of(i: int, toks: list[int] = toks, par: list[int] = par) -> tuple[int, ...]:
            return () if i < 0 else (*path_of(par[i]), toks[i])

        target = [choice(())] + [choice(path_of(i)) for i in range(n)]
        want = verify_greedy(tree, target)
        anc = tree_mask(tree)[1:, 1:]
        path, bonus = accept_on_device(
            torch.tensor(target), tree.tokens, tree.parents, tree.depths, anc
        )
        got = [i for i in range(n) if path[i]]
        committed = [toks[i] for i in got] + [int(bonus)]
        greedy: list[int] = []
        for _ in range(len(committed)):
            greedy.append(choice(tuple(greedy)))
        assert committed == greedy  # the target's own greedy continuation
        assert len(committed) >= len(want.tokens)
        if all(len({toks[c] for c in k}) == len(k) for k in tree.children()):
            assert tuple(got) == want.path  # distinct siblings: the very same path


def test_width_bucket() -> None:
    assert [width_bucket(r) for r in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]


@pytest.mark.parametrize(
    "switches",
    [
        {"static_buffers": True},
        {"device_accept": True},
        {"static_buffers": True, "device_accept": True},
        {"cuda_graphs": True, "capture": False},  # the padded static-shape path, eagerly
    ],
    ids=["buffers", "accept", "both", "padded"],
)
def test_fast_steps_decode_like_ar(switches: dict[str, bool]) -> None:
    refs = references()
    lm = loaded()
    eng = Engine(lm.model, EngineConfig())
    eng._fast = FastVerifier(lm.model, **switches)
    for spec in SPECS:
        for name in ("lookup", "suffix"):
            drafter = make_drafter(name)
            outs = [eng.generate(p, GEN, drafter=drafter, spec=spec).tokens for p in PROMPTS]
            assert outs == refs, f"{switches} {name}/{spec.kind}"
    assert [eng.generate(p, GEN).tokens for p in PROMPTS] == refs  # AR steps (empty trees)
    assert eng._fast.replays == 0  # nothing captured on CPU


def test_cuda_graphs_need_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ConfigError, match="CUDA"):
        EngineConfig(cuda_graphs=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_replay_on_gpu() -> None:
    """Captured verify graphs decode like the eager step of the same engine configuration."""
    lm = loaded()
    lm.model.to("cuda")
    eager = Engine(lm.model, EngineConfig(device="cuda", attention="exact"))
    refs = [eager.generate(p, GEN).tokens for p in PROMPTS]
    eng = Engine(lm.model, EngineConfig(device="cuda", attention="exact", cuda_graphs=True))
    for spec in SPECS:
        drafter = make_drafter("suffix")
        outs = [eng.generate(p, GEN, drafter=drafter, spec=spec).tokens for p in PROMPTS]
        assert outs == refs
    assert eng._fast is not None and eng._fast.replays > 0


def stock_model() -> Any:
    """A model wide enough that stock kernels change a row's bits with the rows in the call."""
    from .conftest import tiny_model

    return tiny_model("llama", seed=3, dim=256, n_heads=4, n_kv_heads=2, intermediate_size=512,
                      vocab=512)  # fmt: skip


def plain_vs_chain(eng: Engine, model: Any, prompts: int = 4) -> tuple[int, int]:
    """(prompts whose chain-speculative tokens equal plain decoding's, prompts whose KV caches
    are bit-identical over every committed slot) for the engine's configuration."""
    from .test_engine import OracleDrafter

    def cache(n: int) -> list[torch.Tensor]:
        return [t[..., :n, :].clone() for layer in model.model.layers
                for t in (layer.self_attn.cache.k, layer.self_attn.cache.v)]  # fmt: skip

    gen = GenerationConfig(max_new_tokens=40, stop_on_eos=False)
    same_tokens = same_cache = 0
    for seed in range(prompts):
        prompt = [(7 * i + seed) % 500 + 1 for i in range(20)]
        ref = eng.generate(prompt, gen)
        n = len(prompt) + len(ref.tokens) - 1
        a = cache(n)
        drafter = OracleDrafter(ref.tokens, 512, 0.8, seed)
        res = eng.generate(prompt, gen, drafter=drafter, spec=TreeSpec(kind="chain", k=4))
        same_tokens += res.tokens == ref.tokens
        same_cache += all(torch.equal(x, y) for x, y in zip(a, cache(n), strict=True))
    return same_tokens, same_cache


def test_fixed_width_makes_stock_kernels_lossless() -> None:
    """torch's stock CPU GEMM and SDPA give a row other bits with other row counts: plain
    decoding and chain verification then fill different KV caches. Fixed-width steps give every
    call one shape, so the caches are bit-identical."""
    model = stock_model()
    stock = Engine(model, EngineConfig(attention="sdpa", linear="torch"))
    assert plain_vs_chain(stock, model)[1] < 4  # the contract this mode restores is broken here
    fixed = Engine(model, EngineConfig(attention="sdpa", linear="torch", fixed_width=6))
    assert plain_vs_chain(fixed, model) == (4, 4)
    assert model.max_len == model.cfg.max_position  # one key length: the whole context


def test_fixed_width_rejects_what_it_cannot_verify() -> None:
    lm = loaded()
    eng = Engine(lm.model, EngineConfig(fixed_width=4))
    tree = DraftTree.from_parents([1, 2, 3], [-1, -1, 0])  # siblings: not a chain
    with pytest.raises(ConfigError, match="chains only, not a static tree"):
        eng.generate([5, 6, 7], GEN, drafter=_Fixed(tree), spec=TreeSpec(kind="static",
                     paths=((0,), (1,), (0, 0))))  # fmt: skip
    with pytest.raises(ConfigError, match="chains only"):  # a drafter that breaks its shape
        eng.generate([5, 6, 7], GEN, drafter=_Fixed(tree), spec=TreeSpec(kind="chain", k=3))
    chain = DraftTree.from_parents([1, 2, 3, 4], [-1, 0, 1, 2])
    with pytest.raises(ConfigError, match="does not fit fixed_width 4"):
        eng.generate([5, 6, 7], GEN, drafter=_Fixed(chain), spec=TreeSpec(kind="chain", k=4))
    with pytest.raises(ConfigError, match="fixed_width must be in"):
        EngineConfig(fixed_width=65)
    plain = eng.generate([5, 6, 7], GEN)  # plain steps run at the fixed width too
    assert plain.tokens == Engine(lm.model, EngineConfig()).generate([5, 6, 7], GEN).tokens


class _Fixed:
    """A drafter that proposes one given tree every step."""

    name = "fixed"
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, tree: DraftTree) -> None:
        self.tree = tree

    def begin(self, prompt: list[int]) -> None:
        pass

    def finish(self, tokens: list[int]) -> None:
        pass

    def propose(self, ctx: Any) -> DraftTree:
        return self.tree


@pytest.mark.parametrize("fixed", [0, 5])
def test_fixed_width_batched_rows_are_plain_rows(fixed: int) -> None:
    """A batched verify step (every cache row, fixed width, whole cache) gives a chain node's
    row the bits of plain decoding's row for the same token, with stock kernels; without a
    fixed width the rows differ (the test can fail)."""
    assert batched_rows_match(stock_model(), fixed) == bool(fixed)  # not prepacked: stock GEMM


def batched_rows_match(model: Any, fixed: int) -> bool:
    """Whether a batched chain verify (3 sequences) gives its root and first node the bits of
    plain decoding of that sequence alone (two steps)."""
    from specpilot.verify import VerifyRow, prefill, verify_step

    model.setup_cache(128, batch=3, attention="sdpa")
    prompts = [[(5 * i + s) % 500 + 1 for i in range(12 + 4 * s)] for s in range(3)]
    roots = [int(prefill(model, p, row=b).logits[0, -1].argmax()) for b, p in enumerate(prompts)]
    lens = [len(p) for p in prompts]
    saved = [(layer.self_attn.cache.k.clone(), layer.self_attn.cache.v.clone())
             for layer in model.model.layers]  # fmt: skip

    def restore() -> None:
        for layer, (k, v) in zip(model.model.layers, saved, strict=True):
            layer.self_attn.cache.k.copy_(k)
            layer.self_attn.cache.v.copy_(v)

    def plain(b: int, root: int, c: int, batch: int) -> Any:
        rows = [VerifyRow(root if i == b else roots[i], c if i == b else lens[i], DraftTree.empty())
                for i in range(batch)]  # fmt: skip
        return verify_step(model, rows, cache_rows=slice(0, batch), fixed_width=fixed)[b]

    first = plain(0, roots[0], lens[0], 1)  # sequence 0 alone
    second = plain(0, first.tokens[-1], lens[0] + 1, 1)
    restore()
    chain = DraftTree.from_parents([first.tokens[-1], 3], [-1, 0])
    rows = [VerifyRow(roots[0], lens[0], chain)] + [
        VerifyRow(roots[b], lens[b], DraftTree.empty()) for b in (1, 2)
    ]
    spec = verify_step(model, rows, cache_rows=slice(0, 3), fixed_width=fixed)[0]
    return torch.equal(spec.logits[0], first.logits[0]) and torch.equal(
        spec.logits[1], second.logits[0]
    )


def test_fixed_width_batch_engine_decodes_like_batched_plain() -> None:
    from specpilot.batch import BatchConfig, BatchEngine, BatchRequest, run_batch

    from .test_engine import OracleDrafter

    model = stock_model()
    cfg = EngineConfig(attention="sdpa", linear="torch", fixed_width=5)
    beng = BatchEngine(model, cfg, BatchConfig(max_batch=3, max_len=128))
    prompts = [[(7 * i + s) % 500 + 1 for i in range(10 + 3 * s)] for s in range(5)]
    gen = GenerationConfig(max_new_tokens=24, stop_on_eos=False)
    refs = [o.result.tokens for o in run_batch(beng, [BatchRequest(p, gen) for p in prompts])]
    chain = TreeSpec(kind="chain", k=4)
    reqs = [BatchRequest(p, gen, OracleDrafter(r, 512, 0.8, i), chain)
            for i, (p, r) in enumerate(zip(prompts, refs, strict=True))]  # fmt: skip
    outs = run_batch(beng, reqs)
    assert [o.result.tokens for o in outs] == refs
    assert max(o.result.tau for o in outs) > 2
    tree = TreeSpec(kind="dynamic", budget=4, topk=2, depth=3)
    with pytest.raises(ConfigError, match="chains only"):
        run_batch(beng, [BatchRequest(prompts[0], gen, OracleDrafter(refs[0], 512, 0.8, 0), tree)])
