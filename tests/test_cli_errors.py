"""Bad input a new user tries: each a one-line error with exit 2, before any work, nothing lost.

Rows that must fail before the model loads pass a model path that does not exist: the error they
report must be theirs, not the model's. Output paths go through one check
(:func:`specpilot.outpaths.check_output_path`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from specpilot.cli import main
from specpilot.drafters.trained import is_drafter_dir
from specpilot.loading import load_model
from specpilot.outpaths import check_output_path
from specpilot.training.distill import TrainConfig, train_drafter

from .test_loading import make_model, save_dir, write_gguf

NO_MODEL = "/nonexistent/model-dir"


@pytest.fixture(scope="module")
def w(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Files the rows point at: a tiny model, prompts, plans, a binary, a truncated GGUF."""
    root = tmp_path_factory.mktemp("errors")
    model = make_model("llama-tied", seed=2)
    files = {"root": root, "model": save_dir(root / "tiny", model)}
    prompts = root / "p.jsonl"
    lines = [
        {"id": f"p{i}", "prompt": f"def f{i}(x): return x + {i}", "chat": False} for i in range(6)
    ]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    files["prompts"] = prompts
    (root / "adir").mkdir()
    (root / "afile").write_text("keep me\n")
    user = root / "user_dir"
    user.mkdir()
    (user / "notes.txt").write_text("my notes\n")
    files["user_dir"] = user
    for name, plan in {
        "k_five": {"tree": {"kind": "chain", "k": "five"}},
        "threads": {"engine": {"threads": -4}},
        "bogus": {"drafter": "bogus"},
    }.items():
        (root / f"{name}.json").write_text(json.dumps(plan))
    (root / "binary.bin").write_bytes(bytes(range(256)) * 8)
    g = root / "full.gguf"
    write_gguf(g, model)
    data = g.read_bytes()
    (root / "cut.gguf").write_bytes(data[: len(data) * 3 // 5])
    return files


def _bench(w: dict[str, Path], *extra: str) -> list[str]:
    return ["bench", "--model", NO_MODEL, "--prompts", str(w["prompts"]), *extra]


def _profile(w: dict[str, Path], *extra: str) -> list[str]:
    return ["profile", "--model", NO_MODEL, "--prompts", str(w["prompts"]), *extra]


def _optimize(*extra: str) -> list[str]:
    return ["optimize", "--model", NO_MODEL, *extra]


def _train(w: dict[str, Path], *extra: str, model: str = NO_MODEL) -> list[str]:
    return ["train-drafter", "--target", model, *extra]


def _memory(w: dict[str, Path], action: str, target: str, db: str) -> list[str]:
    return ["memory", action, str(w["root"] / target), "--memory", str(w["root"] / db)]


Row = Callable[[dict[str, Path]], list[str]]
ROWS: dict[str, tuple[Row, str]] = {
    "bench --json DIR": (lambda w: _bench(w, "--json", str(w["root"] / "adir")), "is a directory"),
    "bench --json FILE/sub": (
        lambda w: _bench(w, "--json", str(w["root"] / "afile" / "x.json")),
        "is a file, not a directory",
    ),
    "bench --json missing/dir": (
        lambda w: _bench(w, "--json", str(w["root"] / "nope" / "x.json")),
        "does not exist",
    ),
    "profile --json DIR": (
        lambda w: _profile(w, "--json", str(w["root"] / "adir")),
        "is a directory",
    ),
    "profile --html /proc/x": (lambda w: _profile(w, "--html", "/proc/x.html"), "cannot write"),
    "optimize --out /proc/x": (lambda w: _optimize("--out", "/proc/x"), "cannot write"),
    "optimize --out FILE/sub": (
        lambda w: _optimize("--out", str(w["root"] / "afile" / "sub")),
        "is a file, not a directory",
    ),
    "optimize --out FILE": (lambda w: _optimize("--out", str(w["root"] / "afile")), "is a file"),
    "optimize --memory-limit-gb -1": (
        lambda w: _optimize("--memory-limit-gb", "-1"),
        "--memory-limit-gb must be >= 0",
    ),
    "train-drafter --out USER_DIR": (
        lambda w: _train(w, "--out", str(w["user_dir"])),
        "not a drafter directory",
    ),
    "train-drafter --out FILE": (
        lambda w: _train(w, "--out", str(w["root"] / "afile")),
        "--overwrite",
    ),
    "train-drafter --out FILE/sub": (
        lambda w: _train(w, "--out", str(w["root"] / "afile" / "d")),
        "is a file, not a directory",
    ),
    "train-drafter --resume nothing": (
        lambda w: _train(w, "--out", str(w["root"] / "fresh"), "--resume"),
        "nothing to resume",
    ),
    "train-drafter --minutes 0": (
        lambda w: _train(w, "--out", str(w["root"] / "fresh"), "--minutes", "0"),
        "--minutes must be > 0",
    ),
    "train-drafter --taps 2,999": (
        lambda w: _train(
            w, "--out", str(w["root"] / "fresh"), "--taps", "2,999", model=str(w["model"])
        ),
        "the target has 2 layers",
    ),
    "memory export DIR": (
        lambda w: _memory(w, "export", "adir", "m.sqlite"),
        "no memory database",
    ),
    "memory import BINARY": (
        lambda w: _memory(w, "import", "binary.bin", "new.sqlite"),
        "not a text file",
    ),
    "memory import not-an-export": (
        lambda w: _memory(w, "import", "k_five.json", "new.sqlite"),
        "not a specpilot memory export",
    ),
    "generate --stop ''": (
        lambda w: ["generate", "--model", NO_MODEL, "--prompt", "x", "--stop", ""],
        "--stop needs a non-empty string",
    ),
    "plan tree.k five": (
        lambda w: _bench(w, "--plan", str(w["root"] / "k_five.json")),
        "'k' must be an integer, got 'five'",
    ),
    "plan threads -4": (
        lambda w: _bench(w, "--plan", str(w["root"] / "threads.json")),
        "engine: 'threads' must be positive, got -4",
    ),
    "export plan drafter bogus": (
        lambda w: ["export", "--plan", str(w["root"] / "bogus.json"), "--to", "vllm"],
        "plan drafter 'bogus' is neither",
    ),
    "serve --max-batch 0": (
        lambda w: ["serve", "--model", NO_MODEL, "--max-batch", "0"],
        "--max-batch must be >= 1",
    ),
    "truncated GGUF": (
        lambda w: ["generate", "--model", str(w["root"] / "cut.gguf"), "--prompt", "x"],
        "is truncated or corrupt: tensor ",
    ),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_bad_input_is_one_line_exit_2(
    row: str, w: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    build, expected = ROWS[row]
    before = {p.relative_to(w["root"]): p.stat().st_size for p in w["root"].rglob("*")}
    rc = main(build(w))
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.startswith("specpilot: error: ") and "\n" not in err, err
    assert expected in err, err
    if row == "memory export DIR":  # with a database, the directory itself is the error
        db = w["root"] / "m.sqlite"
        from specpilot.pilot.memory import Memory

        Memory(db).close()
        assert main(build(w)) == 2
        assert "is a directory" in capsys.readouterr().err
        for p in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
            p.unlink(missing_ok=True)
        return
    after = {p.relative_to(w["root"]): p.stat().st_size for p in w["root"].rglob("*")}
    assert after == before  # nothing created (no empty database, no run directory), nothing lost


def test_output_path_check_cases(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    assert check_output_path(tmp_path / "new.json", "--json") == tmp_path / "new.json"
    assert check_output_path(tmp_path / "f", "--json") == tmp_path / "f"  # a file is replaced
    assert check_output_path(tmp_path / "a" / "b", "--out", kind="dir") == tmp_path / "a" / "b"
    from specpilot.errors import ConfigError

    with pytest.raises(ConfigError, match="exists; choose another path or pass --overwrite"):
        check_output_path(tmp_path / "f", "--json", overwrite=False)
    with pytest.raises(ConfigError, match=r"is a file; choose another path$"):
        check_output_path(tmp_path / "f", "--out", kind="dir", overwrite=None)
    if os.geteuid() != 0:  # root writes anywhere; the probe still refuses /proc
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(ConfigError, match="cannot write"):
            check_output_path(ro / "x.json", "--json")
        ro.chmod(0o700)
    assert not [p for p in tmp_path.rglob(".specpilot-probe-*")]


def _tiny_cfg(prompts: Path, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(
        sources=(str(prompts),), minutes=5, gen_minutes=5, max_new_tokens=8, gen_batch=8,
        seq_len=16, batch=2, unroll=2, eval_prompts=1, eval_tokens=4, eval_budget=4,
        draft_vocab=0, text_tokens=0, max_steps=2, checkpoint_s=0.0,
    )  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def test_overwrite_keeps_the_old_directory_until_the_new_one_is_complete(
    w: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes\n")
    lm = load_model(str(w["model"]))

    def interrupt(phase: str, *a: Any) -> None:
        if phase == "evaluate":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # killed half-way: the user's directory is intact
        train_drafter(lm, _tiny_cfg(w["prompts"]), out, overwrite=True, progress=interrupt)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    res = train_drafter(lm, _tiny_cfg(w["prompts"]), out, overwrite=True)
    assert is_drafter_dir(out) and not (out / "notes.txt").exists()
    assert res.moved_aside is not None and res.moved_aside.parent == tmp_path
    assert (res.moved_aside / "notes.txt").read_text() == "my notes\n"
    again = train_drafter(lm, _tiny_cfg(w["prompts"]), out)  # a drafter directory is replaced
    assert again.moved_aside is None and is_drafter_dir(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".mine.work", "mine", res.moved_aside.name]
    )


def test_overwrite_of_a_file_through_the_cli(
    w: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.bin"
    out.write_text("precious\n")
    argv = ["train-drafter", "--target", str(w["model"]), "--out", str(out), "--data"]
    argv += [str(w["prompts"]), "--max-new-tokens", "8", "--seq-len", "16", "--batch", "2"]
    argv += ["--eval-prompts", "1", "--eval-tokens", "4", "--eval-budget", "4", "--text-tokens"]
    argv += ["0", "--draft-vocab", "0", "--minutes", "0.002", "--unroll", "2"]
    assert main(argv) == 2 and out.read_text() == "precious\n"
    capsys.readouterr()
    assert main([*argv, "--overwrite"]) == 0
    text = capsys.readouterr().err
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("model.bin.old-")]
    assert is_drafter_dir(out) and f"was moved to {aside}" in text
    assert aside.read_text() == "precious\n"
