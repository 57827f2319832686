"""verify.build_inputs: the single-sequence inputs (built without the batched block's pads and
scratch slots) and the batched block equal the reference construction for any trees."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specpilot.tree import DraftTree, tree_mask
from specpilot.verify import VerifyInputs, VerifyRow, build_inputs


def reference(rows: Sequence[VerifyRow], scratch: int) -> VerifyInputs:
    """The construction every verify step used before the single-sequence path: the padded
    (B, T) block for every batch, then, for one sequence, contiguous slots and no mask for an
    empty tree. A pad row sees its sequence's root only (one key: its softmax is never empty,
    and it costs no attention over the prefix)."""
    b = len(rows)
    t = 1 + max(r.tree.size for r in rows)
    kv_len = max(r.cache_len + r.tree.size + 1 for r in rows)
    toks = torch.zeros(b, t, dtype=torch.long)
    pos = torch.zeros(b, t, dtype=torch.long)
    where = torch.full((b, t), scratch, dtype=torch.long)
    mask = torch.zeros(b, t, kv_len, dtype=torch.bool)
    for i, r in enumerate(rows):
        c, n = r.cache_len, r.tree.size
        toks[i, 0] = r.root
        toks[i, 1 : n + 1] = r.tree.tokens
        pos[i, : n + 1] = c + torch.cat([torch.zeros(1, dtype=torch.long), r.tree.depths])
        pos[i, n + 1 :] = c
        where[i, : n + 1] = torch.arange(c, c + n + 1)
        mask[i, : n + 1, :c] = True
        mask[i, : n + 1, c : c + n + 1] = tree_mask(r.tree)
        mask[i, n + 1 :, c] = True
    if b == 1:
        return VerifyInputs(
            toks, pos, rows[0].cache_len, kv_len, None if rows[0].tree.size == 0 else mask
        )
    return VerifyInputs(toks, pos, where, kv_len, mask)


@st.composite
def trees(draw: st.DrawFn, max_nodes: int = 9) -> DraftTree:
    n = draw(st.integers(0, max_nodes))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, 63), min_size=n, max_size=n))
    return DraftTree.from_parents(tokens, parents) if n else DraftTree.empty()


def _same(a: VerifyInputs, b: VerifyInputs) -> None:
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.positions, b.positions)
    assert a.kv_len == b.kv_len
    if isinstance(b.slots, int):
        assert isinstance(a.slots, int) and a.slots == b.slots
    else:
        assert isinstance(a.slots, torch.Tensor) and torch.equal(a.slots, b.slots)
    assert (a.mask is None) == (b.mask is None)
    if b.mask is not None:
        assert a.mask is not None and a.mask.dtype == torch.bool
        assert torch.equal(a.mask, b.mask)


@settings(max_examples=60, deadline=None)
@given(tree=trees(), cache_len=st.integers(0, 40), root=st.integers(0, 63))
def test_single_sequence_inputs_equal_the_reference(
    tree: DraftTree, cache_len: int, root: int
) -> None:
    row = VerifyRow(root, cache_len, tree)
    got = build_inputs([row], torch.device("cpu"), scratch=99)
    _same(got, reference([row], 99))
    assert isinstance(got.slots, int)  # contiguous slots from the cache length
    assert (got.mask is None) == (tree.size == 0)  # an empty tree is plain decoding


@settings(max_examples=40, deadline=None)
@given(
    batch=st.lists(
        st.tuples(trees(6), st.integers(0, 30), st.integers(0, 63)), min_size=2, max_size=4
    )
)
def test_batched_inputs_equal_the_reference(batch: list[tuple[DraftTree, int, int]]) -> None:
    rows = [VerifyRow(root, c, t) for t, c, root in batch]
    _same(build_inputs(rows, torch.device("cpu"), scratch=127), reference(rows, 127))


def test_pad_rows_see_only_their_root() -> None:
    """A pad row of the batched block attends to one key, its sequence's root slot (attention
    over the whole prefix for rows whose outputs are dropped cost a 32-sequence step ~10 ms)."""
    rows = [
        VerifyRow(1, 30, DraftTree.chain([2, 3, 4, 5])),
        VerifyRow(6, 12, DraftTree.empty()),
        VerifyRow(7, 20, DraftTree.chain([8])),
    ]
    got = build_inputs(rows, torch.device("cpu"), scratch=99)
    assert got.mask is not None
    for i, r in enumerate(rows):
        n = r.tree.size
        for t in range(n + 1, got.mask.shape[1]):
            assert got.mask[i, t].nonzero().flatten().tolist() == [r.cache_len], (i, t)
        assert got.mask[i, : n + 1, : r.cache_len].all()  # real rows still see the prefix
