"""llama.cpp peers: the driver (ids in, budget and EOS cut, threads passed) against a fake
``llama_cpp`` module, the bench's notice-and-skip paths, and one slow run on the real GGUF."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from specpilot.cli import main
from specpilot.errors import ConfigError
from specpilot.peers import llamacpp as lcp
from specpilot.peers.llamacpp import (
    LlamaCppConfig,
    PeerUnavailable,
    bench_config,
    context_size,
    greedy_tokens,
    make_llamacpp_peers,
)

from .test_loading import make_model, save_dir, write_gguf

Script = Callable[[list[int]], Iterator[int]]


class FakeLookup:
    """Stands in for ``llama_cpp.llama_speculative.LlamaPromptLookupDecoding``."""

    def __init__(self, max_ngram_size: int = 2, num_pred_tokens: int = 10) -> None:
        self.max_ngram_size, self.num_pred_tokens = max_ngram_size, num_pred_tokens


class FakeLlama:
    """Records how it was built and called; generates what ``script`` yields for the prompt."""

    script: Script = staticmethod(lambda ids: iter(range(100, 200)))

    def __init__(self, model_path: str, **kw: Any) -> None:
        self.model_path, self.kw = model_path, kw
        self.resets = 0
        self.calls: list[tuple[list[int], dict[str, Any]]] = []
        self.pulled = 0

    def n_ctx(self) -> int:
        return int(self.kw["n_ctx"])

    def reset(self) -> None:
        self.resets += 1

    def generate(self, tokens: list[int], **kw: Any) -> Iterator[int]:
        self.calls.append((list(tokens), kw))
        for t in type(self).script(list(tokens)):
            self.pulled += 1
            yield t


@pytest.fixture
def fake_llama_cpp(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A minimal ``llama_cpp`` (and ``llama_cpp.llama_speculative``) in ``sys.modules``."""
    mod = types.ModuleType("llama_cpp")
    spec = types.ModuleType("llama_cpp.llama_speculative")

    class Llama(FakeLlama):
        instances: ClassVar[list[FakeLlama]] = []

        def __init__(self, model_path: str, **kw: Any) -> None:
            super().__init__(model_path, **kw)
            Llama.instances.append(self)

    mod.Llama = Llama  # type: ignore[attr-defined]
    spec.LlamaPromptLookupDecoding = FakeLookup  # type: ignore[attr-defined]
    mod.llama_speculative = spec  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "llama_cpp", mod)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", spec)
    return Llama


@pytest.fixture
def no_llama_cpp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", None)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lcp") / "tiny.gguf"
    write_gguf(path, make_model("llama-tied", seed=3))
    return path


def _cfg(path: Path | str, threads: int = 3, n_ctx: int = 256) -> LlamaCppConfig:
    return LlamaCppConfig(model_path=str(path), threads=threads, n_ctx=n_ctx)


# -- the driver ---------------------------------------------------------------------------------


def test_both_peers_built_with_threads_context_and_lookup(
    fake_llama_cpp: Any, tiny_gguf: Path
) -> None:
    peers = make_llamacpp_peers(_cfg(tiny_gguf, threads=3, n_ctx=320))
    assert [p.name for p in peers] == ["llama.cpp", "llama.cpp-lookup"]
    plain, lookup = fake_llama_cpp.instances
    for llm in (plain, lookup):
        assert llm.model_path == str(tiny_gguf)
        assert llm.kw["n_threads"] == 3 and llm.kw["n_threads_batch"] == 3
        assert llm.kw["n_ctx"] == 320 and llm.kw["verbose"] is False
        assert llm.kw["logits_all"] is False and isinstance(llm.kw["seed"], int)
    assert "draft_model" not in plain.kw
    draft = lookup.kw["draft_model"]
    assert isinstance(draft, FakeLookup) and draft.num_pred_tokens == 10
    assert draft.max_ngram_size == 2


