"""Hugging Face transformers as a peer: plain greedy, prompt lookup and assisted generation.

The reference implementation users know (``model.generate``), run on the same weights as our
engine. :func:`build_hf_model` turns our config and state dict into the equivalent HF model (our
parameter names are HF's); :func:`hf_model_from_dir` loads an HF checkpoint directory.

Each peer calls ``generate`` with an explicit, fully specified greedy :class:`GenerationConfig`
and, for the duration of the call, a blank ``model.generation_config``: HF fills every unset
field from the model's loaded ``generation_config.json`` (repetition penalty, min length, extra
EOS ids, suppressed tokens), which would silently change the output being compared.

Modes (HF docs, "Generation strategies"): ``prompt_lookup_num_tokens`` (n-gram drafts from the
prompt, Saxena 2023) and ``assistant_model`` (a small draft model, Leviathan et al. 2023). Both
are greedy-lossless up to kernel numerics. ``transformers`` is imported lazily; without it every
entry point raises :class:`SpecPilotError` saying how to install it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from specpilot.config import ModelConfig
from specpilot.errors import ConfigError, ModelLoadError, SpecPilotError

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel

#: Short peer names accepted by :func:`make_hf_peers` (``--peers hf`` uses the default pair).
PEER_NAMES = ("greedy", "prompt-lookup", "assisted")

_INSTALL_HINT = "--peers hf needs Hugging Face transformers: pip install 'specpilot[hf]'"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise SpecPilotError(_INSTALL_HINT) from None
    return transformers


def build_hf_model(cfg: ModelConfig, state_dict: Mapping[str, Tensor]) -> PreTrainedModel:
    """The HF ``*ForCausalLM`` equivalent of our :class:`~specpilot.model.Transformer` (fp32, eval).

    ``state_dict`` is ``Transformer.state_dict()`` taken before ``prepack()``. With tied embeddings
    ``lm_head.weight`` may be absent (it is then the embedding) or present (it must equal it).
    """
    tf = _transformers()
    sd = dict(state_dict)
    emb_key, head_key = "model.embed_tokens.weight", "lm_head.weight"
    if cfg.tie_embeddings and emb_key in sd:
        head = sd.get(head_key)
        if head is None:
            sd[head_key] = sd[emb_key]
        elif not torch.equal(head, sd[emb_key]):
            raise ValueError(
                "tie_embeddings is set but lm_head.weight differs from model.embed_tokens.weight"
            )
    hf_cfg = tf.AutoConfig.for_model(**cfg.to_hf())
    model = tf.AutoModelForCausalLM.from_config(
        hf_cfg, attn_implementation="sdpa", dtype=torch.float32
    )
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise ValueError(
            f"state dict does not match the HF {cfg.arch} model (take it before prepack()): {e}"
        ) from None
    return model.to(torch.float32).eval()


def hf_model_from_dir(path: str | Path) -> PreTrainedModel:
    """Load an HF checkpoint directory (``config.json`` + weights) as an fp32 eval model."""
    tf = _transformers()
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"{p} is not a Hugging Face model directory (no config.json)")
    try:
        model = tf.AutoModelForCausalLM.from_pretrained(
            p, dtype=torch.float32, attn_implementation="sdpa"
        )
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the Hugging Face model at {p}: {e}") from None
    return model.eval()


@runtime_checkable
class Peer(Protocol):
    """Another engine's greedy generation for one prompt (batch 1)."""

    name: str

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, eos_ids: tuple[int, ...]
    ) -> list[int]:
        """New tokens only, at most ``max_new_tokens``; ends with the first EOS if one is produced.

        ``eos_ids=()`` never stops early.
        """
        ...


def _greedy_config(max_new_tokens: int, eos_ids: tuple[int, ...], **extra: Any) -> GenerationConfig:
    """A greedy config with every field that could alter the tokens set explicitly."""
    tf = _transformers()
    return tf.GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        min_length=0,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        eos_token_id=list(eos_ids) if eos_ids else None,
        pad_token_id=eos_ids[0] if eos_ids else 0,
        use_cache=True,
        **extra,
    )


@contextlib.contextmanager
def _generation_defaults(*pairs: tuple[PreTrainedModel, GenerationConfig]) -> Iterator[None]:
    """Swap in each paired ``generation_config`` (HF's fallback for unset fields) for a call."""
    saved = [(m, m.generation_config) for m, _ in pairs]
    try:
        for m, gc in pairs:
            m.generation_config = gc
        yield
    finally:
        for m, gc in saved:
            m.generation_config = gc


