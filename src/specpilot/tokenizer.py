"""Tokenizer: a thin wrapper over a Hugging Face ``tokenizers.Tokenizer`` plus its chat template.

What the engine needs from a tokenizer and nothing more: encode/decode, the end-of-sequence ids,
the chat template (rendered with jinja2 in a sandbox, with the same environment settings as
transformers' ``apply_chat_template``), a fingerprint of the vocabulary (a drafter proposes token
ids, so it must share the target's id -> token mapping), and :class:`StreamDecoder`, an incremental
detokenizer for streaming that never emits half of a multi-byte character (the prefix/read offset
scheme of vLLM's ``detokenize_incrementally``).

A tokenizer directory is the Hugging Face layout: ``tokenizer.json`` and, optionally,
``tokenizer_config.json`` (``chat_template``, ``bos_token``, ``eos_token``, ``add_bos_token``)
or ``chat_template.jinja``. With ``add_bos_token`` (Gemma) plain-text prompts start with BOS; a
chat template writes its own. A ``chat`` prompt on a model without a chat template is encoded as
plain text, and :func:`chat_fallback_notice` gives the one line the CLI shows about it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specpilot.errors import ConfigError, ModelLoadError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template the way transformers does (sandboxed, trim/lstrip blocks)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ModelLoadError(f"chat template does not compile: {e}") from None


def _token_content(tok: Any) -> str | None:
    """``tokenizer_config.json`` spells special tokens as a string or an AddedToken dict."""
    if isinstance(tok, dict):
        tok = tok.get("content")
    return tok if isinstance(tok, str) else None


class Tokenizer:
    """Encode/decode, end-of-sequence ids and the chat template of one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_id: int | None = None,
        eos_ids: Iterable[int] = (),
        add_bos: bool = False,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_id = bos_id
        self.add_bos = add_bos and bos_id is not None  # plain-text prompts start with BOS
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_ids))
        self._compiled: tuple[str, jinja2.Template] | None = None
        self._fingerprint: str | None = None

    # -- construction / serialization ---------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path, extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
        """Read ``tokenizer.json`` (+ ``tokenizer_config.json``) from a model directory.

        ``extra_eos_ids`` (e.g. ``eos_token_id`` from config.json / generation_config.json) are
        appended to the tokenizer's own end-of-sequence token.
        """
        path = Path(path)
        tok_file = path / TOKENIZER_FILE
        if not tok_file.is_file():
            raise ModelLoadError(
                f"no {TOKENIZER_FILE} in {path}; a model directory needs a fast (tokenizers) "
                "tokenizer saved next to its weights"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust parser raises a bare Exception for malformed JSON
            raise ModelLoadError(f"cannot read tokenizer file {tok_file}: {e}") from None
        tcfg: dict[str, Any] = {}
        cfg_file = path / TOKENIZER_CONFIG_FILE
        if cfg_file.is_file():
            try:
                tcfg = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ModelLoadError(f"cannot read tokenizer config {cfg_file}: {e}") from None
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = path / CHAT_TEMPLATE_FILE
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        bos = _token_content(tcfg.get("bos_token"))
        eos = _token_content(tcfg.get("eos_token"))
        bos_id = backend.token_to_id(bos) if bos else None
        eos_ids = [backend.token_to_id(eos)] if eos and backend.token_to_id(eos) is not None else []
        return cls(
            backend,
            chat_template=template if isinstance(template, str) else None,
            bos_id=bos_id,
            eos_ids=[*eos_ids, *extra_eos_ids],
            add_bos=tcfg.get("add_bos_token") is True,
        )

    def tokenizer_config(self) -> dict[str, Any]:
        """The ``tokenizer_config.json`` dict that :meth:`from_dir` reads back to this object."""
        d: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        if self.bos_id is not None:
            d["bos_token"] = self.backend.id_to_token(self.bos_id)
        if self.eos_ids:
            d["eos_token"] = self.backend.id_to_token(self.eos_ids[0])
        if self.chat_template is not None:
            d["chat_template"] = self.chat_template
        if self.add_bos:
            d["add_bos_token"] = True
        return d

    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into directory ``path``."""
        path = Path(path)
        self.backend.save(str(path / TOKENIZER_FILE))
        (path / TOKENIZER_CONFIG_FILE).write_text(
            json.dumps(self.tokenizer_config(), indent=2, ensure_ascii=False), encoding="utf-8"
        )

    # -- encode / decode -----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) are
        always one id; ``add_special_tokens`` adds the post-processor's (e.g. a leading BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # -- chat ----------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` (``{"role": ..., "content": ...}``) with the chat template."""
        if self.chat_template is None:
            raise ConfigError(
                "this model has no chat template; encode the prompt as plain text "
                "(chat=False) or use a chat (instruct) model"
            )
        if self._compiled is None or self._compiled[0] != self.chat_template:
            self._compiled = (self.chat_template, compile_chat_template(self.chat_template))
        tok = self.backend.id_to_token
        try:
            return self._compiled[1].render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=tok(self.bos_id) if self.bos_id is not None else "",
                eos_token=tok(self.eos_ids[0]) if self.eos_ids else "",
            )
        except jinja2.exceptions.TemplateError as e:
            raise ConfigError(f"chat template rejected the messages: {e}") from None

    def encode_prompt(self, text: str, chat: bool) -> list[int]:
        """Ids of ``text``, wrapped as one user message by the chat template when ``chat`` and
        the model has one (else plain text: see :func:`chat_fallback_notice`); plain text gets
        a leading BOS when :attr:`add_bos`."""
        if chat and self.chat_template is not None:
            return self.encode(self.apply_chat_template([{"role": "user", "content": text}]))
        ids = self.encode(text)
        return [int(self.bos_id), *ids] if self.add_bos else ids  # type: ignore[arg-type]

    # -- identity ------------------------------------------------------------------------------

    def fingerprint(self) -> str:
        """sha256 of the id -> token mapping (added tokens included), hex."""
        if self._fingerprint is None:
            vocab = self.backend.get_vocab(with_added_tokens=True)
            items = sorted(vocab.items(), key=lambda kv: kv[1])
            blob = json.dumps(items, ensure_ascii=False, separators=(",", ":"))
            self._fingerprint = hashlib.sha256(blob.encode("utf-8")).hexdigest()
        return self._fingerprint

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_ids={self.eos_ids}, chat_template={self.chat_template is not None})"
        )


