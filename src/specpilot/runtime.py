"""Plan runtime: turn a :class:`~specpilot.plan.Plan` into a running engine and drafter factory.

:func:`build` honours every field of a plan: the engine configuration (device, dtype, attention,
linear backend, threads, the verify-step switches of :mod:`specpilot.fastverify`), the drafter and
its options, the tree shape, and the runtime ``options`` of mechanisms (keyed by mechanism id).
Each option is parsed by its mechanism (``parse_options``) so a bad or unknown entry fails with a
:class:`ConfigError` before anything runs, then applied by the mechanism's ``configure`` hook
(:class:`specpilot.mechanisms.base.RuntimeMechanism`): drafter wrappers, the batch-size budget
table, torch.compile, a reduced draft vocabulary, all the same way. :func:`context_of` describes
where a plan runs (what mechanism applicability and memory similarity read); :func:`default_plan`
is what ``bench`` runs with no flags.

Model state. Building changes the loaded model through its public methods (oneDNN prepacking is
one-way; ``compile_forward`` replaces forwards; ``set_head_rows`` cuts the draft model's LM
head), so one process serves plans that agree on those; trials of the pilot loop each run in
their own subprocess.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from specpilot.drafters.base import Drafter
from specpilot.engine import Engine, EngineConfig
from specpilot.errors import ConfigError, DrafterError
from specpilot.machine import cpu_model, isa_level
from specpilot.mechanisms.base import Context, RuntimeMechanism, RuntimeSetup
from specpilot.plan import Plan
from specpilot.tree import TreeSpec
from specpilot.verify import check_fixed_spec

DEFAULT_DRAFTER = "suffix"
DEFAULT_TREE = TreeSpec(kind="chain", k=5)
HEAD_TREE = TreeSpec(kind="dynamic", budget=10, topk=3, depth=8)
"""The default tree where a trained head ships (BENCHMARKS.md, "Trained drafters")."""
TRAINING_FREE = ("lookup", "suffix")


@dataclass(frozen=True)
class Built:
    """A plan, ready to decode: ``engine.generate(ids, gen, drafter=make_drafter(), spec=spec)``."""

    plan: Plan
    engine: Engine
    make_drafter: Callable[[], Drafter | None]
    """A fresh drafter (wrappers applied) per call; None for plain AR plans."""
    spec: TreeSpec
    """The plan's tree, capped by its batch-size budget table at the batch size built for."""
    batch_size: int = 1

    @property
    def name(self) -> str:
        return self.plan.describe()

    def candidate(self, label: str | None = None) -> Any:
        """This plan as a :class:`specpilot.bench.Candidate` named ``label`` (default: the plan's
        description); None for AR plans."""
        from specpilot.bench import Candidate

        if self.plan.drafter == "none":
            return None
        return Candidate(label or self.name, self.plan.drafter, self.make_drafter, self.spec)


def default_plan(loaded: Any) -> Plan:
    """What ``specpilot bench`` runs with no flags, on the loaded model's device and dtype: the
    shipped head with suffix drafting and a dynamic tree of 10 nodes where a trained head ships
    for the target (the fastest measured there), else suffix drafting with a chain of 5.

    On native GGUF weights (CPU) the tree is a cap and the goodput budget
    (:mod:`specpilot.goodput`) picks the nodes per step by expected tokens per measured second:
    there one verify row costs a large share of a step (BENCHMARKS.md, "native GEMM decodes each
    weight once"), so a fixed 10-node tree ran at 1.00x plain on HumanEval and 0.68x on chat,
    the goodput budget at 1.16x and 1.00x."""
    model = loaded.model
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    drafter, tree = default_drafting(loaded)
    engine = EngineConfig(
        device=str(model.device),
        dtype=dtype.get(model.dtype, "float32"),
        goodput=default_goodput(loaded),
    )
    return Plan(drafter=drafter, tree=tree, engine=lossless_gpu_engine(engine, [tree]))


def lossless_gpu_engine(ecfg: EngineConfig, trees: list[TreeSpec]) -> EngineConfig:
    """``ecfg`` with fixed-width steps captured in CUDA graphs where it runs on CUDA with no
    fixed width set and every tree is a chain (width: the longest chain + 1); else unchanged.

    Stock GPU kernels give a row other bits with other row counts and key lengths (on an H200,
    bf16 SmolLM2: speculation matched plain decoding on 7-10 of 20 prompts), so there only
    fixed-width steps keep speculation lossless by construction (:mod:`specpilot.fastverify`;
    BENCHMARKS.md, "Session of 2026-12-04: the first GPU run")."""
    chains = bool(trees) and all(t.kind == "chain" for t in trees)
    if not ecfg.device.startswith("cuda") or ecfg.fixed_width or not chains:
        return ecfg
    return replace(ecfg, fixed_width=max(t.k for t in trees) + 1, cuda_graphs=True)


