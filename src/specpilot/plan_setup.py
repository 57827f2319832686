"""The command line's one setup path: flags (or ``--plan P``) become plans, plans are built by
:func:`specpilot.runtime.build`. Used by ``generate``, ``bench``, ``profile`` and ``serve``.
Renders nothing.

Flags. Every flag a plan decides (:data:`PLAN_OWNED`: the drafter and its options, the tree, the
engine) defaults to None, meaning "not given": with ``--plan`` any of them given is an error, even
when its value equals the default. Without ``--plan``, each ``--drafter`` x ``--tree``
combination becomes one :class:`~specpilot.plan.Plan`; a flag not given takes the value of
:class:`~specpilot.tree.TreeSpec` / :class:`~specpilot.engine.EngineConfig` / the drafter, and with
no ``--drafter`` (and no tree flag) the target's default drafting
(:func:`specpilot.runtime.default_drafting`) applies. ``--draft-model`` is how a plan that drafts
with a draft model gets one.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specpilot.errors import ConfigError

ENGINE_FLAGS = ("device", "dtype", "attention", "linear", "threads", "goodput", "numerics",
                "fixed_width")  # fmt: skip
SHAPE_FLAGS = ("k", "paths", "budget", "topk", "depth")
DRAFTER_FLAGS = ("union_trust", "union_depth", "head_min_prob", "lookup_min_n", "lookup_max_n")
PLAN_OWNED = ("drafter", "tree", *SHAPE_FLAGS, *DRAFTER_FLAGS, *ENGINE_FLAGS)
"""Flags a plan decides; each defaults to None (not given)."""


@dataclass(frozen=True)
class Setup:
    """What a command decodes with."""

    loaded: Any
    """The target (:class:`specpilot.loading.LoadedModel`)."""
    engine: Any
    """The :class:`specpilot.engine.Engine` every candidate shares."""
    candidates: list[Any]
    """:class:`specpilot.bench.Candidate` per speculative plan (none for plain decoding)."""
    peers: list[Any]
    """Hugging Face peers built from the same weights (``hf_peers``)."""
    built: list[Any]
    """The :class:`specpilot.runtime.Built` plans, in order."""


def given(args: argparse.Namespace, names: tuple[str, ...] = PLAN_OWNED) -> list[str]:
    """The flags among ``names`` that were given (``--flag`` spelling)."""
    return ["--" + n.replace("_", "-") for n in names if getattr(args, n, None) is not None]


def check_plan_flags(args: argparse.Namespace) -> None:
    """ConfigError when a flag the plan decides was given together with ``--plan``."""
    flags = given(args)
    if flags:
        raise ConfigError(
            f"--plan sets the drafter, tree and engine; drop {', '.join(flags)} "
            "(or edit the plan file)"
        )


def engine_config(args: argparse.Namespace) -> Any:
    """The engine flags given, over :class:`EngineConfig`'s defaults (validated there)."""
    from specpilot.engine import EngineConfig

    return EngineConfig(**{n: getattr(args, n) for n in ENGINE_FLAGS if getattr(args, n, None)
                           is not None})


def tree_specs(args: argparse.Namespace) -> list[Any] | None:
    """One TreeSpec per ``--tree`` (default chain) from the shape flags given; None when no tree
    or shape flag was given (the drafter's default tree applies)."""
    from specpilot.tree import TreeSpec

    if not args.tree and not given(args, SHAPE_FLAGS):
        return None
    shape = {n: getattr(args, n) for n in ("k", "budget", "topk", "depth") if getattr(args, n)
             is not None}
    paths = TreeSpec.parse_paths(args.paths) if args.paths else ()
    kinds = list(dict.fromkeys(args.tree or ["chain"]))
    if "static" in kinds and not paths:
        raise ConfigError("--tree static needs --paths, e.g. --paths '0;1;0.0;0.1'")
    return [TreeSpec(kind=t, paths=paths, **shape) for t in kinds]


