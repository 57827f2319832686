"""``--plan P`` for ``generate``, ``bench`` and ``profile``: the command line's side of
:func:`specpilot.runtime.build` (flag checks, loading, HF peers). Renders nothing.

A plan fixes the drafter, the tree and the engine, so the flags that set those (``--drafter``,
``--tree``, ``--k``, ``--paths``, ``--budget``, ``--topk``, ``--depth``, ``--union-*``,
``--head-min-prob``, ``--lookup-*``, ``--device``, ``--dtype``, ``--attention``, ``--linear``,
``--threads``) are refused next to it with a ConfigError saying so; ``--draft-model`` is still
how a plan that drafts with a draft model gets one.
"""

from __future__ import annotations

import argparse
from typing import Any

from specpilot.errors import ConfigError

PLAN_OWNED = {
    "drafter": None,
    "tree": None,
    "paths": None,
    "k": 5,
    "budget": 16,
    "topk": 4,
    "depth": 8,
    "union_trust": None,
    "union_depth": None,
    "head_min_prob": None,
    "lookup_min_n": 1,
    "lookup_max_n": 4,
    "device": "cpu",
    "dtype": "float32",
    "attention": "auto",
    "linear": "onednn",
    "threads": None,
}
"""Flags a plan decides, with the value that means "not given"."""


def check_plan_flags(args: argparse.Namespace) -> None:
    """ConfigError when a flag the plan decides was given together with ``--plan``."""
    given = [
        "--" + name.replace("_", "-")
        for name, unset in PLAN_OWNED.items()
        if hasattr(args, name) and getattr(args, name) != unset
    ]
    if given:
        raise ConfigError(
            f"--plan sets the drafter, tree and engine; drop {', '.join(given)} "
            "(or edit the plan file)"
        )


def setup_plan(
    args: argparse.Namespace, hf_peers: bool = False
) -> tuple[Any, Any, list[Any], list[Any]]:
    """Load the target (and draft model), build ``args.plan``; same return as ``cli._setup``:
    (loaded, engine, candidates, peers). Sets ``args.device/dtype/attention/linear/threads``
    to the plan's so reports show what ran."""
    from specpilot.loading import load_model
    from specpilot.plan import load_plan
    from specpilot.runtime import build, plan_options

    check_plan_flags(args)
    plan = load_plan(args.plan)
    opts = plan_options(plan)  # bad options fail before the model loads
    hybrid = opts.get("hybrid_drafting")
    wants_model = plan.drafter == "model" or (hybrid is not None and hybrid.fallback == "model")
    if wants_model and not getattr(args, "draft_model", None):
        raise ConfigError("this plan drafts with a draft model: give it with --draft-model PATH")
    batch = getattr(args, "batch_size", None) or 1
    ecfg = plan.engine
    loaded = load_model(args.model, device=ecfg.device, dtype=ecfg.torch_dtype)
    draft = None
    if getattr(args, "draft_model", None):
        draft = load_model(args.draft_model, device=ecfg.device, dtype=ecfg.torch_dtype)
    peers: list[Any] = []
    if hf_peers:  # built from the same weights, before the engine prepacks them
        from specpilot.peers.hf import build_hf_model, make_hf_peers

        hf = build_hf_model(loaded.cfg, loaded.model.state_dict())
        names = ("greedy", "prompt-lookup", *(("assisted",) if draft else ()))
        hf_draft = build_hf_model(draft.cfg, draft.model.state_dict()) if draft else None
        peers = list(make_hf_peers(hf, names, draft=hf_draft))
    built = build(plan, loaded, draft=draft, batch_size=batch)
    args.device, args.dtype, args.linear = ecfg.device, ecfg.dtype, ecfg.linear
    args.attention, args.threads = ecfg.attention, ecfg.threads
    cand = built.candidate()
    return loaded, built.engine, [cand] if cand is not None else [], peers
