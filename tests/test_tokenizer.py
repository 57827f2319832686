"""Tokenizer: GGUF byte-level BPE rebuild, pre-tokenizers, chat template, fingerprint, streaming."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from specpilot.errors import ConfigError, ModelLoadError
from specpilot.loading.gguf_file import bytes_to_unicode, tokenizer_from_gguf
from specpilot.tokenizer import StreamDecoder, Tokenizer, chat_fallback_notice

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("Ġ", "a"),
    ("Ġa", "n"),
    ("Ġan", "d"),
    ("e", "r"),
    ("o", "n"),
    ("Ġ", "w"),
    ("o", "r"),
    ("Ġw", "or"),
    ("l", "d"),
    ("Ġwor", "ld"),
    ("1", "2"),
    ("Ġ", "1"),
    ("Ã", "©"),
]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXTS = [
    "the world and the word",
    "Hello, World!  Two  spaces\tand a tab\nnew line",
    "digits 12 345 6789 and 1.5e-3",
    "naïve café — “quotes” ½ x²",
    "日本語 中文 한국어",
    "emoji 🎉🚀👍🏽",
    "def f(x):\n    return x ** 2  # comment\n",
    "",
    "   ",
]


def tiny_vocab_meta(pre: str = "smollm", **extra: Any) -> dict[str, Any]:
    """GGUF tokenizer metadata of a tiny byte-level BPE: 3 specials, 256 bytes, a few merges."""
    b2u = bytes_to_unicode()
    tokens = SPECIALS + [b2u[b] for b in range(256)] + ["".join(m) for m in MERGES]
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)),
        "tokenizer.ggml.merges": [" ".join(m) for m in MERGES],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": CHATML,
    }
    meta.update(extra)
    return meta


def tiny_tokenizer(pre: str = "smollm", **extra: Any) -> Tokenizer:
    return tokenizer_from_gguf(tiny_vocab_meta(pre, **extra), Path("tiny.gguf"))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return tiny_tokenizer()


def pieces(t: Tokenizer, text: str) -> list[str]:
    return [t.decode([i], skip_special_tokens=False) for i in t.encode(text)]


@pytest.mark.parametrize("pre", ["smollm", "gpt2", "qwen2", "llama-bpe"])
@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(pre: str, text: str) -> None:
    t = tiny_tokenizer(pre)
    ids = t.encode(text)
    assert all(0 <= i < t.vocab_size for i in ids)
    assert t.decode(ids) == text


def test_merges_and_specials(tok: Tokenizer) -> None:
    assert pieces(tok, " the world") == [" the", " world"]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.bos_id == 1 and tok.eos_ids == (2,)
    assert tok.vocab_size == 3 + 256 + len(MERGES)


def test_smollm_splits_every_digit_gpt2_does_not() -> None:
    # Digits(individual_digits=True) runs before the byte-level regex (llama.cpp 'smollm').
    assert pieces(tiny_tokenizer("smollm"), "a 12") == ["a", " ", "1", "2"]
    assert pieces(tiny_tokenizer("gpt2"), "a 12") == ["a", " ", "12"]
    assert pieces(tiny_tokenizer("gpt2"), "a 1") == ["a", " 1"]
    assert pieces(tiny_tokenizer("gpt2"), "12") == ["12"]


def test_qwen2_pre_normalizes_nfc_and_splits_digits() -> None:
    t = tiny_tokenizer("qwen2")
    assert t.encode("caf\u00e9") == t.encode("cafe\u0301")
    assert pieces(t, "x12") == ["x", "1", "2"]


def test_add_bos_token_adds_bos_only_when_asked() -> None:
    t = tiny_tokenizer(**{"tokenizer.ggml.add_bos_token": True})
    assert t.encode("the", add_special_tokens=True)[0] == 1
    assert t.encode("the")[0] != 1


def test_user_defined_tokens_stay_whole() -> None:
    meta = tiny_vocab_meta()
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], "<think>"]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], 4]
    t = tokenizer_from_gguf(meta, Path("x.gguf"))
    assert pieces(t, "a<think>b") == ["a", "<think>", "b"]
    assert t.decode(t.encode("<think>")) == "<think>"  # not special: kept when decoding


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"tokenizer.ggml.model": "llama"}, "tokenizer type 'llama'"),
        ({"tokenizer.ggml.pre": "chatglm-bpe"}, "pre-tokenizer 'chatglm-bpe'"),
        ({"tokenizer.ggml.merges": ["Ġ zzz"]}, "inconsistent GGUF vocabulary"),
        ({"tokenizer.ggml.merges": ["abc"]}, "malformed"),
    ],
)
def test_unsupported_gguf_tokenizers(change: dict[str, Any], match: str) -> None:
    meta = tiny_vocab_meta()
    meta.update(change)
    with pytest.raises(ModelLoadError, match=match):
        tokenizer_from_gguf(meta, Path("x.gguf"))


def test_chat_template(tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    assert (
        tok.apply_chat_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("<|im_end|>\n")
    assert tok.encode_prompt("hi", chat=True) == tok.encode(tok.apply_chat_template(msgs))
    assert tok.encode_prompt("hi", chat=False) == tok.encode("hi")


def test_chat_template_environment_matches_transformers() -> None:
    t = tiny_tokenizer()
    # trim_blocks + lstrip_blocks: block tags on their own lines leave no whitespace behind.
    t.chat_template = "  {% for m in messages %}\n{{ m['content'] | tojson }}\n  {% endfor %}\n"
    assert t.apply_chat_template([{"role": "user", "content": "é<"}]) == '"é<"\n'
    t.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ConfigError, match="roles must alternate"):
        t.apply_chat_template([])
    t.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ConfigError):
        t.apply_chat_template([])


def test_no_chat_template_runs_chat_prompts_as_plain_text() -> None:
    t = tiny_tokenizer(**{"tokenizer.chat_template": None})
    assert t.encode_prompt("hi", chat=True) == t.encode_prompt("hi", chat=False) == t.encode("hi")
    assert chat_fallback_notice(t, [False, True, True]) == (
        "this model has no chat template: 2 chat prompts run as plain text"
    )
    assert chat_fallback_notice(t, [False]) is None
    assert chat_fallback_notice(tiny_tokenizer(), [True]) is None  # it has a template
    with pytest.raises(ConfigError, match="no chat template"):  # messages API: no invention
        t.apply_chat_template([{"role": "user", "content": "hi"}])


def test_save_from_dir_round_trip(tok: Tokenizer, tmp_path: Path) -> None:
    tok.save(tmp_path)
    back = Tokenizer.from_dir(tmp_path, extra_eos_ids=[0, 2])
    assert back.fingerprint() == tok.fingerprint()
    assert back.chat_template == tok.chat_template
    assert (back.bos_id, back.eos_ids) == (1, (2, 0))
    for text in TEXTS:
        assert back.encode(text) == tok.encode(text)


def test_from_dir_hf_variants(tok: Tokenizer, tmp_path: Path) -> None:
    """AddedToken-dict special tokens and a separate chat_template.jinja, as newer HF exports."""
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    cfg = {"eos_token": {"content": "<|im_end|>", "special": True}, "bos_token": None}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    t = Tokenizer.from_dir(tmp_path)
    assert t.eos_ids == (2,) and t.bos_id is None
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "x"


def test_from_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_fingerprint_tracks_the_vocabulary() -> None:
    a, b = tiny_tokenizer(), tiny_tokenizer("qwen2")
    assert a.fingerprint() == b.fingerprint()  # same ids -> tokens, different splitting
    meta = tiny_vocab_meta()
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"][:-1], "zz"]
    meta["tokenizer.ggml.merges"] = [*meta["tokenizer.ggml.merges"][:-1], "z z"]
    assert tokenizer_from_gguf(meta, Path("x")).fingerprint() != a.fingerprint()
    assert len(a.fingerprint()) == 64


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decoder_emits_whole_characters(tok: Tokenizer, text: str) -> None:
    dec = StreamDecoder(tok)
    chunks = [dec.push(i) for i in tok.encode(text)]
    assert not any("\ufffd" in c for c in chunks)
    assert "".join(chunks) + dec.flush() == text


def test_stream_decoder_holds_back_partial_utf8(tok: Tokenizer) -> None:
    ids = tok.encode("🎉")  # four byte tokens
    assert len(ids) == 4
    dec = StreamDecoder(tok)
    assert [dec.push(i) for i in ids] == ["", "", "", "🎉"]
    dec = StreamDecoder(tok)
    assert dec.push(tok.encode("ok")) == "ok"
    assert dec.push(ids[:2]) == ""
    assert dec.flush() == "\ufffd"  # a truncated character surfaces only at the end


def test_stream_decoder_specials(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>the<|im_end|>")
    assert "".join(StreamDecoder(tok).push(i) for i in ids) == "the"
    keep = StreamDecoder(tok, skip_special_tokens=False)
    assert "".join(keep.push(i) for i in ids) == "<|im_start|>the<|im_end|>"
