"""Where a training run writes: the ``--out`` checks made before any work, and the final save.

A drafter directory at ``out`` is replaced by the new drafter (that is what retraining means);
anything else there (a user's directory, a file, a drafter directory holding other files) is
refused unless ``overwrite``, and then kept: the new drafter is written next to it, and only once
it is complete is the old one moved aside to ``NAME.old-<time>`` (:func:`save_output`).
``--resume`` needs the run's work directory (``.<out>.work``) with its ``state.json``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from specpilot.drafters.feature_net import KINDS, FeatureNet
from specpilot.drafters.trained import CONFIG, RECORD, WEIGHTS, save_drafter
from specpilot.errors import ConfigError
from specpilot.outpaths import check_output_path, move_aside


def work_dir(out: Path) -> Path:
    """The run's work directory (data shards, checkpoint, state) next to ``out``."""
    return out.parent / f".{out.name}.work"


def is_drafter_output(p: Path) -> bool:
    """``p`` is a directory a train-drafter run may replace: empty, or holding only a drafter's
    own files with a drafter ``config.json`` (so nothing of the user's would be lost)."""
    if not p.is_dir() or p.is_symlink():
        return False
    names = {c.name for c in p.iterdir()}
    if not names:
        return True
    if not names <= {CONFIG, WEIGHTS, RECORD} or CONFIG not in names:
        return False
    try:
        cfg = json.loads((p / CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and cfg.get("kind") in KINDS and "taps" in cfg


def check_out(out: str | Path, *, overwrite: bool = False, resume: bool = False) -> Path:
    """The absolute output path, after the checks every run makes before any work (see the
    module docstring); ConfigError otherwise."""
    p = check_output_path(
        out,
        "--out",
        kind="dir",
        overwrite=overwrite,
        reusable=is_drafter_output,
        what="a drafter directory",
    )
    p = p.resolve()
    if resume and not (work_dir(p) / "state.json").is_file():
        raise ConfigError(
            f"--resume: nothing to resume for --out {out} (no {work_dir(p)}/state.json); "
            "drop --resume to start a new run"
        )
    return p


def check_taps(taps: tuple[int, ...], n_layers: int) -> None:
    """Tapped layers must be states the target has: 0..n_layers (n_layers = the final one)."""
    bad = [t for t in taps if not 0 <= t <= n_layers]
    if bad:
        raise ConfigError(
            f"--taps {','.join(map(str, taps))}: the target has {n_layers} layers, so taps "
            f"must be in 0..{n_layers} ({n_layers} = the final normed state); {bad[0]} is not"
        )
    if len(set(taps)) != len(taps):
        raise ConfigError(f"--taps {','.join(map(str, taps))}: a layer is tapped twice")


def save_output(net: FeatureNet, out: Path, record: dict[str, Any]) -> Path | None:
    """Save the drafter to ``out``; where the old content of ``out`` was moved (None if there
    was none, or it was a drafter directory, which is replaced)."""
    if not (out.exists() or out.is_symlink()) or is_drafter_output(out):
        save_drafter(net, out, record)
        return None
    stage = out.parent / f".{out.name}.new"
    if stage.exists():
        shutil.rmtree(stage)
    save_drafter(net, stage, record)
    aside = move_aside(out)
    try:
        os.replace(stage, out)
    except OSError:
        os.replace(aside, out)  # put the old one back; the new drafter stays in stage
        raise
    return aside