def _run_generate(
    model: PreTrainedModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_ids: tuple[int, ...],
    gen_cfg: GenerationConfig,
    assistant: tuple[PreTrainedModel, GenerationConfig] | None = None,
) -> list[int]:
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    if max_new_tokens <= 0:
        return []
    tf = _transformers()
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)  # (1, T)
    pairs = [(model, tf.GenerationConfig())]
    kwargs: dict[str, Any] = {}
    if assistant is not None:
        pairs.append(assistant)
        kwargs["assistant_model"] = assistant[0]
    with _generation_defaults(*pairs), torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=gen_cfg,
            **kwargs,
        )
    new = out[0, len(prompt_ids) :].tolist()[:max_new_tokens]
    # Speculative modes can accept several tokens past an EOS in one step; cut like plain greedy.
    for i, t in enumerate(new):
        if t in eos_ids:
            return new[: i + 1]
    return new


class HFGreedy:
    """``model.generate`` plain greedy decoding with the KV cache."""

    name = "hf-greedy"

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, eos_ids: tuple[int, ...]
    ) -> list[int]:
        cfg = _greedy_config(max_new_tokens, eos_ids)
        return _run_generate(self.model, prompt_ids, max_new_tokens, eos_ids, cfg)


class HFPromptLookup:
    """HF prompt lookup decoding: drafts up to ``n`` tokens copied after a matching n-gram."""

    name = "hf-prompt-lookup"

    def __init__(self, model: PreTrainedModel, n: int = 10) -> None:
        if n < 1:
            raise ConfigError(f"prompt lookup needs at least 1 draft token, got {n}")
        self.model, self.n = model, n

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, eos_ids: tuple[int, ...]
    ) -> list[int]:
        cfg = _greedy_config(max_new_tokens, eos_ids, prompt_lookup_num_tokens=self.n)
        return _run_generate(self.model, prompt_ids, max_new_tokens, eos_ids, cfg)


class HFAssisted:
    """HF assisted generation with a draft model sharing the target's tokenizer.

    ``num_assistant_tokens`` and ``schedule`` are HF's knobs (HF defaults: 20, "constant"); with
    "heuristic" the draft length carries over between calls, as in HF.
    """

    name = "hf-assisted"

    def __init__(
        self,
        model: PreTrainedModel,
        draft_model: PreTrainedModel,
        num_assistant_tokens: int = 20,
        schedule: str = "constant",
    ) -> None:
        if schedule not in ("constant", "heuristic", "heuristic_transient"):
            raise ConfigError(
                f"assistant schedule must be constant, heuristic or heuristic_transient, "
                f"got {schedule!r}"
            )
        if draft_model.config.vocab_size != model.config.vocab_size:
            raise ConfigError(
                f"draft model vocabulary ({draft_model.config.vocab_size}) differs from the "
                f"target's ({model.config.vocab_size}); assisted generation needs one tokenizer"
            )
        tf = _transformers()
        self.model, self.draft_model = model, draft_model
        self._draft_defaults = tf.GenerationConfig(
            num_assistant_tokens=num_assistant_tokens, num_assistant_tokens_schedule=schedule
        )

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, eos_ids: tuple[int, ...]
    ) -> list[int]:
        cfg = _greedy_config(max_new_tokens, eos_ids)
        return _run_generate(
            self.model,
            prompt_ids,
            max_new_tokens,
            eos_ids,
            cfg,
            assistant=(self.draft_model, self._draft_defaults),
        )


def make_hf_peers(
    hf_model: PreTrainedModel,
    names: Sequence[str] = ("greedy", "prompt-lookup"),
    draft: PreTrainedModel | None = None,
) -> list[Peer]:
    """Peers by short name (:data:`PEER_NAMES`); "assisted" needs ``draft``."""
    peers: list[Peer] = []
    for name in names:
        if name == "greedy":
            peers.append(HFGreedy(hf_model))
        elif name == "prompt-lookup":
            peers.append(HFPromptLookup(hf_model))
        elif name == "assisted":
            if draft is None:
                raise ConfigError("the hf assisted peer needs a draft model; pass draft=")
            peers.append(HFAssisted(hf_model, draft))
        else:
            raise ConfigError(f"unknown hf peer {name!r}; choose from {', '.join(PEER_NAMES)}")
    return peers
