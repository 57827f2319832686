"""llama.cpp as a peer through ``llama-cpp-python``: plain greedy and prompt lookup decoding.

The engine CPU users compare against, run on the very GGUF file our engine loaded, fed the same
token ids (nothing is re-tokenized), with the same token budget, the same EOS rule and the same
thread count. Two peers, each with its own ``Llama`` loaded once per benchmark run:

- ``llama.cpp``: ``Llama.generate`` with the greedy sampler (``temp=0``; the penalties stage is a
  no-op at ``repeat_penalty=1``), ``logits_all=False``;
- ``llama.cpp-lookup``: the same with ``draft_model=LlamaPromptLookupDecoding(...)``
  (``llama_cpp.llama_speculative``: n-gram drafts copied from the context, verified by the target
  in one batch; llama-cpp-python turns ``logits_all`` on for it).

Each prompt starts from an empty KV cache (``Llama.reset``), so llama.cpp's prompt-prefix reuse
never skips a prefill ours pays. ``llama_cpp`` is imported lazily: without it, or for a model that
is not a GGUF file, :func:`make_llamacpp_peers` raises :class:`PeerUnavailable`, which the bench
reports as a one-line notice and skips.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specpilot.errors import ConfigError, SpecPilotError
from specpilot.peers.hf import Peer

#: The peer names (the keys of the bench JSON's ``peers``).
LLAMACPP_PEER_NAMES = ("llama.cpp", "llama.cpp-lookup")

_INSTALL_HINT = (
    "--peers llama.cpp needs llama-cpp-python (pip install 'specpilot[llamacpp]', compiles for "
    "~7 minutes): llama.cpp peers skipped"
)

_GGUF_MAGIC = b"GGUF"


class PeerUnavailable(SpecPilotError):
    """A peer that cannot run here (package absent, model not a GGUF); the bench skips it."""


def _llama_cpp() -> tuple[Any, Any]:
    """(``llama_cpp``, ``llama_cpp.llama_speculative``), or :class:`PeerUnavailable`."""
    try:
        lc = importlib.import_module("llama_cpp")
        spec = importlib.import_module("llama_cpp.llama_speculative")
    except ImportError:
        raise PeerUnavailable(_INSTALL_HINT) from None
    return lc, spec


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file starting with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == _GGUF_MAGIC


def context_size(prompt_lens: Iterable[int], max_new_tokens: int, num_pred_tokens: int) -> int:
    """A context that holds the longest prompt, the budget and one full draft past it."""
    longest = max(prompt_lens, default=0)
    need = longest + max_new_tokens + num_pred_tokens + 1
    return -(-need // 64) * 64


@dataclass(frozen=True)
class LlamaCppConfig:
    """How the llama.cpp peers are loaded."""

    model_path: str
    threads: int
    """``n_threads`` and ``n_threads_batch`` (the thread count our engine runs with)."""
    n_ctx: int
    """Context length (:func:`context_size`); a prompt plus budget beyond it is an error."""
    n_batch: int = 512
    num_pred_tokens: int = 10
    """Lookup draft length (llama-cpp-python's default)."""
    max_ngram_size: int = 2
    """Longest n-gram the lookup matches (llama-cpp-python's default)."""
    seed: int = 0
    """Fixed sampler seed (the greedy sampler draws nothing; set so no run is random)."""

    def __post_init__(self) -> None:
        for name in ("threads", "n_ctx", "n_batch", "num_pred_tokens", "max_ngram_size"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"llama.cpp peer {name} must be positive, got {getattr(self, name)}"
                )

    def llama_kwargs(self) -> dict[str, Any]:
        """The ``Llama(...)`` keyword arguments both peers share."""
        return dict(
            n_ctx=self.n_ctx,
            n_batch=self.n_batch,
            n_threads=self.threads,
            n_threads_batch=self.threads,
            seed=self.seed,
            logits_all=False,
            verbose=False,
        )


def bench_config(
    model_path: str, threads: int | None, prompt_lens: Iterable[int], max_new_tokens: int
) -> LlamaCppConfig:
    """The peers' config for a bench run; ``threads=None`` means the count torch runs with (what
    our engine then uses)."""
    import torch

    n = LlamaCppConfig.num_pred_tokens
    return LlamaCppConfig(
        model_path=model_path,
        threads=threads if threads is not None else torch.get_num_threads(),
        n_ctx=context_size(prompt_lens, max_new_tokens, n),
        num_pred_tokens=n,
    )


def greedy_tokens(
    llm: Any, prompt_ids: list[int], max_new_tokens: int, eos_ids: tuple[int, ...]
) -> list[int]:
    """``llm``'s greedy continuation of ``prompt_ids``, cut like our engine's plain decoding.

    At most ``max_new_tokens`` new tokens; the first EOS in ``eos_ids`` ends it and is kept;
    ``eos_ids=()`` never stops early.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    if max_new_tokens <= 0:
        return []
    if len(prompt_ids) + max_new_tokens > llm.n_ctx():
        raise ConfigError(
            f"a {len(prompt_ids)}-token prompt plus {max_new_tokens} new tokens exceeds the "
            f"llama.cpp peer's context of {llm.n_ctx()}"
        )
    eos = set(eos_ids)
    llm.reset()  # empty KV cache: no prefix reuse from the previous prompt
    gen: Iterator[int] = llm.generate(
        list(prompt_ids), temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True
    )
    out: list[int] = []
    try:
        for tok in gen:
            out.append(int(tok))
            if out[-1] in eos or len(out) >= max_new_tokens:
                break
    finally:
        close = getattr(gen, "close", None)
        if close is not None:
            close()
    return out


class LlamaCppGreedy:
    """llama.cpp plain greedy decoding (one token per decode call)."""

    name = LLAMACPP_PEER_NAMES[0]

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, eos_ids: tuple[int, ...]
    ) -> list[int]:
        return greedy_tokens(self.llm, prompt_ids, max_new_tokens, eos_ids)


class LlamaCppLookup(LlamaCppGreedy):
    """llama.cpp prompt lookup decoding (``llm`` was built with a lookup ``draft_model``)."""

    name = LLAMACPP_PEER_NAMES[1]


def make_llamacpp_peers(cfg: LlamaCppConfig) -> list[Peer]:
    """Load ``cfg.model_path`` twice (plain, lookup) and return both peers.

    :class:`PeerUnavailable` when llama-cpp-python is absent or the model is not a GGUF file.
    """
    if not is_gguf(cfg.model_path):
        raise PeerUnavailable(
            f"--peers llama.cpp needs a GGUF model file and {cfg.model_path} is not one: "
            "llama.cpp peers skipped"
        )
    lc, spec = _llama_cpp()
    kw = cfg.llama_kwargs()
    try:
        plain = lc.Llama(cfg.model_path, **kw)
        draft = spec.LlamaPromptLookupDecoding(
            max_ngram_size=cfg.max_ngram_size, num_pred_tokens=cfg.num_pred_tokens
        )
        lookup = lc.Llama(cfg.model_path, draft_model=draft, **kw)
    except (ValueError, RuntimeError) as e:
        raise PeerUnavailable(
            f"llama.cpp cannot load {cfg.model_path} ({e}): llama.cpp peers skipped"
        ) from None
    return [LlamaCppGreedy(plain), LlamaCppLookup(lookup)]
