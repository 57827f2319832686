"""Shared helpers for the pilot tests: a tiny model saved as a Hugging Face directory (so trial
subprocesses load it by path), prompts, trusted references and trial jobs."""

from __future__ import annotations

import random
from pathlib import Path

from specpilot.forcing import Reference
from specpilot.loading import load_model
from specpilot.pilot.reference import ar_decoder
from specpilot.pilot.trial import ChildSpec, PromptCase, TrialJob, TrialLimits
from specpilot.plan import Plan

from .test_loading import make_model, save_dir

REPO = str(Path(__file__).resolve().parents[1])
MODULES = ("tests.pilot_planted",)
MAX_NEW = 24


def tiny_model_dir(path: Path, seed: int = 0) -> Path:
    return save_dir(path, make_model("llama-tied", seed=seed))


def prompts(n: int, seed: int = 0, prefix: str = "p") -> list[tuple[str, list[int]]]:
    """Prompts with repeated n-grams (so lookup-style drafters accept something)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        motif = [rng.randrange(3, 250) for _ in range(6)]
        ids = [rng.randrange(3, 250) for _ in range(4)] + motif * 3 + motif[:2]
        out.append((f"{prefix}{i}", ids))
    return out


def references(model_dir: Path, ps: list[tuple[str, list[int]]]) -> dict[str, Reference]:
    loaded = load_model(str(model_dir))
    dec = ar_decoder(loaded, "cpu", MAX_NEW, False)
    out = {}
    for pid, ids in ps:
        toks, margins = dec(ids)
        out[pid] = Reference(pid, tuple(toks), tuple(margins))
    return out


def cases(ps: list[tuple[str, list[int]]], refs: dict[str, Reference]) -> tuple[PromptCase, ...]:
    return tuple(PromptCase(pid, tuple(ids), refs[pid]) for pid, ids in ps)


def job(
    key: str,
    model_dir: Path,
    steps: tuple = (),
    forcing: tuple[PromptCase, ...] = (),
    timed: tuple[tuple[PromptCase, ...], ...] = (),
    limits: TrialLimits | None = None,
    work_dir: str = "",
    plan: Plan | None = None,
) -> TrialJob:
    plan_json = (plan or Plan()).to_json()
    cand = ChildSpec(str(model_dir), plan_json, steps, MODULES, (REPO,))
    base = ChildSpec(str(model_dir), plan_json, (), MODULES, (REPO,)) if timed else None
    return TrialJob(
        key,
        cand,
        base,
        forcing,
        timed,
        MAX_NEW,
        stop_on_eos=False,
        limits=limits or TrialLimits(threads=1, memory_bytes=6 << 30),
        work_dir=work_dir,
        warmup=tuple(forcing[0].ids[:8]) if forcing else (),
    )
