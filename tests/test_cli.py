"""CLI end to end on a tiny model directory: bench JSON contract, generate, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specpilot.cli import main

from .test_loading import make_model, save_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_dir(tmp_path_factory.mktemp("cli") / "tiny", make_model("llama-tied", seed=2))


def _prompts(tmp: Path, lines: list[str]) -> Path:
    p = tmp / "prompts.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


GOOD = [
    json.dumps({"id": "a", "prompt": "def f(x): return x + x + x", "chat": False}),
    json.dumps({"id": "b", "prompt": "hello hello hello world", "chat": False}),
]


@pytest.mark.parametrize("drafter", ["lookup", "suffix"])
def test_bench_json_contract(
    model_dir: Path, tmp_path: Path, drafter: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    passive = drafter == "suffix"  # one run with passive OpenMP waits: noted and recorded
    if passive:
        monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    else:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    out = tmp_path / "bench.json"
    rc = main(
        [
            "bench",
            "--model",
            str(model_dir),
            "--prompts",
            str(_prompts(tmp_path, GOOD)),
            "--max-new-tokens",
            "24",
            "--drafter",
            drafter,
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    d = json.loads(out.read_text())
    for key in ("ar_tok_s", "spec_tok_s", "speedup", "tau", "lossless", "mismatches", "peers"):
        assert key in d
    assert d["lossless"] is True and d["mismatches"] == 0
    assert d["ar_tok_s"] > 0 and d["spec_tok_s"] > 0 and d["tau"] >= 1.0
    assert d["n_prompts"] == 2
    assert d["omp_wait_policy"] == ("PASSIVE" if passive else None)
    assert ("OMP_WAIT_POLICY=PASSIVE is set" in capsys.readouterr().err) == passive


def test_bench_pairs_each_round_with_its_own_ar_round(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    args = ["bench", "--model", str(model_dir), "--prompts", str(_prompts(tmp_path, GOOD))]
    rc = main([*args, "--max-new-tokens", "16", "--drafter", "suffix", "--repeats", "3",
               "--json", str(out)])  # fmt: skip
    assert rc == 0
    d = json.loads(out.read_text())
    c, ar = d["candidates"][0], d["rounds_ar_tok_s"]
    assert len(c["rounds_speedup"]) == len(ar) == 3
    for r, s, a in zip(c["rounds_speedup"], c["rounds_tok_s"], ar, strict=True):
        assert r == pytest.approx(s / a)
    assert c["paired_speedup"] == pytest.approx(sorted(c["rounds_speedup"])[1])
    assert "round by round" in capsys.readouterr().err


def test_generate_streams_text(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "generate",
            "--model",
            str(model_dir),
            "--prompt",
            "hello world",
            "--no-chat",
            "--max-new-tokens",
            "12",
            "--drafter",
            "lookup",
        ]
    )
    assert rc == 0
    err = capsys.readouterr().err
    assert "tau" in err and "tokens" in err


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc != 0
    assert "Traceback" not in err
    lines = [x for x in err.strip().splitlines() if x]
    assert len(lines) == 1 and lines[0].startswith("specpilot: error:"), err
    return lines[0]


def test_missing_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    msg = _error(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"], capsys)
    assert "not found" in msg


def test_corrupt_safetensors(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in model_dir.iterdir():
        data = f.read_bytes()
        (bad / f.name).write_bytes(data[: len(data) // 3] if f.suffix == ".safetensors" else data)
    msg = _error(["generate", "--model", str(bad), "--prompt", "x"], capsys)
    assert "safetensors" in msg


def test_corrupt_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF" + b"\x00garbage" * 10)
    msg = _error(["generate", "--model", str(g), "--prompt", "x"], capsys)
    assert "m.gguf" in msg


def test_unknown_architecture(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    odd = _copy(model_dir, tmp_path / "odd")
    cfg = json.loads((odd / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (odd / "config.json").write_text(json.dumps(cfg))
    msg = _error(["generate", "--model", str(odd), "--prompt", "x"], capsys)
    assert "mamba" in msg and "supported" in msg


def test_draft_tokenizer_differs(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = _copy(model_dir, tmp_path / "draft")
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = sorted(vocab)[5:7]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tj))
    msg = _error(
        [
            "generate",
            "--model",
            str(model_dir),
            "--prompt",
            "x",
            "--drafter",
            "model",
            "--draft-model",
            str(other),
        ],
        capsys,
    )
    assert "tokenizer differs" in msg


@pytest.mark.parametrize(
    "flags",
    [
        ["--k", "0", "--tree", "chain"],
        ["--budget", "-2"],
        ["--topk", "0"],
        ["--max-new-tokens", "0"],
        ["--tree", "static"],
        ["--tree", "static", "--paths", "0.0"],
        ["--union-trust", "-1"],
        ["--union-depth", "-3"],
        ["--head-min-prob", "1.5"],
    ],
)
def test_bad_numbers(model_dir: Path, flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    _error(["generate", "--model", str(model_dir), "--prompt", "x", *flags], capsys)


def test_prompt_too_long(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    msg = _error(
        [
            "generate",
            "--model",
            str(model_dir),
            "--no-chat",
            "--prompt",
            "hello world " * 400,
            "--max-new-tokens",
            "8",
        ],
        capsys,
    )
    assert "context" in msg


def test_malformed_prompts_file(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = _prompts(tmp_path, [GOOD[0], "{not json", GOOD[1]])
    msg = _error(["bench", "--model", str(model_dir), "--prompts", str(p)], capsys)
    assert "line 2" in msg


def test_debug_shows_traceback(tmp_path: Path) -> None:
    from specpilot.errors import ModelLoadError

    with pytest.raises(ModelLoadError):
        main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x", "--debug"])


def test_bench_several_candidates_share_one_reference(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = [
        "bench",
        "--model",
        str(model_dir),
        "--prompts",
        str(_prompts(tmp_path, GOOD)),
        "--max-new-tokens",
        "16",
        "--drafter",
        "lookup",
        "--drafter",
        "suffix",
        "--tree",
        "chain",
        "--tree",
        "dynamic",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    d = json.loads(out.read_text())
    names = [c["name"] for c in d["candidates"]]
    assert names == ["lookup/chain", "lookup/dynamic", "suffix/chain", "suffix/dynamic"]
    assert all(c["lossless"] for c in d["candidates"])
    assert d["drafter"] == "lookup" and d["tree"]["kind"] == "chain"
