"""Native GGUF loading without the fp32 detour: same modules and bits as ``to_native`` on the fp32
model (llama and gemma3), no fp32 weight tensor left, the header cache, the ``auto`` default
(native for GGUF, fp32 for HF directories and for the Hugging Face peers), the no-compiler
fallback, corrupt files naming the tensor."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from specpilot import kernels
from specpilot.errors import ConfigError, ModelLoadError
from specpilot.loading import cache, gguf_file, load_model, native
from specpilot.loading.hf import save_hf_dir
from specpilot.model import Transformer

from .conftest import tiny_model
from .test_loading import VOCAB, write_gguf
from .test_tokenizer import tiny_tokenizer

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=kernels.unavailable_reason() or "kernels unavailable"
)

LLAMA_QUANT = {
    "token_embd.weight": T.Q8_0,
    "blk.0.attn_q.weight": T.Q4_0,  # mixed q/k/v types: three separate native linears
    "blk.0.attn_k.weight": T.Q8_0,
    "blk.0.attn_v.weight": T.F16,
    "blk.0.attn_output.weight": T.Q5_0,
    "blk.0.ffn_gate.weight": T.Q4_1,
    "blk.0.ffn_up.weight": T.Q4_1,
    "blk.0.ffn_down.weight": T.Q8_0,
    "blk.1.attn_q.weight": T.Q4_1,  # one type: fused q/k/v
    "blk.1.attn_k.weight": T.Q4_1,
    "blk.1.attn_v.weight": T.Q4_1,
    "blk.1.attn_output.weight": T.BF16,
    "blk.1.ffn_gate.weight": T.Q8_0,
    "blk.1.ffn_up.weight": T.Q5_0,
    "blk.1.ffn_down.weight": T.Q5_1,  # no native kernel: dequantized, dense F32 kernel
}
Q5_1_NOTE = "blk.1.ffn_down.weight: Q5_1 has no native kernel, dequantized"


def write_gemma(path: Path, seed: int = 3) -> None:
    """A tiny Gemma 3 GGUF (llama.cpp layout: norms stored as w + 1) with quantized matrices."""
    from .test_gemma import TOKENS, TYPES, gguf_tensor_name, hf_model

    hf = hf_model(seed=seed, vocab_size=len(TOKENS), num_hidden_layers=6, layer_types=None,
                  query_pre_attn_scalar=16)  # fmt: skip
    c = hf.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(1_000_000.0)
    w.add_sliding_window(c.sliding_window)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_scores([0.0] * len(TOKENS))
    w.add_token_types(TYPES)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    kinds = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q4_1, T.Q8_0, T.F16]
    for i, (name, t) in enumerate(hf.state_dict().items()):
        if name == "lm_head.weight":
            continue
        arr = t.numpy().astype(np.float32)
        if name.endswith("norm.weight"):
            w.add_tensor(gguf_tensor_name(name), arr + 1)
        else:
            kind = kinds[i % len(kinds)]
            w.add_tensor(gguf_tensor_name(name), quantize(arr, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("native_load")
    llama = tmp / "tiny-llama.gguf"
    src = tiny_model("llama", seed=7, std=0.12, vocab=VOCAB, dim=64, intermediate_size=128)
    write_gguf(llama, src, quant=LLAMA_QUANT)
    untied = tmp / "tiny-untied.gguf"
    src = tiny_model("llama", seed=8, std=0.12, vocab=VOCAB, dim=64, intermediate_size=128,
                     tie_embeddings=False)  # fmt: skip
    mats = [f"blk.{i}.{x}.weight" for i in (0, 1) for x in ("attn_q", "attn_k", "attn_v",
            "attn_output", "ffn_gate", "ffn_up", "ffn_down")]  # fmt: skip
    write_gguf(untied, src, quant={"token_embd.weight": T.Q8_0, "output.weight": T.Q4_0,
                                   **dict.fromkeys(mats, T.Q4_1)})  # fmt: skip
    qwen2 = tmp / "tiny-qwen2.gguf"  # q/k/v biases
    src = tiny_model("qwen2", seed=9, std=0.12, vocab=VOCAB, dim=64, intermediate_size=128)
    write_gguf(qwen2, src, quant={f"blk.{i}.attn_{x}.weight": T.Q8_0 for i in (0, 1)
                                  for x in "qkv"})  # fmt: skip
    gemma = tmp / "tiny-gemma3.gguf"
    write_gemma(gemma)
    return {"llama": llama, "untied": untied, "qwen2": qwen2, "gemma3": gemma}


def logits(m: Transformer, toks: list[int]) -> torch.Tensor:
    m.setup_cache(64, attention="exact")
    ids = torch.tensor([toks])
    out = m(ids, torch.arange(len(toks))[None], 0, len(toks)).logits
    assert out is not None
    return out


def module_kinds(m: Transformer) -> list[tuple[str, str, Any]]:
    return [(n, type(mod).__name__, getattr(mod, "qtype", None)) for n, mod in m.named_modules()]


@pytest.mark.parametrize("kind", ["llama", "untied", "qwen2", "gemma3"])
def test_native_load_equals_to_native_bit_for_bit(
    files: dict[str, Path], kind: str, tmp_path: Path
) -> None:
    path = files[kind]
    new = load_model(str(path), cache_dir=tmp_path / "c", weights="native")
    old = load_model(str(path), cache_dir=tmp_path / "c", weights="fp32")
    assert not old.model.native
    old_notes = native.to_native(old.model, path)  # today's path: fp32 model, then swapped
    assert new.model.native and old.model.native
    assert new.notes == old_notes == ((Q5_1_NOTE,) if kind == "llama" else ())
    assert new.cfg == old.cfg and new.fingerprint == old.fingerprint
    assert module_kinds(new.model) == module_kinds(old.model)
    a, b = new.model.state_dict(), old.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    toks = [1, 5, 9, 2, 7, 3, 11, 4, 8, 6]
    assert torch.equal(logits(new.model, toks), logits(old.model, toks))
    assert torch.equal(new.model.head_weight(), old.model.head_weight())
    assert torch.equal(new.model.model.embed_tokens.weight, old.model.model.embed_tokens.weight)


@pytest.mark.parametrize("kind", ["llama", "untied", "gemma3"])
def test_no_fp32_weight_tensor_on_the_native_model(
    files: dict[str, Path], kind: str, tmp_path: Path
) -> None:
    lm = load_model(str(files[kind]), cache_dir=tmp_path / "c")  # the default: native
    m, cfg = lm.model, lm.cfg
    assert m.native
    tensors = [*m.named_parameters(), *m.named_buffers()]
    assert not any(t.is_meta for _, t in tensors)
    floats = [(n, t) for n, t in tensors if t.is_floating_point()]
    assert floats and all(t.dtype == torch.float32 and t.dim() == 1 for _, t in floats), [
        (n, tuple(t.shape)) for n, t in floats if t.dim() != 1
    ]
    largest = max(cfg.dim, cfg.intermediate_size, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim)
    assert max(t.numel() for _, t in floats) <= largest  # norms and biases only
    blocks = [t for n, t in tensors if n.endswith("blocks")]
    assert all(t.dtype == torch.uint8 for t in blocks)
    dense = [mod for mod in m.modules() if getattr(mod, "qtype", None) == kernels.QTYPES["F32"]]
    # only the tensor with no kernel runs on fp32 rows (named in the notes)
    assert len(dense) == (1 if kind == "llama" else 0) and len(lm.notes) == len(dense)
    extra = sum(d.blocks.numel() for d in dense)
    stored = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for _, t in tensors}
    assert sum(stored.values()) <= files[kind].stat().st_size + extra  # about the file's bytes
    # fp32 copies only on demand; a tied head shares the embedding's
    assert native.fp32_copy_bytes(m) == 0
    emb = m.model.embed_tokens.weight
    head = m.head_weight()
    tied = kind != "untied"
    assert (head is emb) == tied
    table = cfg.vocab_size * cfg.dim * 4
    assert native.fp32_copy_bytes(m) == table * (1 if tied else 2)


def test_header_cache_is_written_once_and_reused(
    files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, root = files["gemma3"], tmp_path / "c"
    first = load_model(str(path), cache_dir=root)
    entry = cache.cache_entry(path, root)
    native_entry = entry.with_name(entry.name + "-native")
    assert sorted(p.name for p in native_entry.iterdir()) == [
        "config.json", "tensors.json", "tokenizer.json", "tokenizer_config.json"
    ]  # fmt: skip
    assert not entry.exists()  # no fp32 conversion written

    def no_header(*a: object, **k: object) -> None:
        raise AssertionError("GGUF header parsed on a cached load")

    monkeypatch.setattr(native, "read_header", no_header)
    second = load_model(str(path), cache_dir=root)
    assert second.cfg == first.cfg and second.fingerprint == first.fingerprint
    a, b = first.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    toks = [2, 5, 9, 7, 3]
    assert torch.equal(logits(first.model, toks), logits(second.model, toks))
    # a damaged entry is parsed again, not trusted
    monkeypatch.undo()
    (native_entry / "tensors.json").write_text("{")
    third = load_model(str(path), cache_dir=root)
    assert torch.equal(logits(third.model, toks), logits(first.model, toks))


def test_unwritable_header_cache_still_loads(
    files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(entry: Path, write: object) -> Path:
        raise PermissionError(13, "read-only", str(entry))

    monkeypatch.setattr(cache, "write_atomic", fail)
    lm = load_model(str(files["llama"]), cache_dir=tmp_path / "ro")
    assert lm.model.native and lm.notes == (Q5_1_NOTE,)


def test_default_is_native_for_gguf_and_fp32_for_hf_dirs(
    files: dict[str, Path], tmp_path: Path
) -> None:
    path, root = str(files["llama"]), tmp_path / "c"
    assert load_model(path, cache_dir=root).model.native
    assert not load_model(path, cache_dir=root, weights="fp32").model.native
    src = tiny_model("llama", seed=1, vocab=VOCAB)
    d = tmp_path / "hf"
    d.mkdir()
    save_hf_dir(d, src.cfg, src.state_dict(), tiny_tokenizer())
    for weights in ("auto", "native"):  # an HF directory is always fp32 (as before)
        lm = load_model(str(d), weights=weights)
        assert not lm.model.native and lm.notes == ()
    # off CPU float32: auto quietly fp32, an explicit native says why
    lm = load_model(str(files["llama"]), cache_dir=tmp_path / "c", dtype=torch.bfloat16)
    assert not lm.model.native and lm.notes == ()
    lm = load_model(str(files["llama"]), cache_dir=tmp_path / "c", dtype=torch.bfloat16,
                    weights="native")  # fmt: skip
    assert not lm.model.native
    assert lm.notes == ("native GGUF weights need CPU float32; using the fp32 weights",)
    with pytest.raises(ModelLoadError, match="weights must be one of fp32, native, auto"):
        load_model(str(files["llama"]), cache_dir=tmp_path / "c", weights="int4")


def test_no_compiler_falls_back_to_fp32_with_a_notice(
    files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from specpilot.cli import main

    reason = "native GGUF kernels unavailable: no C++ compiler (set CXX or install g++)"
    path = files["llama"]
    ref = load_model(str(path), cache_dir=tmp_path / "c", weights="fp32")
    monkeypatch.setattr(kernels, "unavailable_reason", lambda: reason)
    monkeypatch.setattr(kernels, "available", lambda: False)
    for weights in ("auto", "native"):
        lm = load_model(str(path), cache_dir=tmp_path / "c", weights=weights)
        assert not lm.model.native
        assert lm.notes == (f"{reason}; using the fp32 weights",)
        a, b = lm.model.state_dict(), ref.model.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in b)
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path / "c"))
    argv = ["generate", "--model", str(path), "--prompt", "a b a b", "--no-chat",
            "--max-new-tokens", "8", "--drafter", "none"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr()
    assert out.err.count("specpilot: note:") == 1
    assert f"specpilot: note: {reason}; using the fp32 weights" in out.err
    assert main([*argv, "--weights", "fp32"]) == 0
    assert capsys.readouterr().out == out.out


def test_truncated_blocks_name_the_tensor(files: dict[str, Path], tmp_path: Path) -> None:
    from specpilot.cli import main

    path = tmp_path / "cut.gguf"
    data = files["llama"].read_bytes()
    path.write_bytes(data)
    root = tmp_path / "c"
    load_model(str(path), cache_dir=root)  # the header cache is written for the whole file
    path.write_bytes(data[:-100])  # the last tensor loses its tail (a new size: a new entry)
    with pytest.raises(ModelLoadError, match=r"truncated or corrupt: tensor \S+ needs bytes"):
        load_model(str(path), cache_dir=root)
    assert main(["generate", "--model", str(path), "--prompt", "x", "--max-new-tokens", "2"]) == 2


def test_corrupt_block_data_names_the_tensor(files: dict[str, Path]) -> None:
    listed = gguf_file.read_header(files["llama"])[0]
    t = next(t for t in listed if t.name == "blk.0.ffn_gate.weight")

    class Cut:  # what a damaged table would map: the tensor's bytes end early
        name, tensor_type, shape = t.name, t.tensor_type, t.shape
        data = np.asarray(t.data).reshape(-1)[:-5]

    with pytest.raises(ModelLoadError, match=r"tensor blk\.0\.ffn_gate\.weight: truncated"):
        native._rows(Cut, None, [])


def test_commands_share_the_default_and_hf_peers_get_fp32(
    files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specpilot import plan_setup
    from specpilot.cli import build_parser

    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path / "c"))
    path = str(files["llama"])

    def args(*extra: str) -> argparse.Namespace:
        return build_parser().parse_args(["bench", "--model", path, "--drafter", "none", *extra])

    assert plan_setup.weights_mode(args()) == "auto"
    assert plan_setup.weights_mode(args(), hf_peers=True) == "fp32"
    assert plan_setup.weights_mode(args("--weights", "native"), hf_peers=True) == "native"
    assert plan_setup.load_plans(args())[0].model.native
    s = plan_setup.setup(args(), hf_peers=True)
    assert not s.loaded.model.native and s.peers  # built from the fp32 weights
    with pytest.raises(ConfigError, match="drop --weights native"):
        plan_setup.setup(args("--weights", "native"), hf_peers=True)
    train = build_parser().parse_args(["train-drafter", "--out", str(tmp_path / "d")])
    assert train.weights == "auto"


def test_heap_release_degrades_where_libc_has_no_malloc_trim(monkeypatch: Any) -> None:
    import ctypes

    from specpilot.loading import native as native_mod

    calls: list[int] = []

    class Glibc:
        def malloc_trim(self, pad: int) -> int:
            calls.append(pad)
            return 1

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Glibc())
    native_mod.release_heap()
    assert calls == [0]
    monkeypatch.setattr(ctypes, "CDLL", lambda name: object())  # musl, macOS: no malloc_trim
    native_mod.release_heap()
    assert calls == [0]