def gpu_lossless_note(ecfg: EngineConfig, speculative: bool) -> str | None:
    """A notice when speculation runs on CUDA without fixed-width steps (see
    :func:`lossless_gpu_engine`), else None.

    >>> gpu_lossless_note(EngineConfig(), True) is None
    True
    """
    if not speculative or not ecfg.device.startswith("cuda") or ecfg.fixed_width:
        return None
    return ("speculation on CUDA without --fixed-width is not lossless by construction (stock "
            "GPU kernels change a row's bits with the rows in the call); token forcing decides. "
            "Use a chain tree with --fixed-width K+1")  # fmt: skip


def default_goodput(loaded: Any) -> bool:
    """Whether the goodput budget is on by default for ``loaded``: native GGUF weights on CPU
    (see :func:`default_plan`; ``--no-goodput`` turns it off)."""
    model = loaded.model
    return model.device.type == "cpu" and bool(getattr(model, "native", False))


def default_drafting(loaded: Any) -> tuple[str, TreeSpec]:
    """The default drafter and tree for ``loaded`` (see :func:`default_plan`). On CUDA suffix
    drafting with a chain of 5: fixed-width steps verify chains only, and the trained head drafts
    in eager small ops there (~87 ms a step on an H200 host against ~35 ms a plain token)."""
    device = getattr(getattr(loaded, "model", None), "device", None)
    if "head+suffix" in shipped_for(loaded) and getattr(device, "type", "cpu") != "cuda":
        return "head+suffix", HEAD_TREE
    return DEFAULT_DRAFTER, DEFAULT_TREE


