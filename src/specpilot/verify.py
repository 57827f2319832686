"""The verify step, once: build inputs, forward, accept, commit (single and batched decoding).

A step verifies, for each of B sequences, its root (the last committed token, not yet cached)
and its draft tree in one target forward, then keeps the accepted path and one more token::

    row 0  [prefix of 7 cached] root a b c       (3 draft nodes)   slots 7..10
    row 1  [prefix of 4 cached] root x  pad pad  (1 draft node)    slots 4..5, pads -> scratch

1. inputs  - :func:`build_inputs`: tokens, positions (prefix length + depth), cache slots and the
   attention mask (the prefix, then the tree block of :func:`specpilot.tree.tree_mask`); rows
   shorter than the widest tree are padded with rows that write to a scratch slot and see only
   their own prefix and root;
2. forward - :func:`forward`: one target call over the (B, T) block;
3. accept  - :func:`accept`: greedy (:func:`specpilot.tree.verify_greedy`) or lossless sampling
   (:meth:`specpilot.sampling.Sampler.verify`) picks the accepted path and the bonus token;
4. commit  - :func:`commit`: the accepted nodes' cache entries move onto the committed prefix
   (:meth:`specpilot.model.Transformer.compact_cache`).

:func:`verify_step` runs the four in order; :class:`specpilot.engine.Engine` calls it with one
sequence, :class:`specpilot.batch.BatchEngine` with all running ones, and the overhead mechanisms
of :mod:`specpilot.fastverify` reuse the stages they do not replace. With one sequence the inputs
are exactly those of plain decoding when the tree is empty (contiguous slots, no mask), so a step
with an empty tree is one autoregressive step. :func:`prefill` is the prompt's causal forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specpilot.errors import ConfigError
from specpilot.model import ForwardOut, Packing, Transformer, causal_mask
from specpilot.sampling import Sampler
from specpilot.tree import Acceptance, DraftTree, TreeSpec, tree_mask, verify_greedy


@dataclass(frozen=True)
class VerifyRow:
    """One sequence of a verify step."""

    root: int
    """The last committed token (verified with the tree; not yet in the cache)."""
    cache_len: int
    """Committed tokens already in the cache (the root's position)."""
    tree: DraftTree
    sampler: Sampler | None = None
    """None = greedy."""


@dataclass(frozen=True)
class VerifyInputs:
    """The target call of one verify step (see :meth:`specpilot.model.Transformer.forward`)."""

    tokens: Tensor
    """(B, T) long: root, nodes, pads."""
    positions: Tensor
    """(B, T) long: prefix length + depth (pads at the root's position)."""
    slots: int | Tensor
    """An int (one sequence: contiguous from its cache length) or (B, T) long cache slots."""
    kv_len: int
    """Keys [0, kv_len) are read."""
    mask: Tensor | None
    """(B, T, kv_len) bool, True = may attend; None = plain decoding of one sequence."""


@dataclass(frozen=True)
class StepOutcome:
    """What one sequence's step committed."""

    path: tuple[int, ...]
    """Accepted node indices, root to leaf."""
    tokens: list[int]
    """Newly committed tokens: the accepted path's tokens and the bonus token."""
    logits: Tensor
    """(n+1, V) verify logits of the root and the tree's nodes."""
    hidden: tuple[Tensor, ...]
    """Per tapped layer, (len(path) + 1, dim) states of the rows now committed."""


def _single_inputs(r: VerifyRow, device: torch.device) -> VerifyInputs:
    """One sequence: no pads, contiguous slots from its cache length, no mask for an empty tree
    (plain decoding); otherwise the prefix and the tree block. Built on the device directly
    (one tensor per input, no host copies on CPU)."""
    c, n = r.cache_len, r.tree.size
    if not n:  # plain decoding: a (1, 1) token and position
        toks = torch.tensor([[r.root]], dtype=torch.long, device=device)
        pos = torch.tensor([[c]], dtype=torch.long, device=device)
        return VerifyInputs(toks, pos, c, c + 1, None)
    toks = torch.tensor([[r.root, *r.tree.tokens.tolist()]], dtype=torch.long, device=device)
    pos = torch.tensor([[c, *(c + d for d in r.tree.depths.tolist())]], dtype=torch.long,
                       device=device)  # fmt: skip
    mask = torch.ones(1, n + 1, c + n + 1, dtype=torch.bool)  # (1, T, kv_len)
    mask[0, :, c:] = tree_mask(r.tree)
    return VerifyInputs(toks, pos, c, c + n + 1, mask.to(device))


def build_inputs(
    rows: Sequence[VerifyRow], device: torch.device, scratch: int,
    shape: tuple[int, int] | None = None,
) -> VerifyInputs:  # fmt: skip
    """The (B, T) verify block of ``rows``; pad rows write to cache slot ``scratch``.
    ``shape``: (T, kv_len) fixed for every call (fixed-width steps), else the least that fits."""
    b = len(rows)
    if b == 1 and shape is None:
        return _single_inputs(rows[0], device)
    t = 1 + max(r.tree.size for r in rows)
    kv_len = max(r.cache_len + r.tree.size + 1 for r in rows)
    if shape is not None:
        assert shape[0] >= t and shape[1] >= kv_len, f"{rows} do not fit the shape {shape}"
        t, kv_len = shape
    toks = torch.zeros(b, t, dtype=torch.long)  # (B, T)
    pos = torch.zeros(b, t, dtype=torch.long)  # (B, T)
    where = torch.full((b, t), scratch, dtype=torch.long)  # (B, T)
    mask = torch.zeros(b, t, kv_len, dtype=torch.bool)  # (B, T, kv_len)
    for i, r in enumerate(rows):
        c, n = r.cache_len, r.tree.size
        toks[i, 0] = r.root
        toks[i, 1 : n + 1] = r.tree.tokens
        pos[i, : n + 1] = c + torch.cat([torch.zeros(1, dtype=torch.long), r.tree.depths])
        pos[i, n + 1 :] = c
        where[i, : n + 1] = torch.arange(c, c + n + 1)
        mask[i, : n + 1, :c] = True
        mask[i, : n + 1, c : c + n + 1] = tree_mask(r.tree)
        mask[i, n + 1 :, c] = True  # pads see the root only: one key, never an empty softmax
    return VerifyInputs(toks.to(device), pos.to(device), where.to(device), kv_len, mask.to(device))


def forward(
    model: Transformer,
    inputs: VerifyInputs,
    taps: tuple[int, ...] = (),
    cache_rows: slice | None = None,
    pack: Packing | None = None,
) -> ForwardOut:
    """The target forward of a verify step (logits for every row, or every real row)."""
    return model(
        inputs.tokens,
        inputs.positions,
        inputs.slots,
        inputs.kv_len,
        inputs.mask,
        hidden_layers=taps,
        cache_rows=cache_rows,
        pack=pack,
    )


def packing(rows: Sequence[VerifyRow], device: torch.device) -> tuple[Packing, list[int]]:
    """The real rows of the verify block of ``rows`` (each row's root and nodes, no pads) and
    the offset of each sequence's first row among them."""
    t = 1 + max(r.tree.size for r in rows)
    index, offsets = [], []
    for i, r in enumerate(rows):
        offsets.append(len(index))
        index.extend(range(i * t, i * t + r.tree.size + 1))
    return Packing(torch.tensor(index, device=device), len(rows), t), offsets


def accept(tree: DraftTree, logits: Tensor, sampler: Sampler | None = None) -> Acceptance:
    """Accepted path and new tokens of ``tree`` from its verify logits (n+1, V)."""
    if sampler is None or sampler.greedy:
        return verify_greedy(tree, argmax_rows(logits))
    return sampler.verify(tree, logits)


def argmax_rows(logits: Tensor) -> list[int]:
    """Per row of ``logits`` (R, V), the index of its largest value, the first one on ties and
    the first NaN if any: ``logits.argmax(-1).tolist()``. A contiguous fp32 CPU tensor goes
    through NumPy's vectorized argmax (the same contract: first maximal index, NaN first),
    ~10-20x faster than torch's reduction at a 49k vocabulary (the step's host read either way)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        return logits.detach().numpy().argmax(-1).tolist()  # type: ignore[no-any-return]
    return logits.argmax(-1).tolist()  # type: ignore[no-any-return]


def commit(model: Transformer, cache_len: int, path: Sequence[int], row: int | None = None) -> None:
    """Move the accepted nodes' K/V (slots ``cache_len + 1 + i``) onto the committed prefix
    (``cache_len + 1, ...``) in cache row ``row`` (None = every row); no-op when already there."""
    if not path or list(path) == list(range(len(path))):
        return
    src = torch.tensor([cache_len + 1 + i for i in path], device=model.device)
    model.compact_cache(src, cache_len + 1, row)


def committed_rows(path: Sequence[int]) -> list[int]:
    """Verify rows committed by an accepted ``path``: the root's and the path nodes'."""
    return [0, *(i + 1 for i in path)]


def check_fixed(tree: DraftTree, width: int, cache_len: int, max_len: int) -> None:
    """ConfigError unless ``tree`` is a chain that fits a fixed-width step
    (:mod:`specpilot.fastverify`) and the step's rows fit the cache."""
    n = tree.size
    if n + 1 > width:
        raise ConfigError(f"a draft of {n} nodes does not fit fixed_width {width}; "
                          f"raise fixed_width to {n + 1} or draft fewer nodes")  # fmt: skip
    if n and not bool((tree.depths == torch.arange(1, n + 1)).all()):
        raise ConfigError("fixed_width verifies chains only (a tree node's key slot is not its "
                          "position); use --tree chain")  # fmt: skip
    if cache_len + width > max_len:
        raise ConfigError(f"fixed_width {width} at cache length {cache_len} runs past the "
                          f"cache of {max_len} slots")  # fmt: skip


def check_fixed_spec(spec: TreeSpec, width: int) -> None:
    """ConfigError, before decoding starts, for a tree shape fixed-width steps cannot verify."""
    if spec.kind != "chain":
        raise ConfigError(f"fixed_width verifies chains only, not a {spec.kind} tree; use "
                          "--tree chain (or --fixed-width 0)")  # fmt: skip
    if spec.k + 1 > width:
        raise ConfigError(f"a chain of {spec.k} does not fit fixed_width {width}; use "
                          f"--fixed-width {spec.k + 1} or a shorter chain")  # fmt: skip


def verify_step(
    model: Transformer,
    rows: Sequence[VerifyRow],
    taps: tuple[int, ...] = (),
    cache_rows: slice | None = None,
    scratch: int | None = None,
    packed: bool = False,
    fixed_width: int = 0,
) -> list[StepOutcome]:
    """Verify every row's tree in one forward, accept, and commit each row's path.

    Row i of ``rows`` uses cache row i (of ``cache_rows``); ``scratch`` is the cache slot pad
    rows write to (default: the last slot of the cache). ``packed``: the row-wise work of the
    forward runs on the real rows only (:class:`specpilot.model.Packing`), so a step costs the
    rows its trees have, not B x the widest tree's. ``fixed_width``: every call one shape,
    (every cache row, ``fixed_width`` rows, the whole cache) with dummy sequences in the rows
    no sequence holds, chains only (:mod:`specpilot.fastverify`); not packed.
    """
    assert rows, "a verify step needs at least one sequence"
    scratch = model.max_len - 1 if scratch is None else scratch
    pack, offsets = None, [0] * len(rows)
    shape, block = None, list(rows)
    if fixed_width:
        for r in rows:
            check_fixed(r.tree, fixed_width, r.cache_len, model.max_len)
        shape, cache_rows = (fixed_width, model.max_len), slice(0, model.batch)
        block += [VerifyRow(0, 0, DraftTree.empty())] * (model.batch - len(rows))
    elif packed and len(rows) > 1:
        pack, offsets = packing(rows, model.device)
    inputs = build_inputs(block, model.device, scratch, shape)
    out = forward(model, inputs, taps, cache_rows, pack)
    assert out.logits is not None
    outcomes = []
    # a plain step (no draft node anywhere): each sequence's one row of every tapped layer, all
    # taken in one split per layer (a slice per sequence and layer cost ~0.15 ms a step at 32)
    plain = bool(out.hidden) and not fixed_width and all(r.tree.size == 0 for r in rows)
    # (one sequence: its (1, dim) row as it is, no split: ~20 us a step)
    flat = [h.reshape(-1, h.shape[-1]) for h in out.hidden] if plain else []
    split = [(f,) if len(rows) == 1 else f.split(1) for f in flat]
    for i, r in enumerate(rows):
        b, o = (i, 0) if pack is None else (0, offsets[i])
        logits = out.logits[b, o : o + r.tree.size + 1]  # (n+1, V)
        acc = accept(r.tree, logits, r.sampler)
        commit(model, r.cache_len, acc.path, _cache_row(cache_rows, i, len(rows)))
        if plain:
            hidden = tuple(rows_of[i] for rows_of in split)
        else:
            hidden = _committed_hidden(out.hidden, b, o, acc.path)
        outcomes.append(StepOutcome(acc.path, list(acc.tokens), logits, hidden))
    return outcomes


def _committed_hidden(
    hidden: tuple[Tensor, ...], b: int, o: int, path: tuple[int, ...]
) -> tuple[Tensor, ...]:
    """Per tapped layer, the states (len(path) + 1, dim) of the committed rows of batch entry
    ``b`` (its first verify row at ``o``): a slice when they are consecutive (plain decoding, a
    chain's accepted prefix), else one gather with an index tensor (list indexing converts the
    list per layer)."""
    if not hidden:
        return ()
    k = len(path) + 1
    if all(j == i for i, j in enumerate(path)):
        return tuple(h[b, o : o + k] for h in hidden)
    idx = torch.tensor([o + j for j in committed_rows(path)], device=hidden[0].device)
    return tuple(h[b].index_select(0, idx) for h in hidden)


def _cache_row(cache_rows: slice | None, i: int, b: int) -> int | None:
    """The cache row of verify row ``i`` (None: one sequence on the whole cache)."""
    if cache_rows is None:
        return None if b == 1 else i
    return (cache_rows.start or 0) + i


def prefill(
    model: Transformer, prompt: Sequence[int], taps: tuple[int, ...] = (), row: int | None = None
) -> ForwardOut:
    """Causal forward of ``prompt`` into cache row ``row`` (None = the whole cache); logits of
    the last row only, hidden states of every row."""
    p, dev = len(prompt), model.device
    return model(
        torch.tensor([list(prompt)], device=dev),
        torch.arange(p, device=dev)[None],
        0,
        p,
        causal_mask(0, p, p, dev),
        logits_rows=slice(p - 1, p),
        hidden_layers=taps,
        cache_rows=None if row is None else slice(row, row + 1),
    )
