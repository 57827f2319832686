"""Verify-step switches (specpilot.fastverify): on-device acceptance equals greedy verification,
buffered and padded (CUDA-graph-shaped) steps decode exactly like plain AR, CUDA graphs on GPU."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from specpilot.drafters import make_drafter
from specpilot.engine import Engine, EngineConfig
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