def test_ids_fed_as_given_greedy_and_reset_per_prompt(fake_llama_cpp: Any, tiny_gguf: Path) -> None:
    plain, _ = make_llamacpp_peers(_cfg(tiny_gguf))
    llm = fake_llama_cpp.instances[0]
    assert plain.generate([1, 5, 9], 4, ()) == [100, 101, 102, 103]
    assert plain.generate([7, 8], 2, ()) == [100, 101]
    assert llm.resets == 2
    assert [ids for ids, _ in llm.calls] == [[1, 5, 9], [7, 8]]
    kw = llm.calls[0][1]
    assert kw["temp"] == 0.0 and kw["top_k"] == 1 and kw["repeat_penalty"] == 1.0
    assert llm.pulled == 6  # never asks for a token past the budget


@pytest.mark.parametrize(
    ("eos", "budget", "want"),
    [
        ((2,), 8, [5, 7, 2]),  # the first EOS ends it and is kept
        ((9, 2), 8, [5, 7, 2]),
        ((), 5, [5, 7, 2, 9, 2]),  # no EOS ids: never stops early
        ((2,), 2, [5, 7]),  # the budget comes first
        ((2,), 0, []),
    ],
)
def test_eos_and_budget_cut_like_the_engine(
    eos: tuple[int, ...], budget: int, want: list[int]
) -> None:
    class Scripted(FakeLlama):
        script = staticmethod(lambda ids: iter([5, 7, 2, 9, 2, 4, 4, 4]))

    llm = Scripted("m.gguf", n_ctx=64)
    assert greedy_tokens(llm, [1, 2, 3], budget, eos) == want


def test_prompt_past_context_and_empty_prompt_are_errors() -> None:
    llm = FakeLlama("m.gguf", n_ctx=16)
    with pytest.raises(ConfigError, match="context of 16"):
        greedy_tokens(llm, list(range(10)), 7, ())
    with pytest.raises(ValueError, match="empty"):
        greedy_tokens(llm, [], 4, ())
    assert llm.calls == []


def test_context_size_and_bench_config(tiny_gguf: Path) -> None:
    assert context_size([10, 300, 40], 128, 10) == 448  # 439 rounded up to 64
    assert context_size([], 16, 10) == 64
    cfg = bench_config(str(tiny_gguf), 2, [10, 20], 16)
    assert cfg.threads == 2 and cfg.n_ctx >= 20 + 16 + cfg.num_pred_tokens
    import torch

    assert bench_config(str(tiny_gguf), None, [4], 8).threads == torch.get_num_threads()
    with pytest.raises(ConfigError, match="threads"):
        LlamaCppConfig(model_path="m.gguf", threads=0, n_ctx=64)


def test_absent_package_and_non_gguf_raise_peer_unavailable(
    no_llama_cpp: None, tiny_gguf: Path, tmp_path: Path
) -> None:
    with pytest.raises(PeerUnavailable, match="llama-cpp-python") as e:
        make_llamacpp_peers(_cfg(tiny_gguf))
    assert "\n" not in str(e.value)
    with pytest.raises(PeerUnavailable, match="not one"):
        make_llamacpp_peers(_cfg(tmp_path))
    fake = tmp_path / "x.gguf"
    fake.write_bytes(b"not a gguf file")
    assert not lcp.is_gguf(fake) and lcp.is_gguf(tiny_gguf)


# -- the bench -----------------------------------------------------------------------------------

PROMPTS = [
    json.dumps({"id": "a", "prompt": "def f(x): return x + x + x", "chat": False}),
    json.dumps({"id": "b", "prompt": "hello hello hello world", "chat": False}),
]


def _bench(tmp: Path, model: Path, *extra: str) -> tuple[int, dict[str, Any] | None]:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp / "bench.json"
    args = ["bench", "--model", str(model), "--prompts", str(prompts), "--max-new-tokens", "12"]
    rc = main([*args, "--drafter", "lookup", "--threads", "2", "--json", str(out), *extra])
    return rc, json.loads(out.read_text()) if out.exists() else None


def _engine_script(model_path: str) -> Script:
    """llama.cpp stand-in: our own engine's greedy tokens on the same file (unbounded, no EOS)."""
    from specpilot.engine import Engine, GenerationConfig
    from specpilot.loading import load_model

    engine = Engine(load_model(model_path).model)

    def script(ids: list[int]) -> Iterator[int]:
        gen = GenerationConfig(max_new_tokens=40, stop_on_eos=False)
        yield from engine.generate(ids, gen).tokens
        raise AssertionError("the peer asked for more tokens than the budget")

    return script


