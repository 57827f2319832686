"""Mechanism ``compile_forward`` (kernel): torch.compile (Inductor) of the target's forward.

Fuses the ~1,000 small ops of a decode step (norms, RoPE, SiLU x up, residual adds) into
generated kernels, the "compiled elementwise fusion" BENCHMARKS.md points at. ``scope="layers"``
compiles the decoder block once and reuses the code for every layer (short compile);
``"forward"`` compiles the whole forward. ``dynamic=True`` compiles shape-generic code (no
recompiles as the verify width and key length change). Prepacked oneDNN linears are opaque to
Inductor: they run eagerly between compiled regions. Inductor on CPU needs a C compiler; on GPU,
Triton. Compilation changes kernels, so losslessness is left to token forcing. Not applicable
to native GGUF weights (:data:`NATIVE`; measured on Gemma 3: scope "layers" 0.81x, scope
"forward" with dynamic shapes failed to trace).
Runtime: :meth:`CompileForward.configure`, options ``{"scope": ..., "dynamic": ...}``.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from specpilot.errors import ConfigError
from specpilot.mechanisms.base import (
    Context,
    Param,
    RuntimeSetup,
    parse_dataclass,
    require,
    with_option,
)
from specpilot.plan import Plan

SCOPES = ("layers", "forward")


@dataclass(frozen=True)
class CompileOptions:
    scope: str = "layers"
    dynamic: bool = True

    def __post_init__(self) -> None:
        w = "plan options: compile_forward"
        require(self.scope in SCOPES, w, f"scope must be one of {SCOPES}")
        require(isinstance(self.dynamic, bool), w, "dynamic must be true or false")


def compiler_missing(on_gpu: bool) -> str | None:
    """Why Inductor cannot generate code here, or None."""
    if not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    if on_gpu:
        return None if importlib.util.find_spec("triton") else "Inductor on GPU needs triton"
    if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang", "g++")):
        return "Inductor on CPU needs a C compiler (cc/gcc/clang) on PATH"
    return None


NATIVE = (
    "the target runs native GGUF kernels: its step is a flat sequence of custom ops (block "
    "matmuls, fused row ops, fixed attention) that Inductor cannot fuse, and the lean forward "
    "never calls the decoder blocks scope=layers would compile"
)


def compile_model(model: Any, opts: CompileOptions) -> None:
    """Compile ``model``'s forwards (:meth:`specpilot.model.Transformer.compile_forward`);
    ConfigError on a native-weights model (:data:`NATIVE`)."""
    if getattr(model, "native", False):
        raise ConfigError(f"compile_forward: {NATIVE}; load it with --weights fp32 to compile")
    key = (opts.scope, opts.dynamic)
    if model.compiled not in (None, key):
        raise ConfigError(
            f"the model was compiled with {model.compiled} earlier in this process; load it again"
        )
    reason = compiler_missing(model.device.type == "cuda")
    if reason:
        raise ConfigError(f"compile_forward: {reason}")
    model.compile_forward(opts.scope, opts.dynamic)


class CompileForward:
    id = "compile_forward"
    factor = "kernel"
    description = "torch.compile (Inductor) of the decoder blocks or the whole forward"

    @staticmethod
    def parse_options(raw: Any) -> CompileOptions:
        return parse_dataclass(CompileOptions, raw, "plan options: compile_forward")

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        return (
            Param("scope", "categorical", "layers", choices=SCOPES),
            Param("dynamic", "bool", True),
        )

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        if ctx.native:
            return NATIVE
        return compiler_missing(ctx.on_gpu)

    def configure(self, setup: RuntimeSetup, options: CompileOptions) -> None:
        compile_model(setup.target, options)

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        value = {"scope": str(params["scope"]), "dynamic": bool(params["dynamic"])}
        return with_option(plan, self.id, value)
