"""Trained drafter directories: save, load, and check against the target.

A drafter directory holds

* ``config.json``          - :class:`FeatureNetConfig` (kind, hidden size, vocabulary size, tapped
  layers, draft vocabulary size, ...) with the target's fingerprint in ``extra``;
* ``model.safetensors``    - the drafter's own weights and ``vocab_ids`` (the reduced output
  vocabulary, FR-Spec); never the target's embedding or LM head, which are shared at load time;
* ``training_record.json`` - how it was made (command, data, target, wall time, machine, figures).

Directories are written next to their final place and renamed into it, so a reader never finds a
half-written drafter where a finished one was (:func:`write_dir_atomic`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from specpilot import kernels
from specpilot.drafters.feature_net import FeatureNet, FeatureNetConfig
from specpilot.drafters.head import FeatureDrafter, HeadDrafter
from specpilot.errors import DrafterError
from specpilot.model import Transformer

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
RECORD = "training_record.json"


def is_drafter_dir(spec: str | Path) -> bool:
    p = Path(spec).expanduser()
    return p.is_dir() and (p / CONFIG).is_file()


def write_dir_atomic(final: Path, write: Callable[[Path], None]) -> Path:
    """Create or replace directory ``final`` with what ``write(tmp_dir)`` puts in a sibling.

    The old directory (if any) stays intact until the new one is complete; an interruption leaves
    either the old or the new directory at ``final`` plus at most a hidden ``.tmp`` sibling.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    old: Path | None = None
    try:
        tmp.chmod(0o755)
        write(tmp)
        if final.exists():
            old = final.parent / f".{final.name}.{os.getpid()}.old"
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and old.exists():
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
            else:  # the swap failed half-way: put the old drafter back
                os.replace(old, final)
    return final


def save_drafter(
    net: FeatureNet, out: str | Path, record: dict[str, Any], dtype: torch.dtype = torch.float16
) -> Path:
    """Write ``net`` (weights in ``dtype``) and its training record to directory ``out``."""
    state = {
        k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
        for k, v in net.state_dict().items()
    }

    def write(tmp: Path) -> None:
        (tmp / CONFIG).write_text(json.dumps(net.cfg.to_json(), indent=2) + "\n")
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / RECORD).write_text(json.dumps(record, indent=2, default=str) + "\n")
        for f in tmp.iterdir():
            f.chmod(0o644)

    return write_dir_atomic(Path(out), write)