def chat_fallback_notice(tokenizer: Tokenizer, chat_flags: Iterable[bool]) -> str | None:
    """The one-line notice for ``chat`` prompts on a model without a chat template (they run as
    plain text; no template is invented), or None when there is nothing to say."""
    n = sum(1 for c in chat_flags if c)
    if n == 0 or tokenizer.chat_template is not None:
        return None
    what = "the chat prompt runs" if n == 1 else f"{n} chat prompts run"
    return f"this model has no chat template: {what} as plain text"


class StreamDecoder:
    """Incremental detokenizer: feed token ids, get back only complete new text.

    Decoding token by token breaks multi-byte characters (a byte-level BPE may spell one emoji
    as several tokens) and word-initial spaces (sentencepiece). So each call decodes a short window
    twice -- the already-emitted tail ``ids[prefix:read]`` and ``ids[prefix:]`` -- and emits the
    difference, holding it back while it ends in an incomplete UTF-8 sequence (U+FFFD)::

        dec = StreamDecoder(tok)
        text = "".join(dec.push(t) for t in ids) + dec.flush()   # == tok.decode(ids)
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # end of what has been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: int | Iterable[int]) -> str:
        """Add generated ids; return the text they complete ("" while a character is partial)."""
        if isinstance(ids, int):
            self.ids.append(ids)
        else:
            self.ids.extend(int(i) for i in ids)
        emitted = self._decode(self.ids[self._prefix : self._read])
        full = self._decode(self.ids[self._prefix :])
        if len(full) > len(emitted) and not full.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return full[len(emitted) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (possibly with U+FFFD for a truncated character)."""
        emitted = self._decode(self.ids[self._prefix : self._read])
        full = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return full[len(emitted) :]
