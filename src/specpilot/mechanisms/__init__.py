"""Mechanisms: candidate optimizations for the pilot loop, one file each behind the
:class:`~specpilot.mechanisms.base.Mechanism` protocol.

:func:`all_mechanisms` lists them (tau, kernel, overhead); :func:`get` finds one by id. Applying
one: :func:`specpilot.mechanisms.base.apply_checked` (applicability, params checked against the
space, provenance recorded); running the result: :func:`specpilot.runtime.build`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specpilot.errors import ConfigError
from specpilot.mechanisms.adaptive_draft import AdaptiveDraft
from specpilot.mechanisms.attention_impl import AttentionImpl
from specpilot.mechanisms.base import FACTORS, Context, Mechanism, Param, apply_checked
from specpilot.mechanisms.batch_budget import BatchBudgetTable
from specpilot.mechanisms.chain_length import ChainLength
from specpilot.mechanisms.compile_forward import CompileForward
from specpilot.mechanisms.cuda_graphs import CudaGraphs
from specpilot.mechanisms.device_accept import DeviceAccept
from specpilot.mechanisms.draft_vocab import DraftVocab
from specpilot.mechanisms.drafter_choice import DrafterChoice
from specpilot.mechanisms.dynamic_tree import DynamicTree
from specpilot.mechanisms.goodput_budget import GoodputBudget
from specpilot.mechanisms.gpu_dtype import GpuDtype
from specpilot.mechanisms.hybrid_drafting import HybridDrafting
from specpilot.mechanisms.kernel_prefetch import KernelPrefetch
from specpilot.mechanisms.kernel_tiling import KernelTiling
from specpilot.mechanisms.linear_backend import LinearBackend
from specpilot.mechanisms.lookup_ngram import LookupNgram
from specpilot.mechanisms.static_buffers import StaticBuffers
from specpilot.mechanisms.static_tree import StaticTree
from specpilot.mechanisms.suffix_options import SuffixOptions
from specpilot.mechanisms.threads import Threads
from specpilot.mechanisms.union_gate import UnionGate

__all__ = [
    "FACTORS",
    "Context",
    "Mechanism",
    "Param",
    "all_mechanisms",
    "apply_checked",
    "by_factor",
    "get",
    "register",
]

_CLASSES: tuple[type, ...] = (
    ChainLength,
    StaticTree,
    DynamicTree,
    DrafterChoice,
    LookupNgram,
    SuffixOptions,
    UnionGate,
    HybridDrafting,
    AdaptiveDraft,
    BatchBudgetTable,
    GoodputBudget,
    Threads,
    AttentionImpl,
    LinearBackend,
    KernelTiling,
    KernelPrefetch,
    CompileForward,
    GpuDtype,
    DraftVocab,
    StaticBuffers,
    DeviceAccept,
    CudaGraphs,
)
_REGISTRY: dict[str, Mechanism] = {c.id: c() for c in _CLASSES}


def all_mechanisms() -> list[Mechanism]:
    """Every registered mechanism, tau first, then kernel, then overhead."""
    return list(_REGISTRY.values())


def by_factor(factor: str) -> list[Mechanism]:
    if factor not in FACTORS:
        raise ConfigError(f"factor must be one of {FACTORS}, got {factor!r}")
    return [m for m in _REGISTRY.values() if m.factor == factor]


def runtime_order(options: Mapping[str, Any]) -> list[str]:
    """The ids of ``options`` in registry order: the order their ``configure`` hooks run
    (drafter wrappers nest in it: a hybrid fallback inside an adaptive cut)."""
    return [m for m in _REGISTRY if m in options]


def register(mech: Mechanism) -> None:
    """Add ``mech`` to this process's registry (an id already there is replaced): a mechanism
    from outside the package whose runtime option must reach :func:`specpilot.runtime.build`
    and its ``configure`` hook, e.g. a test's planted kernel variant in the trial child."""
    _REGISTRY[mech.id] = mech


def get(mech_id: str) -> Mechanism:
    """The mechanism ``mech_id``; ConfigError naming the known ids otherwise."""
    try:
        return _REGISTRY[mech_id]
    except KeyError:
        raise ConfigError(
            f"unknown mechanism {mech_id!r}; known: {', '.join(sorted(_REGISTRY))}"
        ) from None
