"""The engine's per-step glue: the fast argmax, the committed hidden rows, the frozen heap."""

from __future__ import annotations

import gc

import pytest
import torch

from specpilot.engine import frozen_heap
from specpilot.tree import DraftTree
from specpilot.verify import (
    VerifyRow,
    _committed_hidden,
    _single_inputs,
    argmax_rows,
    committed_rows,
)


def test_argmax_rows_matches_torch_on_ties_nan_and_inf() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(50):  # small integers: many ties per row
        x = torch.randint(-3, 3, (11, 4099), generator=g).float()
        assert argmax_rows(x) == x.argmax(-1).tolist()
    x = torch.randn(4, 300, generator=g)
    x[1, 7] = x[1, 9] = float("nan")
    x[2] = float("-inf")
    x[3, 5] = x[3, 250] = float("inf")
    assert argmax_rows(x) == x.argmax(-1).tolist() == [int(x[0].argmax()), 7, 0, 5]
    assert argmax_rows(x[:, ::2]) == x[:, ::2].argmax(-1).tolist()  # not contiguous: torch
    assert argmax_rows(x[0]) == int(x[0].argmax())  # one row: an int, as tolist gives


@pytest.mark.parametrize("path", [(), (0,), (0, 1, 2), (1,), (0, 2), (2, 3)])
def test_committed_hidden_rows(path: tuple[int, ...]) -> None:
    h = torch.randn(2, 6, 5)
    for b, o in ((0, 0), (1, 1)):
        got = _committed_hidden((h, h * 2), b, o, path)
        keep = [o + j for j in committed_rows(path)]
        assert torch.equal(got[0], h[b, keep]) and torch.equal(got[1], (h * 2)[b, keep])
    assert _committed_hidden((), 0, 0, path) == ()


def test_single_inputs_plain_and_tree() -> None:
    plain = _single_inputs(VerifyRow(7, 4, DraftTree.empty()), torch.device("cpu"))
    assert plain.tokens.tolist() == [[7]] and plain.positions.tolist() == [[4]]
    assert (plain.slots, plain.kv_len, plain.mask) == (4, 5, None)
    tree = DraftTree.from_parents([5, 6, 8], [-1, -1, 0])
    got = _single_inputs(VerifyRow(7, 3, tree), torch.device("cpu"))
    assert got.tokens.tolist() == [[7, 5, 6, 8]] and got.positions.tolist() == [[3, 4, 4, 5]]
    assert got.tokens.dtype == got.positions.dtype == torch.long
    assert got.mask is not None and got.mask.shape == (1, 4, 7)
    assert got.mask[0, :, :3].all()
    assert got.mask[0, :, 3:].int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 0, 1, 0],
        [1, 1, 0, 1],
    ]


def test_frozen_heap_freezes_and_restores() -> None:
    if gc.get_freeze_count():
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        cycle: list[object] = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1  # garbage made inside is still collected
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), frozen_heap():
        raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


def test_frozen_heap_leaves_a_callers_freeze_and_a_disabled_collector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    real_freeze, real_unfreeze = gc.freeze, gc.unfreeze
    monkeypatch.setattr(gc, "freeze", lambda: (calls.append("freeze"), real_freeze())[1])
    monkeypatch.setattr(gc, "unfreeze", lambda: (calls.append("unfreeze"), real_unfreeze())[1])
    real_freeze()  # the caller's own freeze (frozen objects may die meanwhile: count calls)
    try:
        with frozen_heap():
            assert gc.get_freeze_count() > 0
        assert calls == []  # neither re-frozen nor unfrozen under the caller
    finally:
        real_unfreeze()
    gc.disable()
    try:
        with frozen_heap():
            assert gc.get_freeze_count() == 0
        assert not gc.isenabled() and calls == []
    finally:
        gc.enable()
    with frozen_heap():
        pass
    assert calls == ["freeze", "unfreeze"]  # the spies see a plain use


def test_generate_runs_with_a_frozen_heap_and_restores_it() -> None:
    from specpilot.engine import Engine, EngineConfig, GenerationConfig

    from .conftest import tiny_model

    model = tiny_model()
    seen: list[int] = []
    eng = Engine(model, EngineConfig(attention="exact", linear="torch"))
    res = eng.generate([1, 2, 3], GenerationConfig(max_new_tokens=4, stop_on_eos=False),
                       on_tokens=lambda t: seen.append(gc.get_freeze_count()))  # fmt: skip
    assert len(res.tokens) == 4 and seen and all(n > 0 for n in seen)
    assert gc.get_freeze_count() == 0
