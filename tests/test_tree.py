"""Draft trees on hand-built cases: masks, best-first selection, rank paths, greedy verify."""

from __future__ import annotations

import pytest
import torch

from specpilot.errors import ConfigError
from specpilot.tree import (
    DraftTree,
    TreeSpec,
    select_best,
    select_paths,
    shape_tree,
    tree_mask,
    verify_greedy,
)

#        root
#       /    \
#     0:a    1:b
#     /  \      \
#   2:c  3:d    4:e
#    |
#   5:f
TREE = DraftTree.from_parents(
    [10, 11, 12, 13, 14, 15], [-1, -1, 0, 0, 1, 2], [-0.1, -0.5, -0.3, -0.9, -0.6, -0.4]
)


def test_depths_and_children() -> None:
    assert TREE.depths.tolist() == [1, 1, 2, 2, 2, 3]
    assert TREE.children() == [[0, 1], [2, 3], [4], [5], [], [], []]


def test_from_parents_rejects_non_topological() -> None:
    with pytest.raises(ValueError):
        DraftTree.from_parents([1, 2], [1, -1])


def test_tree_mask_hand_built() -> None:
    m = tree_mask(TREE).int()
    expected = torch.tensor(
        [
            # r  0  1  2  3  4  5
            [1, 0, 0, 0, 0, 0, 0],  # root
            [1, 1, 0, 0, 0, 0, 0],  # 0
            [1, 0, 1, 0, 0, 0, 0],  # 1
            [1, 1, 0, 1, 0, 0, 0],  # 2 (parent 0)
            [1, 1, 0, 0, 1, 0, 0],  # 3 (parent 0)
            [1, 0, 1, 0, 0, 1, 0],  # 4 (parent 1)
            [1, 1, 0, 1, 0, 0, 1],  # 5 (parent 2)
        ]
    )
    assert torch.equal(m, expected)


def test_select_best_keeps_top_scores_and_renumbers() -> None:
    best = select_best(TREE, 3)  # scores: 0:-0.1, 2:-0.3, 5:-0.4
    assert best.tokens.tolist() == [10, 12, 15]
    assert best.parents.tolist() == [-1, 0, 1]
    best4 = select_best(TREE, 4)  # + 1:-0.5
    assert best4.tokens.tolist() == [10, 11, 12, 15]
    assert best4.parents.tolist() == [-1, -1, 0, 2]


def test_select_best_closes_over_ancestors() -> None:
    odd = DraftTree.from_parents([1, 2], [-1, 0], [-5.0, -0.1])  # child scored above parent
    assert select_best(odd, 1).tokens.tolist() == [1, 2]


def test_select_paths_by_rank() -> None:
    # root's children ranked by score: 0 (-0.1), 1 (-0.5); node 0's: 2 (-0.3), 3 (-0.9)
    t = select_paths(TREE, [(0,), (1,), (0, 1)])
    assert t.tokens.tolist() == [10, 11, 13]
    assert t.parents.tolist() == [-1, -1, 0]
    assert select_paths(TREE, [(0,), (0, 0), (0, 0, 0)]).tokens.tolist() == [10, 12, 15]
    assert select_paths(TREE, [(2,)]).size == 0  # rank 2 does not exist


def test_shape_tree_chain() -> None:
    t = shape_tree(TREE, TreeSpec(kind="chain", k=2))
    assert t.tokens.tolist() == [10, 12] and t.parents.tolist() == [-1, 0]


@pytest.mark.parametrize(
    ("target", "tokens", "path"),
    [
        ([10, 12, 0, 15, 0, 0, 99], (10, 12, 15, 99), (0, 2, 5)),  # deepest path, then bonus
        ([11, 0, 14, 0, 0, 7, 0], (11, 14, 7), (1, 4)),
        ([50, 0, 0, 0, 0, 0, 0], (50,), ()),  # nothing accepted: bonus only
        ([10, 13, 0, 0, 8, 0, 0], (10, 13, 8), (0, 3)),
    ],
)
def test_verify_greedy(target: list[int], tokens: tuple[int, ...], path: tuple[int, ...]) -> None:
    acc = verify_greedy(TREE, target)
    assert acc.tokens == tokens and acc.path == path


