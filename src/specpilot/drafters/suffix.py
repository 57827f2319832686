"""Suffix drafting: continuations of the longest matching suffix, scored by frequency.

SuffixDecoding (Oliya et al. 2024, "SuffixDecoding: Extreme Speculative Decoding for Emerging AI
Applications"): a suffix structure with counts over the current prompt + output and another over
earlier finished outputs. The longest suffix of the committed tokens found in a structure (up to
``max_pattern`` tokens) is the *pattern*; the continuations that followed it form a tree whose
nodes are scored by frequency, p(child) = count(child) / sum of its siblings' counts, with the
cumulative log-probability as the path score. The tree of the structure with the larger expected
number of accepted tokens (sum of path probabilities) is proposed.

The structure is :class:`SuffixTrie`, a counted trie of every substring of length at most
``max_pattern + max_depth``, stored lazily: a substring seen once is not materialized node by node
but kept as a *tail*, a pointer to where its single occurrence continues in its token buffer. A
node is split only when a second occurrence passes through it, so memory grows with the repeated
substrings, not with length x depth. Appending a token costs one step per *pending* occurrence
(a suffix of the text that still matches an earlier one), at most the trie depth.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from specpilot.drafters.base import DraftContext
from specpilot.errors import DrafterError
from specpilot.tree import (
    Children,
    Continuation,
    DraftTree,
    GrowingTree,
    TreeSpec,
    build_tree,
    shape_tree,
)


class _Node:
    """A trie node; with ``buf`` set it is a tail: count 1, its continuation is ``buf[pos:]``.

    Children are kept as None, the only child itself, or a dict token -> child (most nodes have
    one child, and a dict per node would triple the memory)."""

    __slots__ = ("buf", "count", "depth", "kids", "pos", "tok")

    def __init__(self, tok: int, depth: int, buf: list[int] | None = None, pos: int = 0) -> None:
        self.tok = tok
        self.kids: _Node | dict[int, _Node] | None = None
        self.count = 1
        self.depth = depth
        self.buf = buf
        self.pos = pos

    def child(self, tok: int) -> _Node | None:
        k = self.kids
        if k is None:
            return None
        if type(k) is _Node:
            return k if k.tok == tok else None
        return k.get(tok)

    def attach(self, node: _Node) -> None:
        k = self.kids
        if k is None:
            self.kids = node
        elif type(k) is _Node:
            self.kids = {k.tok: k, node.tok: node}
        else:
            k[node.tok] = node

    def detach(self, tok: int) -> None:
        k = self.kids
        if type(k) is _Node:
            assert k.tok == tok
            self.kids = None
        else:
            assert k is not None
            del k[tok]
            if len(k) == 1:
                self.kids = next(iter(k.values()))

    def children(self) -> list[_Node]:
        k = self.kids
        if k is None:
            return []
        return [k] if type(k) is _Node else list(k.values())


Position = tuple[_Node, int]
"""A string in the trie: a node, and how many tokens further down its tail (0 = the node)."""


class SuffixTrie:
    """Counted trie of all substrings of length <= ``depth`` of the inserted token sequences.

    ``count`` of a node = occurrences of its string. Two ways in: :meth:`add` inserts a finished
    sequence (and :meth:`remove` takes it out again); :meth:`append` grows one live sequence token
    by token and keeps :attr:`pending`, the suffixes of the live sequence that occurred before.
    """

    def __init__(self, depth: int) -> None:
        assert depth >= 1
        self.depth = depth
        self.root = _Node(-1, 0)
        self.pending: list[_Node] = []
        """Live sequence: nodes of its suffixes that also occur earlier, longest first."""
        self.version = 0
        """Bumped by add/remove (positions held outside may be stale after)."""

    def _step(self, node: _Node, tok: int, buf: list[int], nxt: int) -> _Node | None:
        """Extend one occurrence at materialized ``node`` by ``tok`` (= ``buf[nxt - 1]``).

        Returns the child when the occurrence still shares it with another one, None when the
        occurrence now continues alone in a new tail."""
        child = node.child(tok)
        if child is None:
            node.attach(_Node(tok, node.depth + 1, buf, nxt))
            return None
        if child.buf is not None:  # a second occurrence: split the first one's tail
            obuf, opos = child.buf, child.pos
            child.buf = None
            if opos < len(obuf) and child.depth < self.depth:
                child.kids = _Node(obuf[opos], child.depth + 1, obuf, opos + 1)
        child.count += 1
        return child

    def add(self, buf: list[int]) -> None:
        """Insert a finished sequence (kept by reference: do not mutate it afterwards)."""
        self.version += 1
        n = len(buf)
        for i in range(n):
            node: _Node | None = self.root
            for d in range(min(self.depth, n - i)):
                node = self._step(node, buf[i + d], buf, i + d + 1)
                if node is None:
                    break

    def remove(self, buf: list[int]) -> None:
        """Take out a sequence inserted with :meth:`add` (the same list object)."""
        self.version += 1
        n = len(buf)
        for i in range(n):
            node = self.root
            for d in range(min(self.depth, n - i)):
                tok = buf[i + d]
                child = node.child(tok)
                assert child is not None, "remove() of a sequence never added"
                if child.buf is not None:
                    assert child.buf is buf and child.pos == i + d + 1, "tail of another sequence"
                    node.detach(tok)
                    break
                child.count -= 1
                if child.count == 0:
                    node.detach(tok)
                    break
                node = child

    def append(self, buf: list[int]) -> None:
        """The live sequence ``buf`` grew by one token (already appended)."""
        tok, nxt = buf[-1], len(buf)
        pending: list[_Node] = []
        for node in (*self.pending, self.root):
            child = self._step(node, tok, buf, nxt)
            if child is not None and child.depth < self.depth:
                pending.append(child)
        self.pending = pending

    def walk(self, pos: Position, tok: int) -> Position | None:
        """The position one token further, or None if that string never occurred."""
        node, off = pos
        if node.buf is not None:
            i = node.pos + off
            if node.depth + off < self.depth and i < len(node.buf) and node.buf[i] == tok:
                return node, off + 1
            return None
        child = node.child(tok)
        return None if child is None else (child, 0)

    def next_tokens(self, pos: Position) -> list[tuple[int, int, Position]]:
        """(token, count, position) of every continuation of ``pos``."""
        node, off = pos
        if node.buf is not None:
            i = node.pos + off
            if node.depth + off < self.depth and i < len(node.buf):
                return [(node.buf[i], 1, (node, off + 1))]
            return []
        return [(c.tok, c.count, (c, 0)) for c in node.children()]


def ranked_children(trie: SuffixTrie, pos: Position) -> list[tuple[float, int, Position]]:
    """(log p, token, position) of the continuations, most frequent first (ties: lower token)."""
    nxt = trie.next_tokens(pos)
    if not nxt:
        return []
    total = sum(c for _, c, _ in nxt)
    nxt.sort(key=lambda x: (-x[1], x[0]))
    return [(math.log(c / total), t, p) for t, c, p in nxt]


def trie_children(trie: SuffixTrie, root: Position) -> Children:
    """The children function of :func:`specpilot.tree.build_tree` below position ``root`` of
    ``trie``: a node's state is its trie position, its continuations the trie's, most frequent
    first."""

    def children(nodes: GrowingTree, frontier: list[int], width: int) -> list[list[Continuation]]:
        return [
            ranked_children(trie, nodes.states[i] if i >= 0 else root)[:width] for i in frontier
        ]

    return children


def suffix_tree(trie: SuffixTrie, pos: Position, spec: TreeSpec, max_depth: int) -> DraftTree:
    """Candidate tree below a matched pattern ``pos``, cut to ``spec``: dynamic trees take the
    ``spec.budget`` most probable nodes best-first, chains and static trees their rank paths.
    Where the continuation below ``pos`` does not branch within the budget (most matches: a
    string seen once continues in one tail), best-first is that chain, every node of
    probability 1: it is built directly (the general builder's heap and per-node calls cost
    about half of a ~80 us draft)."""
    if spec.kind == "dynamic":
        chain = _single_chain(trie, pos, min(spec.max_depth, max_depth, spec.budget))
        if chain is not None:
            return shape_tree(DraftTree.chain(chain, [0.0] * len(chain)), spec)
    children = trie_children(trie, pos)
    return build_tree(children, spec, max_depth=max_depth, width=spec.budget)


def _single_chain(trie: SuffixTrie, pos: Position, limit: int) -> list[int] | None:
    """The tokens below ``pos`` (at most ``limit``) while each position has exactly one
    continuation; None where one has several within the limit."""
    out: list[int] = []
    while len(out) < limit:
        nxt = trie.next_tokens(pos)
        if len(nxt) != 1:
            if nxt:
                return None
            break
        tok, _, pos = nxt[0]
        out.append(tok)
    return out


class SuffixDrafter:
    """SuffixDecoding over the current sequence and earlier outputs (see the module docstring)."""

    name = "suffix"
    hidden_layers: tuple[int, ...] = ()

    def __init__(
        self, max_depth: int = 16, max_corpus_tokens: int = 65536, max_pattern: int = 32
    ) -> None:
        """``max_depth``: longest draft; ``max_corpus_tokens``: earlier outputs kept (oldest
        evicted first, 0 = none); ``max_pattern``: longest suffix matched."""
        for name, value, low in (
            ("max_depth", max_depth, 1),
            ("max_pattern", max_pattern, 1),
            ("max_corpus_tokens", max_corpus_tokens, 0),
        ):
            if not isinstance(value, int) or value < low:
                raise DrafterError(
                    f"suffix drafter {name} must be an integer >= {low}, got {value!r}"
                )
        self.max_depth = max_depth
        self.max_pattern = max_pattern
        self.max_corpus_tokens = max_corpus_tokens
        depth = max_pattern + max_depth
        self.corpus = SuffixTrie(depth)
        self._docs: deque[list[int]] = deque()
        self._corpus_tokens = 0
        self._trie = SuffixTrie(depth)
        self._tokens: list[int] = []
        self._prompt_len = 0
        self._alive: list[Position] = []
        """Corpus positions of the current suffixes (length <= max_pattern), longest first."""
        self._alive_version = -1
        self.last_match = 0
        """Length of the matched pattern behind the last proposed tree (0: nothing proposed)."""

    # -- Drafter protocol ---------------------------------------------------------------------

    def begin(self, prompt: list[int]) -> None:
        """A new sequence. Its tokens are indexed at the first :meth:`propose` (the same trie
        as indexing the prompt here): a sequence the goodput budget never drafts for, as at
        large batches, never pays the ~2 ms of a 200-token prompt's index."""
        self._trie = SuffixTrie(self.max_pattern + self.max_depth)
        self._tokens = []
        self._prompt_len = len(prompt)
        self._alive = []
        self._alive_version = self.corpus.version

    def propose(self, ctx: DraftContext) -> DraftTree:
        self._sync(ctx.tokens, ctx.prompt_len)
        best, best_value = DraftTree.empty(), 0.0
        self.last_match = 0
        for trie, pos in self.matches():
            tree = suffix_tree(trie, pos, ctx.spec, self.max_depth)
            # expected accepted tokens under the counts (Python floats: a ~10-node tree)
            value = math.fsum(map(math.exp, tree.scores.tolist()))
            if value > best_value:
                best, best_value = tree, value
                self.last_match = pos[0].depth + pos[1]
        return best

    def finish(self, tokens: list[int]) -> None:
        """Add the output (``tokens`` after the prompt given to ``begin``) to the corpus."""
        if self.max_corpus_tokens == 0:
            return
        out = list(tokens[self._prompt_len :])[-self.max_corpus_tokens :]
        if not out:
            return
        while self._docs and self._corpus_tokens + len(out) > self.max_corpus_tokens:
            old = self._docs.popleft()
            self.corpus.remove(old)
            self._corpus_tokens -= len(old)
        self.corpus.add(out)
        self._docs.append(out)
        self._corpus_tokens += len(out)

    # -- matching -----------------------------------------------------------------------------

    def matches(self) -> list[tuple[SuffixTrie, Position]]:
        """The longest suffix (<= max_pattern) with a continuation: in the current sequence,
        then in the corpus of earlier outputs."""
        out: list[tuple[SuffixTrie, Position]] = []
        for node in self._trie.pending:  # longest first
            if node.depth <= self.max_pattern and node.kids is not None:
                out.append((self._trie, (node, 0)))
                break
        if self._alive_version != self.corpus.version:
            self._rematch_corpus()
        for pos in self._alive:
            if self.corpus.next_tokens(pos):
                out.append((self.corpus, pos))
                break
        return out

    def _rematch_corpus(self) -> None:
        """Recompute the corpus positions of the current suffixes from scratch."""
        toks = self._tokens
        self._alive = []
        for start in range(max(0, len(toks) - self.max_pattern), len(toks)):
            pos: Position | None = (self.corpus.root, 0)
            for tok in toks[start:]:
                pos = self.corpus.walk(pos, tok)
                if pos is None:
                    break
            if pos is not None:
                self._alive.append(pos)
        self._alive_version = self.corpus.version

    def _sync(self, tokens: list[int], prompt_len: int) -> None:
        """Feed the tokens committed since the last call (restart if the history changed)."""
        known = len(self._tokens)
        if len(tokens) < known or tokens[:known] != self._tokens:
            self.begin(tokens[:prompt_len])
            known = 0
        self._extend(tokens[known:])

    def _extend(self, new: Sequence[int]) -> None:
        toks, trie, corpus = self._tokens, self._trie, self.corpus
        track = self._alive_version == corpus.version and self._docs
        for tok in new:
            toks.append(tok)
            trie.append(toks)
            if track:
                alive = []
                for pos in (*self._alive, (corpus.root, 0)):
                    nxt = corpus.walk(pos, tok)
                    if nxt is not None and nxt[0].depth + nxt[1] <= self.max_pattern:
                        alive.append(nxt)
                self._alive = alive
