"""Hugging Face model directories: read (config, safetensors weights, tokenizer) and write.

Layout: ``config.json``; weights as ``model.safetensors`` or shards named in
``model.safetensors.index.json`` (``weight_map``: parameter name -> shard file); ``tokenizer.json``
and ``tokenizer_config.json`` (see :mod:`specpilot.tokenizer`). The model is built on the meta
device and the loaded tensors are assigned into it (no random init, no extra copy), then the
embedding and LM head are tied when the config says so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from specpilot.config import ModelConfig
from specpilot.errors import ModelLoadError
from specpilot.model import Transformer
from specpilot.tokenizer import Tokenizer

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

#: Checkpoint entries that are not parameters of our model (recomputed buffers in old exports).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None
    if not isinstance(d, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return d


def read_config(path: Path) -> tuple[ModelConfig, dict[str, Any]]:
    """``ModelConfig`` and the raw dict of ``path/config.json`` (ConfigError if unsupported)."""
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise ModelLoadError(
            f"no {CONFIG_FILE} in {path}; pass a Hugging Face model directory or a .gguf file"
        )
    raw = _read_json(cfg_file)
    return ModelConfig.from_hf(raw), raw


def _eos_list(value: Any) -> list[int]:
    if isinstance(value, list):
        return [int(v) for v in value]
    return [] if value is None else [int(value)]


def read_tokenizer(path: Path, cfg: ModelConfig) -> Tokenizer:
    """The directory's tokenizer; its end-of-sequence ids also take those of config.json and
    generation_config.json (instruct models often list several there)."""
    extra = list(cfg.eos_token_ids)
    gen_file = path / GENERATION_CONFIG_FILE
    if gen_file.is_file():
        try:
            extra += _eos_list(_read_json(gen_file).get("eos_token_id"))
        except (TypeError, ValueError):
            raise ModelLoadError(f"{gen_file}: eos_token_id must be an int or a list") from None
    return Tokenizer.from_dir(path, extra_eos_ids=extra)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory, single-file or sharded."""
    single = path / WEIGHTS_FILE
    if single.is_file():
        return [single]
    index = path / WEIGHTS_INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shard files that are missing: {missing[:3]}")
        return files
    shards = sorted(path.glob("model-*-of-*.safetensors"))
    if shards:
        return shards
    raise ModelLoadError(
        f"no weights in {path}: expected {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} with shards "
        "(only safetensors checkpoints are supported)"
    )


def read_state_dict(files: list[Path], device: str | torch.device = "cpu") -> dict[str, Tensor]:
    state: dict[str, Tensor] = {}
    for f in files:
        try:
            part = load_file(str(f), device=str(device))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"corrupt or unreadable safetensors file {f}: {e}") from None
        dup = state.keys() & part.keys()
        if dup:
            raise ModelLoadError(f"tensor {sorted(dup)[0]!r} appears in more than one shard ({f})")
        state.update(part)
    return state


def build_model(
    cfg: ModelConfig,
    state: Mapping[str, Tensor],
    device: str | torch.device,
    dtype: torch.dtype,
    source: str,
) -> Transformer:
    """A ready Transformer holding ``state`` (eval mode, frozen, tied, on device/dtype).

    Checks names and shapes first so a mismatch is one readable ModelLoadError naming ``source``.
    """
    state = {k: v for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if (
        cfg.tie_embeddings
        and "lm_head.weight" not in state
        and "model.embed_tokens.weight" in state
    ):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} (e.g. {', '.join(missing[:4])})")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} (e.g. {', '.join(unexpected[:4])})")
        raise ModelLoadError(
            f"weights in {source} do not match the {cfg.arch} architecture of its config: "
            + "; ".join(parts)
        )
    for k, shape in expected.items():
        if tuple(state[k].shape) != shape:
            raise ModelLoadError(
                f"weights in {source}: {k} has shape {tuple(state[k].shape)}, "
                f"config implies {shape}"
            )
    converted = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(converted, strict=True, assign=True)
    model.tie_weights()
    model.eval()
    model.requires_grad_(False)
    return model


def load_hf_dir(
    path: Path, device: str | torch.device, dtype: torch.dtype
) -> tuple[Transformer, Tokenizer, ModelConfig]:
    cfg, _ = read_config(path)
    tokenizer = read_tokenizer(path, cfg)
    state = read_state_dict(weight_files(path), device=device)
    model = build_model(cfg, state, device, dtype, str(path))
    return model, tokenizer, cfg


def save_hf_dir(
    path: str | Path,
    cfg: ModelConfig,
    state: Mapping[str, Tensor],
    tokenizer: Tokenizer | None = None,
    max_shard_bytes: int | None = None,
    extra_config: Mapping[str, Any] | None = None,
) -> None:
    """Write a Hugging Face model directory (``path`` must exist).

    Tied LM heads are not stored (the HF convention). With ``max_shard_bytes`` the weights are
    split into ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``.
    """
    path = Path(path)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    if cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    config = cfg.to_hf()
    config["torch_dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    config.update(extra_config or {})
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if tokenizer is not None:
        tokenizer.save(path)
    meta = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(tensors, str(path / WEIGHTS_FILE), metadata=meta)
        return
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata=meta)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / WEIGHTS_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