def test_empty_tree_verifies_to_one_token() -> None:
    assert verify_greedy(DraftTree.empty(), [7]).tokens == (7,)


@pytest.mark.parametrize(
    "kw",
    [
        dict(kind="ring"),
        dict(kind="chain", k=0),
        dict(kind="dynamic", budget=0),
        dict(kind="dynamic", topk=-1),
        dict(kind="static"),
        dict(kind="static", paths=((0, 1),)),  # missing parent path (0,)
        dict(kind="static", paths=((0,), (-1,))),
    ],
)
def test_tree_spec_validation(kw: dict) -> None:
    with pytest.raises(ConfigError):
        TreeSpec(**kw)


def test_parse_paths() -> None:
    assert TreeSpec.parse_paths("0;1;0.0") == ((0,), (1,), (0, 0))
    assert TreeSpec.parse_paths("[[0],[0,1]]") == ((0,), (0, 1))
    with pytest.raises(ConfigError):
        TreeSpec.parse_paths("0;x")


# -- the one tree builder ---------------------------------------------------------------------


def _table_children(seed: int, vocab: int = 6):
    """A children function over a fixed random distribution per path (state = the path)."""
    import math

    from specpilot.tree import GrowingTree

    cache: dict[tuple[int, ...], list[tuple[float, int]]] = {}

    def dist(path: tuple[int, ...]) -> list[tuple[float, int]]:
        if path not in cache:
            g = torch.Generator().manual_seed(seed * 1_000_003 + hash(path) % 1_000_003)
            lp = torch.log_softmax(torch.randn(vocab, generator=g), -1).tolist()
            cache[path] = sorted(((v, t) for t, v in enumerate(lp)), key=lambda x: (-x[0], x[1]))
        return cache[path]

    def children(nodes: GrowingTree, frontier: list[int], width: int):
        out = []
        for i in frontier:
            path = () if i < 0 else nodes.states[i]
            out.append([(v, t, (*path, t)) for v, t in dist(path)[:width]])
        return out

    return children, dist, math


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("budget", "depth"), [(1, 1), (5, 3), (12, 4), (30, 6)])
def test_best_first_keeps_the_most_probable_nodes(seed: int, budget: int, depth: int) -> None:
    """The best-first tree is exactly the ``budget`` most probable paths within ``depth``
    (brute force over every path), parents before children."""
    from specpilot.tree import build_tree

    children, dist, _ = _table_children(seed)
    spec = TreeSpec(kind="dynamic", budget=budget, topk=6, depth=depth)
    tree = build_tree(children, spec, width=6)
    every: list[tuple[float, tuple[int, ...]]] = []
    frontier: list[tuple[float, tuple[int, ...]]] = [(0.0, ())]
    for _ in range(depth):
        nxt = [(s + v, (*p, t)) for s, p in frontier for v, t in dist(p)]
        every += nxt
        frontier = nxt
    best = sorted(s for s, _ in every)[::-1][:budget]
    got = sorted(tree.scores.tolist())[::-1]
    assert got == pytest.approx(best, abs=1e-5)  # scores are stored as float32
    assert all(p < i for i, p in enumerate(tree.parents.tolist()))


def test_rank_paths_and_levels_follow_the_spec() -> None:
    from specpilot.tree import build_tree, grow_levels

    children, dist, math = _table_children(7)
    chain = build_tree(children, TreeSpec(kind="chain", k=4))
    want, path = [], ()
    for _ in range(4):  # the argmax continuation at every depth
        t = dist(path)[0][1]
        want.append(t)
        path = (*path, t)
    assert chain.tokens.tolist() == want and chain.parents.tolist() == [-1, 0, 1, 2]
    static = build_tree(children, TreeSpec(kind="static", paths=((0,), (1,), (0, 0), (1, 0))))
    assert static.size == 4 and static.depths.tolist().count(2) == 2
    nodes = grow_levels(children, 2, 3)
    assert len(nodes) == 2 + 4 + 4  # 2 roots; the 2 best of each level expanded by 2
    cut = grow_levels(children, 2, 3, min_logp=0.0)  # nothing reaches probability 1
    assert len(cut) == 2 and not math.isinf(cut.scores[0])
