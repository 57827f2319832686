"""The canonical draft tree, tree shapes, and greedy verification (pure functions).

Words used throughout:
  * root       - the last committed token; not yet in the target's cache, verified with the tree.
  * node       - a draft token; node ``i`` has parent ``parents[i]`` (-1 = root), depth >= 1.
  * accepted   - draft nodes whose token equals the target's greedy choice at their parent.
  * bonus      - the target's choice after the last accepted node; always committed.
  * tau        - mean tokens committed per target step (accepted + bonus).
  * node budget - the number of draft nodes verified in one target step.

Trees are built best-first (EAGLE-2, Li et al. 2024; DDTree): candidates carry a cumulative draft
log-probability and the best N are kept. Because a child's cumulative score is never above its
parent's, the best N are closed under ancestors (ties broken toward the earlier node).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specpilot.errors import ConfigError

TREE_KINDS = ("chain", "static", "dynamic")


@dataclass(frozen=True)
class DraftTree:
    """Draft nodes in topological order (every parent index is smaller than its child's)."""

    tokens: Tensor
    """(N,) long: draft token of each node."""
    parents: Tensor
    """(N,) long: parent node index, -1 for children of the root."""
    depths: Tensor
    """(N,) long: 1 for children of the root."""
    scores: Tensor
    """(N,) float: cumulative draft log-probability (path score) of each node."""
    q: Tensor | None = None
    """(N, V) float or None: the draft distribution each node's token was *sampled* from
    (stochastic drafts, verified by recursive rejection sampling). None = deterministic drafts
    (top-k, lookup, suffix): each token is a point mass. Greedy verification ignores it."""

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        assert self.parents.shape == (n,) and self.depths.shape == (n,), "tree field shapes"
        assert self.scores.shape == (n,), "tree scores shape"
        assert self.q is None or (self.q.dim() == 2 and self.q.shape[0] == n), "tree q shape"

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def empty() -> DraftTree:
        """The tree of no nodes: one shared instance (frozen, its tensors have no elements), not
        four fresh tensors on every step that drafts nothing."""
        return _EMPTY_TREE

    @staticmethod
    def from_parents(
        tokens: Sequence[int],
        parents: Sequence[int],
        scores: Sequence[float] | None = None,
        q: Tensor | None = None,
    ) -> DraftTree:
        depths: list[int] = []
        for i, p in enumerate(parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i}: parent {p} must be -1 or an earlier node")
            depths.append(1 if p < 0 else depths[p] + 1)
        sc = [0.0] * len(tokens) if scores is None else list(scores)
        return DraftTree(
            torch.tensor(list(tokens), dtype=torch.long),
            torch.tensor(list(parents), dtype=torch.long),
            torch.tensor(depths, dtype=torch.long),
            torch.tensor(sc, dtype=torch.float32),
            q,
        )

    @staticmethod
    def chain(
        tokens: Sequence[int], scores: Sequence[float] | None = None, q: Tensor | None = None
    ) -> DraftTree:
        return DraftTree.from_parents(tokens, list(range(-1, len(tokens) - 1)), scores, q)

    def children(self) -> list[list[int]]:
        """children()[p + 1] = node indices whose parent is p (p = -1 is the root)."""
        out: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, p in enumerate(self.parents.tolist()):
            out[p + 1].append(i)
        return out


_Z = torch.zeros(0, dtype=torch.long)
_EMPTY_TREE = DraftTree(_Z, _Z.clone(), _Z.clone(), torch.zeros(0))


@dataclass(frozen=True)
class TreeSpec:
    """How many draft nodes to verify per step and in what shape."""

    kind: str = "dynamic"
    """"chain" (k tokens), "static" (fixed index paths) or "dynamic" (best-first, budget N)."""
    k: int = 5
    """Chain length."""
    paths: tuple[tuple[int, ...], ...] = ()
    """Static tree: each path lists child ranks from the root, e.g. ((0,), (1,), (0, 0))."""
    budget: int = 16
    """Dynamic tree: node budget N (draft nodes verified per step)."""
    topk: int = 4
    """Dynamic tree: children considered per expanded node."""
    depth: int = 8
    """Dynamic tree: maximum depth."""

    def __post_init__(self) -> None:
        if self.kind not in TREE_KINDS:
            raise ConfigError(f"tree kind must be one of {TREE_KINDS}, got {self.kind!r}")
        for name in ("k", "budget", "topk", "depth"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.kind == "static":
            if not self.paths:
                raise ConfigError("a static tree needs at least one index path")
            seen = set(self.paths)
            for p in self.paths:
                if not p or any(r < 0 for r in p):
                    raise ConfigError(f"static tree path {list(p)} must be non-empty ranks >= 0")
                if len(p) > 1 and p[:-1] not in seen:
                    raise ConfigError(
                        f"static tree path {list(p)} has no parent path {list(p[:-1])}"
                    )

    @property
    def max_nodes(self) -> int:
        return {"chain": self.k, "static": len(self.paths), "dynamic": self.budget}[self.kind]

    @property
    def max_depth(self) -> int:
        if self.kind == "chain":
            return self.k
        if self.kind == "static":
            return max(len(p) for p in self.paths)
        return self.depth

    @property
    def branching(self) -> int:
        """Most children any node may need."""
        if self.kind == "chain":
            return 1
        if self.kind == "static":
            return 1 + max(p[-1] for p in self.paths)
        return self.topk

    @staticmethod
    def parse_paths(text: str) -> tuple[tuple[int, ...], ...]:
        """Parse ``"0;1;0.0;0.1"`` or JSON ``[[0],[1],[0,0]]`` into index paths."""
        import json

        text = text.strip()
        try:
            raw = (
                json.loads(text)
                if text.startswith("[")
                else [[int(x) for x in part.split(".")] for part in text.split(";") if part.strip()]
            )
            return tuple(tuple(int(x) for x in p) for p in raw)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"cannot parse tree paths {text!r}: use '0;1;0.0' or JSON") from e


def select_best(cand: DraftTree, budget: int) -> DraftTree:
    """Keep the ``budget`` best nodes by cumulative score (ancestor-closed), re-indexed."""
    if cand.size <= budget:
        return cand
    order = sorted(range(cand.size), key=lambda i: (-float(cand.scores[i]), int(cand.depths[i]), i))
    keep = set(order[:budget])
    parents = cand.parents.tolist()
    for i in list(keep):  # enforce closure even if a drafter's scores are not monotone
        p = parents[i]
        while p >= 0 and p not in keep:
            keep.add(p)
            p = parents[p]
    return subtree(cand, sorted(keep))


def subtree(cand: DraftTree, keep: Sequence[int]) -> DraftTree:
    """Restrict to ``keep`` (ascending, ancestor-closed) and renumber parents."""
    remap = {old: new for new, old in enumerate(keep)}
    parents = [remap[int(cand.parents[i])] if int(cand.parents[i]) >= 0 else -1 for i in keep]
    idx = torch.tensor(list(keep), dtype=torch.long)
    return DraftTree(
        cand.tokens[idx],
        torch.tensor(parents, dtype=torch.long),
        cand.depths[idx],
        cand.scores[idx],
        None if cand.q is None else cand.q[idx],
    )


def select_paths(cand: DraftTree, paths: Sequence[tuple[int, ...]]) -> DraftTree:
    """Keep the nodes named by rank paths; children are ranked by score (best = rank 0)."""
    kids = cand.children()
    ranked = [sorted(c, key=lambda i: (-float(cand.scores[i]), i)) for c in kids]
    keep: set[int] = set()
    for path in paths:
        node = -1
        for r in path:
            options = ranked[node + 1]
            if r >= len(options):
                break
            node = options[r]
            keep.add(node)
    return subtree(cand, sorted(keep))


def shape_tree(cand: DraftTree, spec: TreeSpec) -> DraftTree:
    """Apply a tree spec to a candidate tree of a drafter."""
    if spec.kind == "chain":
        path = tuple([0] * spec.k)
        return select_paths(cand, [path[: i + 1] for i in range(spec.k)])
    if spec.kind == "static":
        return select_paths(cand, spec.paths)
    return select_best(cand, spec.budget)


# -- building trees ---------------------------------------------------------------------------
#
# One builder for every drafter: the drafter supplies a children function, the builder decides
# which nodes to expand and in what order, and :func:`shape_tree` applies the spec.

Continuation = tuple[float, int, Any]
"""(log-prob of the token given its parent, token, the drafter's state for the new node)."""
Children = Callable[["GrowingTree", list[int], int], list[list[Continuation]]]
"""``children(nodes, frontier, width)``: for each frontier node (-1 = the root) its best
``width`` continuations, best first. One call per expansion round (a drafter that pays a forward
per call batches the frontier into one)."""


class GrowingTree:
    """A tree under construction: per node its token, parent, depth, score and drafter state."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.scores: list[float] = []
        self.states: list[Any] = []
        """The drafter's per-node state (a trie position, the cache slots of a fed node, ...)."""

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, tok: int, parent: int, score: float, state: Any = None) -> int:
        self.tokens.append(tok)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(score)
        self.states.append(state)
        return len(self.tokens) - 1

    def tree(self) -> DraftTree:
        return DraftTree.from_parents(self.tokens, self.parents, self.scores)