def test_bench_json_has_both_llamacpp_peers(
    fake_llama_cpp: Any,
    tiny_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fake_llama_cpp, "script", staticmethod(_engine_script(str(tiny_gguf))))
    rc, d = _bench(tmp_path, tiny_gguf, "--peers", "llama.cpp")
    assert rc == 0 and d is not None
    assert set(d["peers"]) == {"llama.cpp", "llama.cpp-lookup"}
    for name in ("llama.cpp", "llama.cpp-lookup"):
        p = d["peers"][name]
        assert p["tok_s"] > 0 and p["n_prompts"] == 2
        assert p["identical"] is True and p["n_identical"] == 2  # the same tokens, fed the same ids
    plain, lookup = fake_llama_cpp.instances
    assert plain.model_path == str(tiny_gguf.resolve())
    assert plain.kw["n_threads"] == 2 and lookup.kw["n_threads_batch"] == 2
    # warm-up + 2 prompts, each from an empty cache
    assert plain.resets == 3 and len(plain.calls) == 3


def test_bench_flags_a_peer_that_differs(
    fake_llama_cpp: Any,
    tiny_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path / "cache"))
    rc, d = _bench(tmp_path, tiny_gguf, "--peers", "llama.cpp")
    assert rc == 0 and d is not None  # the fake's tokens 100, 101, ... are not ours
    assert d["peers"]["llama.cpp"]["identical"] is False
    assert d["peers"]["llama.cpp"]["n_identical"] == 0


def test_bench_without_the_package_notes_and_skips(
    no_llama_cpp: None,
    tiny_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path / "cache"))
    rc, d = _bench(tmp_path, tiny_gguf, "--peers", "llama.cpp")
    assert rc == 0 and d is not None and d["peers"] == {} and d["spec_tok_s"] > 0
    notes = [ln for ln in capsys.readouterr().err.splitlines() if "llama-cpp-python" in ln]
    assert len(notes) == 1 and "skipped" in notes[0]


def test_bench_on_a_model_directory_notes_and_skips(
    fake_llama_cpp: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = save_dir(tmp_path / "tiny", make_model("llama-tied", seed=3))
    rc, d = _bench(tmp_path, model_dir, "--peers", "llama.cpp")
    assert rc == 0 and d is not None and d["peers"] == {}
    notes = [ln for ln in capsys.readouterr().err.splitlines() if "GGUF" in ln]
    assert len(notes) == 1 and "skipped" in notes[0]
    assert fake_llama_cpp.instances == []


def test_bench_batch_size_refuses_llamacpp_peers(
    fake_llama_cpp: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = save_dir(tmp_path / "tiny", make_model("llama-tied", seed=3))
    rc, _ = _bench(tmp_path, model_dir, "--peers", "llama.cpp", "--batch-size", "2")
    assert rc == 2
    assert "--peers is not available with --batch-size" in capsys.readouterr().err


# -- the real thing ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed"
)
def test_real_smollm2_gguf_peers_run(tmp_path: Path) -> None:
    from specpilot.bench import BenchConfig, run_bench
    from specpilot.engine import Engine, EngineConfig
    from specpilot.loading import load_model
    from specpilot.workloads import load_workload

    loaded = load_model("smollm2-135m")
    engine = Engine(loaded.model, EngineConfig(threads=2))
    tok = loaded.tokenizer
    work = load_workload("humaneval", limit=2)
    prompts = [(p.id, tok.encode_prompt(p.text, chat=p.chat)) for p in work]
    cfg = bench_config(loaded.source, 2, [len(ids) for _, ids in prompts], 16)
    peers = make_llamacpp_peers(cfg)
    res = run_bench(engine, prompts, [], BenchConfig(max_new_tokens=16), tok.eos_ids, peers)
    for name in ("llama.cpp", "llama.cpp-lookup"):
        ps = res.peers[name]
        assert ps.tok_s > 0 and ps.n_prompts == 2
        assert isinstance(ps.identical, bool) and 0 <= ps.n_identical <= 2