def params_millions(cfg: Any) -> float:
    """Parameters of a Llama-family config in millions (tied embeddings counted once)."""
    d, hd = cfg.dim, cfg.head_dim
    attn = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2
    if cfg.qkv_bias:
        attn += (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
    layer = attn + 3 * d * cfg.intermediate_size + 2 * d + (2 * hd if cfg.qk_norm else 0)
    emb = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    return (emb + cfg.n_layers * layer + d) / 1e6


def drafter_kind(name: str) -> str:
    """Drafter kind for contexts: the registered name, or "trained" for a drafter directory."""
    from specpilot.drafters import DRAFTERS

    return name if name in DRAFTERS else "trained"


def context_of(
    loaded: Any, plan: Plan, batch_size: int = 1, *, drafters: tuple[str, ...] = ()
) -> Context:
    """Where ``plan`` runs for ``loaded`` at ``batch_size``. ``drafters``: extra drafters that can
    be built here besides lookup and suffix ("model" when a draft model is loaded, trained
    drafter directories). The host's CPU model and kernel ISA class are filled on GPU contexts
    too (the host runs the drafters and the loop)."""
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    dev = plan.engine.device
    if dev.startswith("cuda"):
        idx = int(dev.split(":")[1]) if ":" in dev else 0
        device, threads = torch.cuda.get_device_name(idx), 0
    else:
        device = "cpu"
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    return Context(
        arch=loaded.cfg.arch,
        params_m=round(params_millions(loaded.cfg), 6),
        drafter_kind=drafter_kind(plan.drafter),
        device=device,
        dtype=plan.engine.dtype,
        batch_size=batch_size,
        threads=threads,
        drafters=tuple(dict.fromkeys((*TRAINING_FREE, *shipped_for(loaded), *drafters))),
        vocab_size=int(loaded.cfg.vocab_size),
        cpu_model=_host()[0],
        isa=_host()[1],
        weights="native" if getattr(loaded.model, "native", False) else "fp32",
    )


@functools.cache
def _host() -> tuple[str, str]:
    """(CPU model name, kernel ISA class) of this host, read once per process."""
    return cpu_model(), isa_level()


def shipped_for(loaded: Any) -> tuple[str, ...]:
    """Trained drafters shipped for ``loaded`` ("head" and "head+suffix" when one ships)."""
    fingerprint = getattr(loaded, "fingerprint", None)
    return _shipped(fingerprint) if isinstance(fingerprint, str) else ()


@functools.cache
def _shipped(fingerprint: str) -> tuple[str, ...]:
    from specpilot.drafters.trained import shipped_drafter

    try:
        shipped_drafter(SimpleNamespace(fingerprint=fingerprint), "head")
    except DrafterError:
        return ()
    return ("head", "head+suffix")


def uses_draft_model(plan: Plan) -> bool:
    """Whether ``plan`` drafts with a draft model (as its drafter or its hybrid fallback)."""
    hybrid = plan_options(plan).get("hybrid_drafting")
    return plan.drafter == "model" or (hybrid is not None and hybrid.fallback == "model")


def plan_options(plan: Plan) -> dict[str, Any]:
    """``plan.options`` parsed by their mechanisms; ConfigError for an unknown mechanism id or a
    bad value. Ids in ``plan.mechanisms`` must be known too."""
    from specpilot.mechanisms import get

    for m in plan.mechanisms:
        get(m.id)
    out: dict[str, Any] = {}
    for key, raw in plan.options.items():
        mech = get(key)
        if not isinstance(mech, RuntimeMechanism):
            raise ConfigError(f"plan options: mechanism {key!r} keeps no runtime options")
        out[key] = mech.parse_options(raw)
    return out


def build(plan: Plan, loaded: Any, *, draft: Any = None, batch_size: int = 1) -> Built:
    """Build ``plan`` on ``loaded`` (a :class:`specpilot.loading.LoadedModel`).

    ``draft``: the loaded draft model when the plan (or its hybrid fallback) uses ``"model"``.
    ``batch_size`` picks the entry of the plan's budget table. Every runtime option is applied by
    its mechanism's ``configure`` hook (registry order). Fails fast (ConfigError /
    DrafterError) on anything the plan asks that cannot be honoured here.
    """
    from specpilot.mechanisms import get, runtime_order

    opts = plan_options(plan)
    ecfg = plan.engine
    _place(loaded.model, ecfg, "target")
    if plan.drafter == "model" and draft is None:
        raise ConfigError("the plan drafts with a draft model: give one (--draft-model PATH)")
    engine = Engine(loaded.model, ecfg)
    if draft is not None:
        _place(draft.model, ecfg, "draft")
        draft.model.prepack(ecfg.linear)
    setup = RuntimeSetup(
        plan=plan,
        target=loaded.model,
        draft=None if draft is None else draft.model,
        spec=plan.tree,
        batch_size=batch_size,
        base_drafter=lambda name, options: base_drafter(name, options, loaded, draft),
    )
    for key in runtime_order(opts):
        get(key).configure(setup, opts[key])
    make = _drafter_factory(plan, setup)
    make()  # fail fast on an incompatible drafter
    if ecfg.fixed_width and plan.drafter != "none":
        check_fixed_spec(setup.spec, ecfg.fixed_width)  # a tree plan under fixed widths
    return Built(plan, engine, make, setup.spec, batch_size)


def _place(model: Any, ecfg: EngineConfig, what: str) -> None:
    """Move/cast ``model`` to the plan's device and dtype (before any prepacking)."""
    dev, dtype = torch.device(ecfg.device), ecfg.torch_dtype
    if model.device == dev and model.dtype == dtype:
        if ecfg.linear == "torch" and model.prepacked:
            raise ConfigError(
                f"the {what} model was prepacked for oneDNN earlier in this process; "
                "load it again to run the plan's linear=torch"
            )
        return
    if model.prepacked:
        raise ConfigError(
            f"the {what} model was prepacked on {model.device} {model.dtype} in this process; "
            f"load it on {ecfg.device} {ecfg.dtype} to run this plan"
        )
    model.to(device=dev, dtype=dtype)
    if model.max_len:
        model.max_len = 0  # the cache and RoPE tables are reallocated on the new device


def _drafter_factory(plan: Plan, setup: RuntimeSetup) -> Callable[[], Drafter | None]:
    wrappers = tuple(setup.wrappers)

    def make() -> Drafter | None:
        d = setup.base_drafter(plan.drafter, plan.drafter_options)
        if d is None:
            return None
        for wrap in wrappers:
            d = wrap(d)
        return d

    return make


def check_plan_drafter(name: str) -> None:
    """ConfigError unless ``name`` is a registered drafter or a (DIR[+suffix]) directory."""
    from specpilot.drafters import DRAFTERS

    if name not in DRAFTERS and not Path(name.removesuffix("+suffix")).expanduser().is_dir():
        raise ConfigError(
            f"plan drafter {name!r} is neither one of {', '.join(DRAFTERS)} nor a drafter directory"
        )


def alternative_drafters(loaded: Any, drafter: str) -> dict[str, Callable[[], Drafter | None]]:
    """Factories of the drafters a context of ``loaded`` offers (:func:`context_of`: the
    training-free ones and the trained drafters shipped for it) other than ``drafter``, with
    their default options: what the cost model replays to compare a plan's drafter with
    (``profile(alternatives=...)``). One that fails to build here is left out."""
    out: dict[str, Callable[[], Drafter | None]] = {}
    for name in dict.fromkeys((*TRAINING_FREE, *shipped_for(loaded))):
        if name == drafter:
            continue
        make = functools.partial(base_drafter, name, {}, loaded)
        try:
            make()
        except (ConfigError, DrafterError):
            continue
        out[name] = make
    return out


def base_drafter(
    name: str, options: Mapping[str, Any], loaded: Any, draft: Any = None
) -> Drafter | None:
    """A registered drafter (:data:`specpilot.drafters.DRAFTERS`, "head" included) or a trained
    drafter directory, built for ``loaded`` by :func:`specpilot.drafters.make_drafter`."""
    from specpilot.drafters import make_drafter

    check_plan_drafter(name)
    return make_drafter(
        name, target=loaded, tokenizer=loaded.tokenizer, draft=draft, **dict(options)
    )
