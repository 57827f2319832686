"""Held-out evaluation of a trained drafter: tau through the engine with a dynamic tree."""

from __future__ import annotations

from typing import Any

from specpilot.drafters.feature_net import FeatureNet


def evaluate(loaded: Any, net: FeatureNet, prompts: list[list[int]], cfg: Any) -> dict[str, float]:
    """Held-out tau of ``net`` through the engine: dynamic tree of ``eval_budget`` nodes."""
    from specpilot.drafters.block import BlockDrafter
    from specpilot.drafters.head import HeadDrafter
    from specpilot.engine import Engine, EngineConfig, GenerationConfig
    from specpilot.tree import TreeSpec

    if not prompts:
        return {"tau": float("nan"), "prompts": 0}
    copy = FeatureNet(net.cfg).to(device=loaded.model.device, dtype=loaded.model.dtype)
    copy.load_state_dict(net.state_dict())
    copy.attach(loaded.model.model.embed_tokens.weight, loaded.model.head_weight())
    cls = HeadDrafter if net.cfg.kind == "head" else BlockDrafter
    drafter = cls(copy)
    engine = Engine(loaded.model, EngineConfig())
    spec = TreeSpec(kind="dynamic", budget=cfg.eval_budget, topk=8, depth=8)
    gen = GenerationConfig(max_new_tokens=cfg.eval_tokens)
    acc, steps, toks = 0, 0, 0
    for ids in prompts:
        res = engine.generate(
            ids, gen, drafter=drafter, spec=spec, eos_ids=loaded.tokenizer.eos_ids
        )
        acc += sum(res.accept_lengths)
        steps += res.steps
        toks += len(res.tokens)
    return {
        "tau": (acc + steps) / max(steps, 1),
        "prompts": len(prompts),
        "tokens": toks,
        "budget": cfg.eval_budget,
    }