def read_drafter_dir(path: str | Path) -> tuple[FeatureNetConfig, dict[str, torch.Tensor]]:
    """Config and weights of a drafter directory; DrafterError says what is wrong."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise DrafterError(f"drafter directory not found: {p}")
    for name in (CONFIG, WEIGHTS):
        if not (p / name).is_file():
            raise DrafterError(
                f"{p} is not a complete drafter directory: {name} is missing; "
                "retrain it with specpilot train-drafter"
            )
    try:
        raw = json.loads((p / CONFIG).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DrafterError(f"{p / CONFIG} is corrupt ({e}); retrain the drafter") from None
    if not isinstance(raw, dict):
        raise DrafterError(f"{p / CONFIG} must hold a JSON object; retrain the drafter")
    cfg = FeatureNetConfig.from_json(raw)
    try:
        state = load_file(str(p / WEIGHTS))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise DrafterError(f"{p / WEIGHTS} is corrupt ({e}); retrain the drafter") from None
    return cfg, state


def build_net(cfg: FeatureNetConfig, state: dict[str, torch.Tensor], source: str) -> FeatureNet:
    """A FeatureNet with ``state`` loaded (fp32); DrafterError if the weights do not fit.

    The module is built on the meta device (no random init the load would overwrite: it was
    most of a per-request build) and takes ``state``'s tensors as its parameters (``assign``);
    they are copied only where the dtype differs, so ``state`` must not be reused for another
    net that is trained."""
    with torch.device("meta"):
        net = FeatureNet(cfg)
    want = net.state_dict()
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want))
    bad = [k for k in want if k in state and tuple(state[k].shape) != tuple(want[k].shape)]
    if missing or extra or bad:
        raise DrafterError(
            f"{source}: weights do not match config.json (missing {missing[:3]}, unexpected "
            f"{extra[:3]}, wrong shape {bad[:3]}); the directory is corrupt - retrain it"
        )
    net.load_state_dict({k: v.to(want[k].dtype) for k, v in state.items()}, assign=True)
    ids = net.vocab_ids
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size):
        raise DrafterError(f"{source}: draft vocabulary ids out of range; retrain the drafter")
    return net


def check_target(cfg: FeatureNetConfig, model: Transformer, fingerprint: str | None, src: str):
    """Raise DrafterError unless the drafter was made for this target."""
    tc = model.cfg
    if cfg.dim != tc.dim:
        raise DrafterError(
            f"drafter {src} was trained for hidden size {cfg.dim}, the target has {tc.dim}; "
            "train one for this target with specpilot train-drafter --target MODEL"
        )
    if cfg.vocab_size != tc.vocab_size:
        raise DrafterError(
            f"drafter {src} was trained for a {cfg.vocab_size}-token vocabulary, the target has "
            f"{tc.vocab_size}; train one for this target with specpilot train-drafter"
        )
    if max(cfg.taps) > tc.n_layers:
        raise DrafterError(
            f"drafter {src} taps layer {max(cfg.taps)} but the target has {tc.n_layers} layers"
        )
    want = cfg.extra.get("target_fingerprint")
    if fingerprint is not None and want and want != fingerprint:
        raise DrafterError(
            f"drafter {src} was trained for another target (fingerprint {want[:12]}, this target "
            f"is {fingerprint[:12]}); train one for it with specpilot train-drafter"
        )


def shared_tables(model: Transformer) -> tuple[Tensor | nn.Module, Tensor | nn.Module]:
    """The target's embedding and LM head as a drafter shares them: its native GGUF modules
    where it has them (used in place, no fp32 copy), else the dense (vocab, dim) tensors."""
    emb = model.model.embed_tokens
    head = model.lm_head
    embed = emb if isinstance(emb, kernels.GGUFEmbedding) else emb.weight
    native_head = isinstance(head, kernels.GGUFLinear) and not model.prepacked
    return embed, head if native_head else model.head_weight()


_NETS: weakref.WeakKeyDictionary[Transformer, dict[tuple[Any, ...], FeatureNet]] = (
    weakref.WeakKeyDictionary()
)
"""Loaded nets per target model: a drafter per request (the server, batched runs) reuses the
read, checked, attached and packed net; only its per-sequence cache is new. Keyed by the
directory and its files' size and mtime, and the target's device, dtype and prepacking."""


def _loaded_net(path: str | Path, model: Transformer, fingerprint: str | None) -> FeatureNet:
    """The net of drafter directory ``path`` for ``model`` (read once per model and files; see
    :data:`_NETS`). Nets are inference-only: nothing trains a net loaded here."""
    p = Path(path).expanduser()
    try:
        stats = [(p / name).stat() for name in (CONFIG, WEIGHTS)]
    except OSError:
        stats = None  # read_drafter_dir says what is missing
    stamp = None if stats is None else tuple((st.st_size, st.st_mtime_ns) for st in stats)
    where = str(p.resolve())
    key = (where, stamp, fingerprint, model.device, model.dtype, model.prepacked)
    nets = _NETS.setdefault(model, {})
    if stamp is not None and key in nets:
        return nets[key]
    cfg, state = read_drafter_dir(p)
    src = str(path)
    check_target(cfg, model, fingerprint, src)
    net = build_net(cfg, state, src).to(device=model.device, dtype=model.dtype)
    net.attach(*shared_tables(model))
    if stamp is not None:
        for old in [k for k in nets if k[0] == where]:  # replaced files, another layout
            del nets[old]
        nets[key] = net
    return net


def load_trained_drafter(
    path: str | Path,
    target: Any,
    fingerprint: str | None = None,
    max_len: int = 8192,
    min_prob: float = 0.0,
) -> FeatureDrafter:
    """Load a drafter directory for ``target`` (a LoadedModel or a Transformer) and share its
    embedding and LM head (a native target's in place: :func:`shared_tables`). ``fingerprint``
    defaults to the LoadedModel's; ``min_prob``: see
    :class:`~specpilot.drafters.head.FeatureDrafter` (head drafters only)."""
    from specpilot.drafters.block import BlockDrafter

    model = target if isinstance(target, Transformer) else getattr(target, "model", None)
    if not isinstance(model, Transformer):
        raise DrafterError("a trained drafter needs the target model (a specpilot Transformer)")
    fingerprint = fingerprint or getattr(target, "fingerprint", None)
    net = _loaded_net(path, model, fingerprint)
    cfg = net.cfg
    if cfg.kind == "block":
        if min_prob:
            raise DrafterError("min_prob applies to head drafters (a block drafts in one forward)")
        return BlockDrafter(net, max_len=max_len)
    return HeadDrafter(net, max_len=max_len, min_prob=min_prob)


def shipped_drafters() -> list[Path]:
    """Drafter directories shipped inside the package (``specpilot/data/drafters/*``)."""
    from importlib import resources

    root = Path(str(resources.files("specpilot").joinpath("data", "drafters")))
    return sorted(p for p in root.glob("*") if is_drafter_dir(p)) if root.is_dir() else []


def shipped_drafter(target: Any, kind: str = "head") -> Path:
    """The shipped drafter of ``kind`` trained for ``target`` (matched by fingerprint)."""
    fingerprint = getattr(target, "fingerprint", None)
    for p in shipped_drafters():
        try:
            cfg = FeatureNetConfig.from_json(json.loads((p / CONFIG).read_text()))
        except (DrafterError, json.JSONDecodeError, OSError):
            continue
        if cfg.kind == kind and fingerprint and cfg.extra.get("target_fingerprint") == fingerprint:
            return p
    raise DrafterError(
        f"no {kind} drafter ships for this target; train one with specpilot train-drafter "
        f"--target MODEL --kind {kind} --out DIR and pass --drafter DIR"
    )