def chain_paths(k: int) -> tuple[tuple[int, ...], ...]:
    """A chain of ``k`` as rank paths: (0,), (0, 0), ..."""
    return tuple((0,) * i for i in range(1, k + 1))


def path_widths(paths: Sequence[tuple[int, ...]]) -> dict[tuple[int, ...], int]:
    """Rank-path prefix -> how many ranked children it needs (() is the root).

    >>> path_widths([(0,), (1,), (0, 0)])
    {(): 2, (0,): 1}
    """
    need: dict[tuple[int, ...], int] = {}
    for p in paths:
        for i, r in enumerate(p):
            need[p[:i]] = max(need.get(p[:i], 0), r + 1)
    return need


def grow_best_first(children: Children, budget: int, max_depth: int, width: int) -> GrowingTree:
    """Best-first over cumulative log-probability (DDTree): pop the most probable open node,
    expand it, until ``budget`` nodes; ties go to the node pushed first. Parents precede their
    children, and the result is the ``budget`` most probable nodes within ``max_depth``."""
    nodes = GrowingTree()
    heap: list[tuple[float, int, int, int, int, Any]] = []
    seq = 0

    def push(parent: int, base: float, depth: int) -> None:
        nonlocal seq
        for lp, tok, state in children(nodes, [parent], width)[0]:
            heapq.heappush(heap, (-(base + lp), seq, tok, parent, depth, state))
            seq += 1

    if max_depth >= 1:
        push(-1, 0.0, 1)
    while heap and len(nodes) < budget:
        neg, _, tok, parent, depth, state = heapq.heappop(heap)
        i = nodes.add(tok, parent, -neg, state)
        if depth < max_depth:
            push(i, -neg, depth + 1)
    return nodes


