"""Export a plan as the equivalent speculative-decoding configuration of vLLM or SGLang.

Pure functions: :func:`export_plan` returns an :class:`Export` (the flags, the structured config,
which parts are approximate, and what does not translate); ``specpilot export`` prints it.

Mapping (field notes in ../shared/REFERENCES.md; engine docs as of late 2025):

* vLLM ``--speculative-config`` JSON: ``method`` ngram (prompt lookup: ``prompt_lookup_min`` /
  ``prompt_lookup_max``), suffix (SuffixDecoding integration: ``suffix_decoding_max_tree_depth``),
  draft_model (``model``), eagle (``model``, ``speculative_token_tree`` as a list of rank-path
  tuples, the same notation as our static trees); ``num_speculative_tokens`` = draft depth.
  ``--enforce-eager`` turns CUDA graphs off.
* SGLang: ``--speculative-algorithm`` NGRAM / STANDALONE (draft model) / EAGLE,
  ``--speculative-num-steps`` (depth), ``--speculative-eagle-topk`` (branching),
  ``--speculative-num-draft-tokens`` (verified tokens per step, root included),
  ``--speculative-draft-model-path``; ``--disable-cuda-graph``, ``--enable-torch-compile``.

Neither engine has our CPU batch-invariant kernels (fp64 attention, prepacked oneDNN), drafter
wrappers (hybrid fallback, confidence truncation), or best-first dynamic trees for n-gram
drafters; those are listed as not translating rather than silently dropped.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from specpilot.errors import ConfigError
from specpilot.plan import Plan

TARGETS = ("vllm", "sglang")


@dataclass(frozen=True)
class Export:
    target: str
    flags: tuple[str, ...]
    """Command-line flags for the engine's server, in order (unquoted)."""
    config: dict[str, Any] = field(default_factory=dict)
    """vLLM: the ``--speculative-config`` object; SGLang: flag name -> value."""
    approximate: tuple[str, ...] = ()
    """Flags whose meaning is close to, not the same as, the plan's."""
    untranslated: tuple[str, ...] = ()
    """Parts of the plan with no equivalent."""

    def command(self, model: str = "MODEL") -> str:
        head = ["vllm", "serve", model] if self.target == "vllm" else [
            "python", "-m", "sglang.launch_server", "--model-path", model
        ]  # fmt: skip
        return " ".join(shlex.quote(x) for x in (*head, *self.flags))

    def render(self, model: str = "MODEL") -> str:
        lines = [f"# {self.target}: equivalent speculative decoding configuration", ""]
        lines.append(self.command(model))
        if self.approximate:
            lines += ["", "approximate:"] + [f"  - {a}" for a in self.approximate]
        if self.untranslated:
            lines += ["", "does not translate:"] + [f"  - {u}" for u in self.untranslated]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "flags": list(self.flags),
            "config": self.config,
            "approximate": list(self.approximate),
            "untranslated": list(self.untranslated),
        }


def _depth(plan: Plan) -> int:
    return plan.tree.max_depth


def _common_untranslated(plan: Plan) -> list[str]:
    e = plan.engine
    out = []
    if e.resolved_attention == "exact":
        out.append("attention=exact (fp64, batch-invariant attention): engines use native kernels")
    if e.resolved_attention == "fixed":
        out.append("attention=fixed (batch-invariant fp32 kernel): engines use native kernels")
    if e.device == "cpu" and e.linear == "onednn":
        out.append("linear=onednn (prepacked batch-invariant CPU GEMMs)")
    if e.threads is not None:
        out.append(f"threads={e.threads} (set OMP/engine CPU thread binding by hand)")
    if e.static_buffers or e.device_accept:
        out.append("static_buffers / device_accept (engines have their own verify buffers)")
    notes = {
        "hybrid_drafting": "hybrid drafting (fallback drafter when the first proposes nothing)",
        "adaptive_draft": "adaptive draft length by confidence threshold",
        "batch_budget": "node budget per batch size (both engines pick K themselves)",
        "draft_vocab": "reduced draft vocabulary (FR-Spec) on a plain draft model",
    }
    out += [text for key, text in notes.items() if key in plan.options]
    return out


def export_plan(plan: Plan, to: str, draft_model: str | None = None) -> Export:
    """The plan as ``to`` ("vllm" or "sglang") would run it. ``draft_model``: the draft model's
    path or hub id, for plans drafting with a draft model."""
    if to not in TARGETS:
        raise ConfigError(f"--to must be one of {', '.join(TARGETS)}, got {to!r}")
    return _vllm(plan, draft_model) if to == "vllm" else _sglang(plan, draft_model)


