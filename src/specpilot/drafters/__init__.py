"""Drafters behind the :class:`~specpilot.drafters.base.Drafter` protocol, and their factory.

:func:`make_drafter` takes already-loaded objects (models, tokenizers) and never loads anything;
loading lives in :mod:`specpilot.loading`.
"""

from __future__ import annotations

from typing import Any

from specpilot.defaults import UNION_DEFAULTS
from specpilot.drafters.base import DraftContext, Drafter
from specpilot.drafters.draft_model import DraftModelDrafter
from specpilot.drafters.prompt_lookup import PromptLookupDrafter
from specpilot.drafters.suffix import SuffixDrafter
from specpilot.errors import DrafterError
from specpilot.model import Transformer

__all__ = [
    "DRAFTERS",
    "DraftContext",
    "DraftModelDrafter",
    "Drafter",
    "PromptLookupDrafter",
    "SuffixDrafter",
    "make_drafter",
]

DRAFTERS: dict[str, str] = {
    "none": "no drafter: plain autoregressive decoding",
    "lookup": "prompt lookup: copy what followed the last n-gram earlier in prompt + output",
    "suffix": "suffix decoding: frequency-scored continuations from a suffix trie of the "
    "sequence and earlier outputs",
    "model": "draft model: a small model with the target's tokenizer drafts (greedy / EAGLE-2)",
    "head": "trained feature-level head (EAGLE-style) shipped for the target; or pass a trained "
    "drafter directory (specpilot train-drafter) as the name",
    "head+suffix": "the trained head and suffix decoding merged into one tree per step "
    "(also DIR+suffix)",
}

DEFAULT_DRAFT_MAX_LEN = 4096
"""Cache slots a draft model may use when neither ``max_len`` nor the target's context is known."""


def _split(obj: Any) -> tuple[Any, Any]:
    """(model, tokenizer) of a loaded model, a ``(model, tokenizer)`` pair or a bare model."""
    if isinstance(obj, tuple) and len(obj) == 2:
        return obj[0], obj[1]
    if hasattr(obj, "model") and isinstance(obj.model, Transformer):
        return obj.model, getattr(obj, "tokenizer", None)
    return obj, None


def _vocab(tok: Any) -> dict[str, int]:
    """token -> id mapping of a specpilot Tokenizer, a tokenizers/transformers tokenizer or dict."""
    if isinstance(tok, dict):
        return tok
    backend = getattr(tok, "backend", tok)
    get = getattr(backend, "get_vocab", None)
    if get is None:
        raise DrafterError(f"cannot read the vocabulary of tokenizer {type(tok).__name__}")
    try:
        return dict(get(with_added_tokens=True))
    except TypeError:  # transformers tokenizers take no argument
        return dict(get())


def check_tokenizers(target_tok: Any, draft_tok: Any) -> None:
    """Raise DrafterError unless both tokenizers map the same tokens to the same ids."""
    tv, dv = _vocab(target_tok), _vocab(draft_tok)
    if tv == dv:
        return
    moved = sum(1 for t, i in dv.items() if t in tv and tv[t] != i)
    only_draft = sum(1 for t in dv if t not in tv)
    only_target = sum(1 for t in tv if t not in dv)
    raise DrafterError(
        f"drafter tokenizer differs from the target's: {len(dv)} vs {len(tv)} tokens, "
        f"{moved} with different ids, {only_draft} only in the drafter's, {only_target} only in "
        "the target's; use a draft model from the same family"
    )


UNION_OPTIONS = ("share", "trust", "trained_depth")
"""Options of X+suffix drafters (:class:`specpilot.drafters.union.UnionDrafter`)."""


def make_drafter(
    name: str, *, target: Any = None, tokenizer: Any = None, draft: Any = None, **options: Any
) -> Drafter | None:
    """Build the drafter ``name`` (a key of :data:`DRAFTERS` or a trained drafter directory);
    ``"none"`` returns None.

    ``target``: the target (a LoadedModel, a Transformer or None); ``tokenizer``: the target's.
    ``draft`` (``"model"`` only): the draft model as a LoadedModel, a ``(Transformer, tokenizer)``
    pair or a bare Transformer. The tokenizers are compared when both are known; without them the
    caller vouches for the shared vocabulary. ``options`` go to the drafter's constructor
    (lookup: min_n, max_n, max_matches, discount; suffix: max_depth, max_corpus_tokens,
    max_pattern; model: max_len, default the target's context or 4096; X+suffix: share, trust,
    trained_depth). Trained drafters (``"head"``: the one shipped for the target; or a
    directory) need ``target``.
    """
    from specpilot.drafters import trained

    base, plus_suffix = name.removesuffix("+suffix"), name.endswith("+suffix")
    if base == "head" or (name not in DRAFTERS and trained.is_drafter_dir(base)):
        union = {k: options.pop(k) for k in UNION_OPTIONS if k in options}
        if union and not plus_suffix:
            raise DrafterError(f"{sorted(union)} apply to X+suffix drafters only, not {name!r}")
        if plus_suffix:  # the measured defaults (specpilot.defaults), each overridable
            union = {**{k: v for k, v in UNION_DEFAULTS.items() if k != "min_prob"}, **union}
            options.setdefault("min_prob", UNION_DEFAULTS["min_prob"])
        path = trained.shipped_drafter(target, "head") if base == "head" else base
        head = trained.load_trained_drafter(path, target, **options)
        if not plus_suffix:
            return head
        from specpilot.drafters.union import UnionDrafter

        return UnionDrafter(SuffixDrafter(), head, **union)
    if name not in DRAFTERS:
        raise DrafterError(
            f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)} or a trained "
            "drafter directory (specpilot train-drafter --out DIR)"
        )
    if name == "none":
        if options:
            raise DrafterError(f"drafter 'none' takes no options, got {sorted(options)}")
        return None
    if name == "model":
        return _make_model_drafter(target, tokenizer, draft, options)
    cls: type = PromptLookupDrafter if name == "lookup" else SuffixDrafter
    return _construct(cls, name, options)


def _construct(cls: type, name: str, options: dict[str, Any]) -> Any:
    try:
        return cls(**options)
    except TypeError as e:
        raise DrafterError(f"bad option for drafter {name!r}: {e}") from None


def _make_model_drafter(
    target: Any, tokenizer: Any, draft: Any, options: dict[str, Any]
) -> DraftModelDrafter:
    if draft is None:
        raise DrafterError(
            "drafter 'model' needs a draft model (a small model of the target's "
            "family, loaded with its tokenizer)"
        )
    model, draft_tok = _split(draft)
    if not isinstance(model, Transformer):
        raise DrafterError(f"draft model must be a specpilot Transformer, got {type(model)}")
    target_model, target_tok = _split(target) if target is not None else (None, None)
    target_tok = tokenizer if tokenizer is not None else target_tok
    if target_model is model:
        raise DrafterError(
            "the draft model is the target model itself; use a smaller model of the same family"
        )
    if target_tok is not None and draft_tok is not None:
        check_tokenizers(target_tok, draft_tok)
    opts = dict(options)
    if isinstance(target_model, Transformer):
        opts.setdefault("vocab_size", target_model.cfg.vocab_size)
        opts.setdefault("max_len", target_model.cfg.max_position + 1024)
    opts.setdefault("max_len", DEFAULT_DRAFT_MAX_LEN)
    max_len = opts.pop("max_len")
    try:
        return DraftModelDrafter(model, max_len, **opts)
    except TypeError as e:
        raise DrafterError(f"bad option for drafter 'model': {e}") from None