Request = tuple["GrowingTree", list[int], int]
"""What a tree grower asks for: ``(nodes, frontier, width)``, answered with
``children(nodes, frontier, width)``."""
Grower = Generator[Request, list[list[Continuation]], DraftTree]
"""A tree under construction that pauses at each expansion round (:func:`tree_steps`)."""


def levels_steps(k: int, max_depth: int, min_logp: float = -math.inf) -> Generator[
        Request, list[list[Continuation]], GrowingTree]:  # fmt: skip
    """EAGLE-2 (Li et al. 2024): per depth the ``k`` best nodes of the last level (at least
    ``min_logp``) are expanded in one round, each adding its ``k`` best children. Yields each
    round's request, receives its children (:data:`Request`); returns the grown nodes."""
    nodes = GrowingTree()
    if max_depth < 1:
        return nodes
    level = [nodes.add(t, -1, v, st) for v, t, st in (yield (nodes, [-1], k))[0]]
    k = min(k, len(level))  # a vocabulary smaller than k
    for _ in range(1, max_depth):
        frontier = sorted(level, key=lambda i: (-nodes.scores[i], i))[:k]
        frontier = [i for i in frontier if nodes.scores[i] >= min_logp]
        if not frontier:
            break
        level = []
        kids_all = yield (nodes, frontier, k)
        for i, kids in zip(frontier, kids_all, strict=True):
            base = nodes.scores[i]
            level.extend(nodes.add(t, i, base + v, st) for v, t, st in kids)
    return nodes


def rank_paths_steps(
    paths: Sequence[tuple[int, ...]], max_depth: int, min_logp: float = -math.inf
) -> Generator[Request, list[list[Continuation]], GrowingTree]:
    """Chains and static trees: level by level, expand exactly the prefixes the rank paths
    extend (whose score is at least ``min_logp``), with the higher-ranked siblings that define
    each node's rank. Yields each round's request, receives its children; returns the nodes."""
    need = path_widths(paths)
    nodes = GrowingTree()
    if () not in need or max_depth < 1:
        return nodes
    prefix: list[tuple[int, ...]] = []
    frontier = [-1]
    for _ in range(max_depth):
        width = max(need[() if i < 0 else prefix[i]] for i in frontier)
        level = []
        kids_all = yield (nodes, frontier, width)
        for i, kids in zip(frontier, kids_all, strict=True):
            here = () if i < 0 else prefix[i]
            base = 0.0 if i < 0 else nodes.scores[i]
            for rank, (v, t, st) in enumerate(kids[: need[here]]):
                level.append(nodes.add(t, i, v if i < 0 else base + v, st))
                prefix.append((*here, rank))
        frontier = [i for i in level if prefix[i] in need and nodes.scores[i] >= min_logp]
        if not frontier:
            break
    return nodes