def drafter_options(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Constructor options of drafter ``name`` from the drafter flags given."""
    opts: dict[str, Any] = {}
    if name == "lookup":
        pairs = (("min_n", args.lookup_min_n), ("max_n", args.lookup_max_n))
        opts = {k: v for k, v in pairs if v is not None}
    elif name.endswith("+suffix"):
        pairs = (("trust", args.union_trust), ("trained_depth", args.union_depth))
        opts = {k: v for k, v in pairs if v is not None}
    if args.head_min_prob is not None and name not in ("suffix", "lookup", "model", "none"):
        opts["min_prob"] = args.head_min_prob
    return opts


def check_flags(args: argparse.Namespace) -> None:
    """The flag checks that need no model (so a bad flag fails before loading)."""
    drafters = list(dict.fromkeys(args.drafter or []))
    check_drafter_names(drafters)
    if "model" in drafters and not args.draft_model:
        raise ConfigError("--drafter model needs --draft-model PATH")
    lo = 1 if args.lookup_min_n is None else args.lookup_min_n
    hi = 4 if args.lookup_max_n is None else args.lookup_max_n
    if lo < 1 or hi < lo:
        raise ConfigError("--lookup-min-n must be >= 1 and <= --lookup-max-n")
    if (args.union_trust or 0) < 0 or (args.union_depth or 0) < 0:
        raise ConfigError("--union-trust and --union-depth must be >= 0 (0 = off)")
    if args.head_min_prob is not None and not 0.0 <= args.head_min_prob < 1.0:
        raise ConfigError(f"--head-min-prob must be in [0, 1), got {args.head_min_prob}")
    engine_config(args)
    tree_specs(args)


def check_drafter_names(names: list[str]) -> None:
    """ConfigError for a --drafter that is neither a known name nor a drafter directory."""
    from specpilot.drafters import DRAFTERS
    from specpilot.drafters.trained import is_drafter_dir

    for name in names:
        if name not in DRAFTERS and not is_drafter_dir(name.removesuffix("+suffix")):
            where = "is not a drafter directory (no config.json)" if Path(name).exists() else ""
            raise ConfigError(
                f"--drafter {name!r} {where or 'is unknown'}: use one of "
                f"{', '.join(DRAFTERS)} or a directory made by specpilot train-drafter"
            )


def flag_plans(args: argparse.Namespace, loaded: Any) -> list[tuple[str, Any]]:
    """(label, plan) per ``--drafter`` x ``--tree`` (see the module docstring)."""
    from specpilot.drafters import DRAFTERS
    from specpilot.plan import Plan
    from specpilot.runtime import default_drafting, default_goodput, lossless_gpu_engine

    ecfg = engine_config(args)
    if getattr(args, "goodput", None) is None and default_goodput(loaded):
        ecfg = dataclasses.replace(ecfg, goodput=True)
    specs = tree_specs(args)
    default_name, default_tree = default_drafting(loaded)
    names = list(dict.fromkeys(args.drafter or [default_name]))
    if specs is None:
        specs = [default_tree] if not args.drafter else [_chain()]
    if getattr(args, "fixed_width", None) is None:
        ecfg = lossless_gpu_engine(ecfg, specs)
    out = []
    for name in names:
        for spec in specs:
            label = f"{Path(name).name if name not in DRAFTERS else name}/{spec.kind}"
            plan = Plan(drafter=name, drafter_options=drafter_options(name, args), tree=spec,
                        engine=ecfg)
            out.append((label, plan))
    return out


def _chain() -> Any:
    from specpilot.tree import TreeSpec

    return TreeSpec(kind="chain")


def weights_mode(args: argparse.Namespace, hf_peers: bool = False) -> str:
    """``--weights`` as given; else ``fp32`` when the Hugging Face peers run (they are built from
    the fp32 weights), else the loader's default (``auto``: native for a GGUF file on CPU fp32)."""
    from specpilot.loading import DEFAULT_WEIGHTS

    given_weights = getattr(args, "weights", None)
    if given_weights:
        return str(given_weights)
    return "fp32" if hf_peers else DEFAULT_WEIGHTS


def load_plans(
    args: argparse.Namespace, hf_peers: bool = False
) -> tuple[Any, list[tuple[str | None, Any]]]:
    """The target and the (label, plan) pairs to run: ``--plan``'s, or the flags'."""
    from specpilot.loading import load_model
    from specpilot.plan import load_plan
    from specpilot.runtime import plan_options

    weights = weights_mode(args, hf_peers)
    if getattr(args, "plan", None):
        check_plan_flags(args)
        plan = load_plan(args.plan)
        plan_options(plan)  # bad options fail before the model loads
        ecfg = plan.engine
        loaded = load_model(args.model, device=ecfg.device, dtype=ecfg.torch_dtype, weights=weights)
        return loaded, [(None, plan)]
    check_flags(args)
    ecfg = engine_config(args)
    loaded = load_model(args.model, device=ecfg.device, dtype=ecfg.torch_dtype, weights=weights)
    pairs: list[tuple[str | None, Any]] = list(flag_plans(args, loaded))
    return loaded, pairs


def setup(args: argparse.Namespace, hf_peers: bool = False) -> Setup:
    """Load the target (and draft model), build every plan. Sets ``args.device/dtype/attention/
    linear/threads`` to what runs, so reports show it."""
    from specpilot.loading import load_model
    from specpilot.runtime import build, uses_draft_model

    loaded, pairs = load_plans(args, hf_peers)
    plans = [p for _, p in pairs]
    ecfg = plans[0].engine
    wants_model = any(uses_draft_model(p) for p in plans)
    if wants_model and not getattr(args, "draft_model", None):
        raise ConfigError("this plan drafts with a draft model: give it with --draft-model PATH")
    draft = None
    if wants_model:
        draft = load_model(args.draft_model, device=ecfg.device, dtype=ecfg.torch_dtype,
                           weights=weights_mode(args, hf_peers))  # fmt: skip
    peers: list[Any] = []
    if hf_peers and loaded.model.native:
        raise ConfigError("the Hugging Face peers need the fp32 weights: drop --weights native")
    if hf_peers:  # built from the same weights, before the engine prepacks them
        from specpilot.peers.hf import build_hf_model, make_hf_peers

        hf = build_hf_model(loaded.cfg, loaded.model.state_dict())
        names = ("greedy", "prompt-lookup", *(("assisted",) if draft else ()))
        hf_draft = build_hf_model(draft.cfg, draft.model.state_dict()) if draft else None
        peers = list(make_hf_peers(hf, names, draft=hf_draft))
    batch = getattr(args, "batch_size", None) or 1
    built = [build(p, loaded, draft=draft, batch_size=batch) for p in plans]
    candidates = []
    for (label, _), b in zip(pairs, built, strict=True):
        cand = b.candidate(label)
        if cand is not None:
            candidates.append(cand)
    for n in ENGINE_FLAGS:
        setattr(args, n, getattr(ecfg, n))
    return Setup(loaded, built[0].engine, candidates, peers, built)
