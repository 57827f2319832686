"""The goodput cost curve, measured once per machine, model and plan, and kept on disk.

:func:`measure_verify_curve` is the one measurement both engines run (``Engine`` and
``BatchEngine`` through :func:`selector_curve`): verify forwards of one sequence, a chain tree of
``r - 1`` nodes over ``c`` cached tokens, at r = 1 .. 64 rows (``CALIBRATION_ROWS``; best of 3
after a warm-up; :func:`specpilot.goodput.calibration_shape`,
:func:`specpilot.goodput.calibrate_curve`).

:func:`selector_curve` keeps the curve in ``goodput.json`` under
:func:`specpilot.machine.cache_root` (the parent of ``$SPECPILOT_CACHE``, else
``~/.cache/specpilot``), keyed by :func:`curve_key`:

* the machine: CPU model, ISA flags and torch threads (a GPU: its name), torch version;
* the model: :func:`model_fingerprint`, a hash of its config and of every module's type, kernel
  settings (public scalar attributes and ``extra_repr``: GGUF block types, ISA, tiling) and
  tensor shapes and dtypes, plus its weights mode (fp32 / ``native``, with the loaded kernel
  library's build key), numerics profile
  (``Transformer.set_numerics``), linear backend (oneDNN-prepacked or not) and ``torch.compile``
  state: a plan that changes kernels gets a new curve;
* the attention kind, the calibration shape (cached tokens, row counts) and :data:`CURVE_VERSION`.

A curve is cached only when measured on a quiet machine (other processes' load, sampled with
:func:`specpilot.machine.sample_load`, at most :func:`specpilot.machine.load_limit` cores); a busy
measurement is used for this run only, or, where a quiet one is cached, that one is kept. A
corrupt file or an entry of another version is ignored and rewritten, never an error. Measuring
anew: ``EngineConfig.goodput_recalibrate`` or the environment variable
``SPECPILOT_GOODPUT_RECALIBRATE=1`` (a quiet re-measurement replaces the cached curve).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from specpilot.errors import ConfigError
from specpilot.goodput.cost import CostCurve, calibrate_curve, calibration_shape
from specpilot.kernels import build
from specpilot.kernels.linear import ISA_ENV
from specpilot.kvcache import KVCache
from specpilot.machine import cache_root, cpu_isa, cpu_model, load_limit, sample_load
from specpilot.model import Transformer
from specpilot.tree import DraftTree
from specpilot.verify import VerifyRow, build_inputs, forward

CURVE_VERSION = 3
"""Bump when the measurement changes; entries of other versions are ignored."""
CURVE_FILE = "goodput.json"
RECALIBRATE_ENV = "SPECPILOT_GOODPUT_RECALIBRATE"
LOAD_SAMPLE_S = 0.1
"""Shortest window over which other processes' load is sampled during a measurement."""
_TRANSIENT = frozenset({"training", "max_len", "batch", "attention", "exact"})
"""Module attributes that are run state (cache size, train mode), not kernels."""


@dataclass(frozen=True)
class MeasuredCurve:
    """A cost curve and where it came from."""

    curve: CostCurve
    source: str
    """"measured", "cached", "measured, not cached (...)" or "cached (...)"."""
    load: float | None = None
    """Other processes' CPU cores during the measurement (None: unknown or cached)."""


def curve_path() -> Path:
    return cache_root() / CURVE_FILE


# -- the measurement ------------------------------------------------------------------------


def measure_verify_curve(
    model: Transformer,
    context: int,
    rows: tuple[int, ...],
    cache_rows: slice | None = None,
    repeats: int = 5,
) -> CostCurve:
    """Verify step seconds of one sequence with ``context`` cached tokens at each of ``rows``
    (the cache must hold ``context + rows[-1] + 1`` slots; ``cache_rows``: the batch row)."""
    width, dev = rows[-1], model.device

    def step(r: int) -> None:
        tree = DraftTree.chain([0] * (r - 1))
        inputs = build_inputs([VerifyRow(0, context, tree)], dev, context + width)
        forward(model, inputs, cache_rows=cache_rows)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    with torch.no_grad():
        return calibrate_curve(step, rows, repeats)


# -- the key ----------------------------------------------------------------------------------


def _tensors(mod: nn.Module) -> Iterator[tuple[str, Tensor]]:
    yield from mod.named_parameters(recurse=False)
    yield from mod.named_buffers(recurse=False)
    for k, v in vars(mod).items():  # tensors kept as plain attributes (prepacked weights)
        if isinstance(v, Tensor) and not k.startswith("_"):
            yield k, v


def _scalar(v: object) -> bool:
    if isinstance(v, tuple):
        return all(_scalar(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, str))