def _vllm(plan: Plan, draft_model: str | None) -> Export:
    t, o = plan.tree, plan.drafter_options
    approx: list[str] = []
    untrans = _common_untranslated(plan)
    flags: list[str] = []
    cfg: dict[str, Any] = {}
    if plan.drafter != "none":
        cfg["num_speculative_tokens"] = _depth(plan)
        if plan.drafter == "lookup":
            cfg["method"] = "ngram"
            cfg["prompt_lookup_min"] = int(o.get("min_n", 1))
            cfg["prompt_lookup_max"] = int(o.get("max_n", 4))
        elif plan.drafter == "suffix":
            cfg["method"] = "suffix"
            cfg["suffix_decoding_max_tree_depth"] = int(o.get("max_pattern", 32)) + int(
                o.get("max_depth", 16)
            )
            approx.append(
                "method=suffix: vLLM's SuffixDecoding scores and caches differently "
                "(max_corpus_tokens has no direct equivalent)"
            )
        elif plan.drafter == "model":
            cfg["method"] = "draft_model"
            cfg["model"] = draft_model or "DRAFT_MODEL"
        else:
            cfg["method"] = "eagle"
            cfg["model"] = plan.drafter
            approx.append(
                "method=eagle for a specpilot trained drafter: convert its weights to an "
                "EAGLE checkpoint first"
            )
        if t.kind == "static" and cfg["method"] == "eagle":
            cfg["speculative_token_tree"] = str([tuple(p) for p in t.paths])
        elif t.kind != "chain":
            untrans.append(
                f"{t.kind} tree ({t.max_nodes} nodes): vLLM verifies a chain for method "
                f"{cfg['method']}; exported as a chain of depth {t.max_depth}"
            )
            approx.append("num_speculative_tokens = the tree's depth")
        flags += ["--speculative-config", json.dumps(cfg, sort_keys=True)]
    if plan.engine.dtype != "float32" or plan.engine.device == "cpu":
        flags += ["--dtype", plan.engine.dtype]
    if plan.engine.device.startswith("cuda") and not plan.engine.cuda_graphs:
        approx.append("CUDA graphs are on by default in vLLM; --enforce-eager turns them off")
    if "compile_forward" in plan.options:
        approx.append("torch.compile: vLLM compiles by default (compilation config)")
    return Export("vllm", tuple(flags), cfg, tuple(approx), tuple(untrans))


def _sglang(plan: Plan, draft_model: str | None) -> Export:
    t, o = plan.tree, plan.drafter_options
    approx: list[str] = []
    untrans = _common_untranslated(plan)
    cfg: dict[str, Any] = {}
    if plan.drafter != "none":
        if t.kind == "chain":
            steps, topk, tokens = t.k, 1, t.k + 1
        elif t.kind == "dynamic":
            steps, topk, tokens = t.depth, t.topk, t.budget + 1
        else:
            steps, topk, tokens = t.max_depth, t.branching, t.max_nodes + 1
            approx.append(
                "static tree -> SGLang's top-k tree of the same depth, branching and node "
                "count (it picks the nodes by score, not by our fixed rank paths)"
            )
        if plan.drafter in ("lookup", "suffix"):
            cfg["--speculative-algorithm"] = "NGRAM"
            cfg["--speculative-num-draft-tokens"] = tokens
            cfg["--speculative-ngram-min-match-window-size"] = int(o.get("min_n", 1))
            cfg["--speculative-ngram-max-match-window-size"] = int(o.get("max_n", 4))
            approx.append(
                "NGRAM: SGLang's n-gram drafter matches against a shared trie of requests; "
                "window sizes stand for our n-gram sizes"
            )
            if plan.drafter == "suffix":
                untrans.append("suffix drafter (exported as SGLang's nearest, NGRAM)")
        else:
            is_model = plan.drafter == "model"
            cfg["--speculative-algorithm"] = "STANDALONE" if is_model else "EAGLE"
            cfg["--speculative-draft-model-path"] = (
                (draft_model or "DRAFT_MODEL") if is_model else plan.drafter
            )
            cfg["--speculative-num-steps"] = steps
            cfg["--speculative-eagle-topk"] = topk
            cfg["--speculative-num-draft-tokens"] = tokens
            if not is_model:
                approx.append("EAGLE for a specpilot trained drafter: convert its weights first")
        approx.append("--speculative-num-draft-tokens counts the root token (nodes + 1)")
    if plan.engine.dtype != "float32" or plan.engine.device == "cpu":
        cfg["--dtype"] = plan.engine.dtype
    if plan.engine.device.startswith("cuda") and not plan.engine.cuda_graphs:
        cfg["--disable-cuda-graph"] = True
    if "compile_forward" in plan.options:
        cfg["--enable-torch-compile"] = True
    flags: list[str] = []
    for k, v in cfg.items():
        flags += [k] if v is True else [k, str(v)]
    return Export("sglang", tuple(flags), cfg, tuple(approx), tuple(untrans))
