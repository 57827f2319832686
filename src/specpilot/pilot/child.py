"""The trial subprocess: the only place where candidate (untrusted) mechanism code runs.

Started by :class:`specpilot.pilot.proc.ChildProcess` as ``python -m specpilot.pilot.child``.
Before anything else it caps its address space (``RLIMIT_AS``), then reads frames from the
parent (see :mod:`.proc` for framing):

  setup    {model, plan, steps, modules, weights, max_new_tokens, stop_on_eos, warmup}
           -> {op: "ready", plan} after loading the model, applying the mechanisms ``steps`` to
              ``plan`` (inside this process), building it and decoding ``warmup`` once
  generate {ids}            -> {op: "tokens", tokens, steps, accept}
  reset    {}               -> {op: "ok"}  (a fresh drafter)
  profile  {prompts, config, compare_drafters} -> {op: "report", report}  (the cost model on
              the built plan; with ``compare_drafters`` the context's other drafters are
              replayed too)
  describe {module, ctx, plan} -> {op: "described", mechanisms}  (id, factor, description,
              space, applicable of an agent-written module's ``MECHANISMS``; no setup needed)
  exit     {}               -> the process exits

With ``--sandbox SPEC`` the child applies :func:`specpilot.pilot.sandbox.apply` right after the
memory limit, before it imports torch or any mechanism module; if that fails it answers every
request with an error and runs nothing.

Any failure is answered with ``{op: "error", type, message}``. The child never times anything the
parent relies on: the parent measures wall time around each request itself, and compares every
returned token with its own reference.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import traceback
from typing import Any


def _limit_memory(n_bytes: int) -> None:
    if n_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (n_bytes, n_bytes))


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the parent dies (Linux ``PR_SET_PDEATHSIG``): a coordinator
    killed with -9 must not leave stopped trial processes behind."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass
    if parent and os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _error(e: BaseException, where: str) -> dict[str, Any]:
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    return {
        "op": "error",
        "where": where,
        "type": type(e).__name__,
        "message": str(e)[:2000],
        "traceback": "".join(tb)[-4000:],
    }


class _Server:
    def __init__(self) -> None:
        self.decoder: Any = None
        self.gen: Any = None
        self.loaded: Any = None
        self.plan: Any = None

    def setup(self, msg: dict[str, Any]) -> dict[str, Any]:
        from specpilot.engine import GenerationConfig
        from specpilot.loading import load_model
        from specpilot.pilot.decoder import build_decoder
        from specpilot.pilot.steps import all_mechanisms, apply_steps
        from specpilot.plan import Plan
        from specpilot.runtime import context_of

        plan = Plan.from_json(msg["plan"], where="trial plan")
        mechs = all_mechanisms(tuple(msg.get("modules", ())))
        weights = {"weights": msg["weights"]} if msg.get("weights") else {}
        loaded = load_model(
            msg["model"], device=plan.engine.device, dtype=plan.engine.torch_dtype, **weights
        )
        self.loaded = loaded
        steps = [(str(s[0]), dict(s[1])) for s in msg.get("steps", [])]
        plan = apply_steps(plan, steps, mechs, lambda p: context_of(loaded, p, 1))
        self.gen = GenerationConfig(
            max_new_tokens=int(msg["max_new_tokens"]), stop_on_eos=bool(msg["stop_on_eos"])
        )
        self.decoder = build_decoder(plan, loaded, mechs, tuple(loaded.tokenizer.eos_ids))
        self.plan = plan
        warm = msg.get("warmup")
        if warm:
            self.decoder.decode(
                [int(t) for t in warm],
                GenerationConfig(max_new_tokens=min(8, self.gen.max_new_tokens), stop_on_eos=False),
            )
            self.decoder.reset()
        return {"op": "ready", "plan": plan.to_json()}

    def generate(self, msg: dict[str, Any]) -> dict[str, Any]:
        res = self.decoder.decode([int(t) for t in msg["ids"]], self.gen)
        return {
            "op": "tokens",
            "tokens": [int(t) for t in res.tokens],
            "steps": int(getattr(res, "steps", 0)),
            "accept": [int(a) for a in getattr(res, "accept_lengths", [])],
        }

    def reset(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.decoder.reset()
        return {"op": "ok"}

    def describe(self, msg: dict[str, Any]) -> dict[str, Any]:
        import importlib
        from dataclasses import asdict

        from specpilot.mechanisms.base import Context
        from specpilot.plan import Plan

        ctx = Context(**{**msg["ctx"], "drafters": tuple(msg["ctx"].get("drafters", ()))})
        plan = Plan.from_json(msg["plan"], where="describe plan")
        importlib.invalidate_caches()  # the module may have been written after this child started
        mod = importlib.import_module(str(msg["module"]))
        out = []
        for m in getattr(mod, "MECHANISMS", ()):
            out.append({
                "id": str(m.id), "factor": str(m.factor), "description": str(m.description),
                "space": [asdict(p) for p in m.space(ctx, plan)],
                "applicable": m.applicable(ctx, plan),
                "wraps_decode": callable(getattr(m, "wrap_decode", None)),
            })  # fmt: skip
        return {"op": "described", "mechanisms": out}

    def profile(self, msg: dict[str, Any]) -> dict[str, Any]:
        from specpilot.costmodel import ProfileConfig, profile

        d = self.decoder
        prompts = [(str(p[0]), [int(t) for t in p[1]]) for p in msg["prompts"]]
        cfg = ProfileConfig(**msg.get("config", {}))
        eos = tuple(self.loaded.tokenizer.eos_ids)
        alts = self.alternatives() if msg.get("compare_drafters") else {}
        report = profile(
            d.engine, prompts, d.make_drafter, d.spec, cfg, eos_ids=eos, alternatives=alts
        )
        return {"op": "report", "report": report.to_json()}

    def alternatives(self) -> dict[str, Any]:
        """Factories of the other drafters this context can build without a draft model."""
        from specpilot.runtime import alternative_drafters

        return alternative_drafters(self.loaded, self.plan.drafter)


def _sandbox(arg: str) -> Exception | None:
    """Apply the sandbox; the error that refuses every request when it cannot be applied."""
    from specpilot.pilot.sandbox import SandboxError, SandboxSpec, apply

    try:
        apply(SandboxSpec.from_arg(arg), os.getcwd())
    except (SandboxError, ValueError, TypeError) as e:
        return SandboxError(f"sandbox not applied, nothing runs: {e}")
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specpilot.pilot.child")
    p.add_argument("--fd-in", type=int, required=True)
    p.add_argument("--fd-out", type=int, required=True)
    p.add_argument("--memory-bytes", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--parent-pid", type=int, default=0)
    p.add_argument("--sandbox", default="")
    args = p.parse_args(argv)
    _die_with_parent(args.parent_pid)
    _limit_memory(args.memory_bytes)
    refused = _sandbox(args.sandbox) if args.sandbox else None
    from specpilot.pilot.proc import read_frame_blocking, write_frame

    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    server = _Server()
    handlers = {
        "setup": server.setup,
        "generate": server.generate,
        "reset": server.reset,
        "profile": server.profile,
        "describe": server.describe,
    }
    while True:
        msg = read_frame_blocking(args.fd_in)
        if msg is None or msg.get("op") == "exit":
            return 0
        op = msg.get("op")
        handler = handlers.get(op)
        try:
            if refused is not None:
                raise refused
            if handler is None:
                raise ValueError(f"unknown op {op!r}")
            if op not in ("setup", "describe") and server.decoder is None:
                raise ValueError(f"{op} before setup")
            ans = handler(msg)
        except MemoryError as e:
            ans = {"op": "error", "where": op, "type": "MemoryError", "message": str(e)[:500]}
        except Exception as e:  # reported to the parent, which records a CRASH with the reason
            ans = _error(e, str(op))
        write_frame(args.fd_out, ans)
        sys.stdout.flush()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