def model_fingerprint(model: nn.Module) -> str:
    """Hash of the model's config and, per module, its type, kernel settings (public scalar
    attributes, ``extra_repr``) and tensor shapes and dtypes: equal for two loads of one model
    in one mode, different when weights mode, linear backend, compile or a kernel option
    differs."""
    h = hashlib.sha256(repr(getattr(model, "cfg", None)).encode())
    for name, mod in model.named_modules():
        if isinstance(mod, KVCache):  # the cache's size is run state, not a kernel
            continue
        settings = sorted(
            (k, v)
            for k, v in vars(mod).items()
            if not k.startswith("_") and k not in _TRANSIENT and _scalar(v)
        )
        h.update(f"{name}|{type(mod).__name__}|{mod.extra_repr()}|{settings}".encode())
        for tname, t in _tensors(mod):
            h.update(f"{tname}:{tuple(t.shape)}:{t.dtype}".encode())
    return h.hexdigest()[:20]


def machine_key(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}|torch={torch.__version__}"
    threads = torch.get_num_threads()
    return f"{cpu_model()}|{cpu_isa()}|threads={threads}|torch={torch.__version__}"


def curve_key(model: Transformer, attention: str, context: int, rows: tuple[int, ...]) -> str:
    """The cache key of a curve (see the module docstring); readable up to the model's hash."""
    weights = "native" if model.native else str(model.dtype).replace("torch.", "")
    linear = "onednn" if model.prepacked else "torch"
    numerics = getattr(model, "_numerics", "fp32")  # Transformer.set_numerics
    if model.native:  # a rebuilt kernel library (new sources or flags), or another ISA path
        # forced by $SPECPILOT_KERNELS_ISA, has a new speed
        weights += f"|kernels={build.loaded_key()}|isa={os.environ.get(ISA_ENV, 'auto')}"
    return (
        f"{machine_key(model.device)}|model={model_fingerprint(model)}|weights={weights}|"
        f"numerics={numerics}|linear={linear}|compiled={model.compiled}|attention={attention}|"
        f"context={context}|rows={','.join(map(str, rows))}|v{CURVE_VERSION}"
    )


# -- the cache -------------------------------------------------------------------------------


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _store(path: Path, key: str, entry: dict[str, Any]) -> None:
    """Atomic read-modify-write; a cache that cannot be written is skipped silently."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load(path)
        data[key] = entry
        fd, tmp = tempfile.mkstemp(prefix=".goodput.", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        return


def _valid(entry: object, rows: tuple[int, ...]) -> CostCurve | None:
    if not isinstance(entry, dict) or entry.get("version") != CURVE_VERSION:
        return None
    xs, ys = entry.get("rows"), entry.get("seconds")
    if not isinstance(xs, list) or tuple(xs) != rows or not isinstance(ys, list):
        return None
    if not all(isinstance(y, (int, float)) and 0 < y < 1e4 for y in ys):
        return None
    try:
        return CostCurve(list(xs), [float(y) for y in ys])
    except ConfigError:
        return None


def recalibrate_requested(flag: bool = False) -> bool:
    """``flag`` or ``$SPECPILOT_GOODPUT_RECALIBRATE`` set to 1/true/yes."""
    env = os.environ.get(RECALIBRATE_ENV, "").strip().lower()
    return flag or env in ("1", "true", "yes")


def cached_curve(
    key: str,
    rows: tuple[int, ...],
    measure: Callable[[], CostCurve],
    recalibrate: bool = False,
    path: Path | None = None,
) -> MeasuredCurve:
    """The curve cached under ``key``, else ``measure()`` (cached when the machine was quiet;
    see the module docstring)."""
    path = path or curve_path()
    cached = _valid(_load(path).get(key), rows)
    if cached is not None and not recalibrate_requested(recalibrate):
        return MeasuredCurve(cached, "cached")
    curve, load = sample_load(measure, LOAD_SAMPLE_S)
    limit = load_limit()
    if load is None or load <= limit:
        entry = {
            "version": CURVE_VERSION,
            "rows": list(curve.rows),
            "seconds": list(curve.seconds),
            "measured_at": time.time(),
            "load": load,
        }
        _store(path, key, entry)
        return MeasuredCurve(curve, "measured", load)
    busy = f"other processes used {load:.2f} CPU cores, limit {limit:.2f}"
    if cached is not None:
        return MeasuredCurve(cached, f"cached (a re-measurement while {busy} was not kept)", load)
    return MeasuredCurve(curve, f"measured, not cached ({busy})", load)


def selector_curve(
    model: Transformer,
    slots: int,
    attention: str,
    max_rows: int = 64,
    cache_rows: slice | None = None,
    prepare: Callable[[int], None] | None = None,
    recalibrate: bool = False,
) -> MeasuredCurve:
    """The cost curve for a goodput selector on ``model`` in a cache of ``slots`` slots per
    sequence: cached for this machine, model and plan, else measured (``prepare(n)`` first makes
    the cache hold ``n`` slots; ``cache_rows``: the batch row the forwards use)."""
    context, rows = calibration_shape(slots, max_rows)
    key = curve_key(model, attention, context, rows)

    def measure() -> CostCurve:
        if prepare is not None:
            prepare(context + rows[-1] + 1)
        return measure_verify_curve(model, context, rows, cache_rows)

    return cached_curve(key, rows, measure, recalibrate)