def drive(steps: Generator[Request, list[list[Continuation]], Any], children: Children) -> Any:
    """Run a paused grower to its end, answering each request with ``children``."""
    try:
        req = next(steps)
        while True:
            req = steps.send(children(*req))
    except StopIteration as stop:
        return stop.value


def grow_levels(
    children: Children, k: int, max_depth: int, min_logp: float = -math.inf
) -> GrowingTree:
    """:func:`levels_steps` answered by ``children`` (one call per depth)."""
    return drive(levels_steps(k, max_depth, min_logp), children)  # type: ignore[no-any-return]


def grow_rank_paths(
    children: Children,
    paths: Sequence[tuple[int, ...]],
    max_depth: int,
    min_logp: float = -math.inf,
) -> GrowingTree:
    """:func:`rank_paths_steps` answered by ``children`` (one call per level)."""
    return drive(rank_paths_steps(paths, max_depth, min_logp), children)  # type: ignore[no-any-return]


def tree_steps(spec: TreeSpec, min_logp: float = -math.inf) -> Grower:
    """The tree of ``spec`` grown one round (one depth) at a time, for drafters that pay a
    forward per round and batch rounds across sequences: dynamic trees by
    :func:`levels_steps`, chains and static trees by :func:`rank_paths_steps`. Yields each
    round's :data:`Request`; returns the shaped tree (as :func:`build_tree` with
    ``dynamic="levels"``)."""
    depth = spec.max_depth
    if spec.kind == "dynamic":
        nodes = yield from levels_steps(spec.topk, depth, min_logp)
    else:
        paths = spec.paths if spec.kind == "static" else chain_paths(spec.k)
        nodes = yield from rank_paths_steps(paths, depth, min_logp)
    return shape_tree(nodes.tree(), spec)


def build_tree(
    children: Children,
    spec: TreeSpec,
    *,
    max_depth: int | None = None,
    dynamic: str = "best_first",
    width: int | None = None,
    min_logp: float = -math.inf,
) -> DraftTree:
    """The draft tree of ``spec`` from a drafter's ``children``.

    Chains and static trees follow rank paths (:func:`grow_rank_paths`); dynamic trees grow
    ``dynamic="best_first"`` (:func:`grow_best_first`, ``width`` children per node, default
    ``spec.topk``; for drafters whose children are cheap) or ``"levels"`` (:func:`grow_levels`,
    one call per depth; for drafters that pay a forward per call). ``max_depth`` caps
    ``spec.max_depth``; nodes below ``min_logp`` are not expanded (levels and rank paths).
    """
    depth = spec.max_depth if max_depth is None else min(spec.max_depth, max_depth)
    if spec.kind == "dynamic" and dynamic == "levels":
        nodes = grow_levels(children, spec.topk, depth, min_logp)
    elif spec.kind == "dynamic":
        nodes = grow_best_first(children, spec.budget, depth, width or spec.topk)
    else:
        paths = spec.paths if spec.kind == "static" else chain_paths(spec.k)
        nodes = grow_rank_paths(children, paths, depth, min_logp)
    return shape_tree(nodes.tree(), spec)


def tree_mask(tree: DraftTree) -> Tensor:
    """(N+1, N+1) bool over [root, nodes...]: each row sees the root, its ancestors and itself."""
    n = tree.size
    m = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    m[:, 0] = True
    parents = tree.parents.tolist()
    for i in range(n):
        row = i + 1
        m[row, row] = True
        p = parents[i]
        if p >= 0:
            m[row] |= m[p + 1]
    return m


@dataclass(frozen=True)
class Acceptance:
    """Result of verifying one tree."""

    path: tuple[int, ...]
    """Accepted node indices, root to leaf."""
    tokens: tuple[int, ...]
    """Committed tokens: the accepted nodes' tokens followed by the bonus token."""


def verify_greedy(tree: DraftTree, target: Sequence[int]) -> Acceptance:
    """Greedy verification: follow the child equal to the target's choice.

    ``target[j]`` is the target's argmax at verify row j (row 0 = root, row i+1 = node i).

    >>> t = DraftTree.from_parents([5, 6, 7], [-1, -1, 0])   # root -> 5 -> 7, root -> 6
    >>> verify_greedy(t, [5, 7, 9, 8]).tokens                 # 5 then 7 accepted, bonus 8
    (5, 7, 8)
    """
    assert len(target) == tree.size + 1, (len(target), tree.size)
    kids = tree.children()
    toks = tree.tokens.tolist()
    path: list[int] = []
    out: list[int] = []
    node = -1
    while True:
        want = int(target[node + 1])
        nxt = next((c for c in kids[node + 1] if toks[c] == want), None)
        out.append(want)
        if nxt is None:
            return Acceptance(tuple(path), tuple(out))
        path.append(nxt)
        node = nxt
