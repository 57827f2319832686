"""Where a training run writes: the ``--out`` checks made before any work, and the final save.

A drafter directory at ``out`` is replaced by the new drafter (that is what retraining means);
anything else there (a user's directory, a file, a drafter directory holding other files) is
refused unless ``overwrite``, and then kept: the new drafter is written next to it, and only once
it is complete is the old one moved aside to ``NAME.old-<time>`` (:func:`save_output`).
``--resume`` needs the run's work directory (``.<out>.work``) with its ``state.json``.
:func:`training_record` is the ``training_record.json`` saved with the drafter.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
from pathlib import Path
from typing import Any

import torch

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


def training_record(
    loaded: Any,
    config: dict[str, Any],
    command: str,
    st: Any,
    data: tuple[list[Any], list[Any], list[Any]],
    steps: int,
    train_s: float,
    final: dict[str, float],
) -> dict[str, Any]:
    """The drafter's training record: how it was made (command, config, data, machine, figures);
    ``st`` is the run's state (``.d`` and ``.wall()``), ``data`` (train prompts, held-out
    prompts, sequences)."""
    train_p, eval_p, seqs = data
    return {
        "command": command,
        "config": config,
        "data": {
            "sources": list(config["sources"]),
            "train_prompts": len(train_p),
            "prompts_generated": st.d.get("next_prompt", 0),
            "eval_prompt_ids": [p.id for p in eval_p],
            "sequences": len(seqs),
            "tokens": sum(len(s.tokens) for s in seqs),
            "disjoint_from": ["humaneval", "chat"],
            "features": st.d.get("features"),
        },
        "target": {"source": loaded.source, "fingerprint": loaded.fingerprint},
        "wall_s": round(st.wall(), 1),  # every run of this work directory
        "train_s": round(train_s, 1),
        "gen_s": round(st.d.get("gen_s", 0.0), 1),
        "steps": steps,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "eval_init": st.d["eval_init"],
        "eval_final": final,
    }
