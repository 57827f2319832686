"""Distillation of a trained drafter from its target: data, training loop, checkpoints, evaluation.

Phases (each resumable from the work directory next to the output, ``.<out>.work``):
  1. data     - the target's greedy continuations of training prompts, generated in batches, and
                teacher-forced text; hidden states of the tapped layers and the final normed
                state are stored in fp16 shards (``data/shard_*.safetensors``);
  2. vocab    - the draft vocabulary: the ``draft_vocab`` most frequent tokens of the data
                (FR-Spec, Zhao et al. 2025);
  3. train    - KL divergence from the target's next-token distribution (over the draft
                vocabulary) to the drafter's; the head is unrolled ``unroll`` steps deep
                (EAGLE-3's training-time test), the block drafter predicts whole blocks;
                checkpoint every ``checkpoint_s`` seconds (``ckpt.pt``, replaced atomically);
  4. evaluate - tau (mean tokens per step) on held-out prompts through the engine with a dynamic
                tree of ``eval_budget`` nodes, before and after training;
  5. save     - the drafter directory, written next to ``out`` and renamed into place.
Library code never prints: ``progress(phase, done, total, info)`` reports.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specpilot.drafters.feature_net import FeatureNet, FeatureNetConfig
from specpilot.errors import ConfigError, WorkloadError
from specpilot.training import data as D
from specpilot.training.evaluate import evaluate
from specpilot.training.features import (
    Sequence,
    feature_format,
    generate_batch,
    load_shard,
    save_shard,
    teacher_forced,
)
from specpilot.training.output import (
    check_out,
    check_taps,
    save_output,
    training_record,
    work_dir,
)

Progress = Callable[[str, float, float, dict[str, float]], None]


@dataclass(frozen=True)
class TrainConfig:
    """Everything that shapes a training run (recorded in the drafter's training record)."""

    kind: str = "head"
    sources: tuple[str, ...] = ("code", "chat", "text")
    minutes: float = 20.0
    """Wall-clock budget of the training loop (phase 3)."""
    gen_minutes: float = 10.0
    """Wall-clock budget of greedy-continuation generation (phase 1)."""
    max_new_tokens: int = 128
    gen_batch: int = 32
    max_prompt_tokens: int = 384
    text_tokens: int = 40_000
    """Teacher-forced text tokens (0 = none)."""
    text_window: int = 256
    max_prompts: int | None = None
    seq_len: int = 256
    batch: int = 8
    unroll: int = 6
    block: int = 8
    n_layers: int = 0
    """0 = 1 for the head, 2 for the block drafter."""
    lr: float = 1e-3
    loss_share: float = 1.0
    """Head: share of anchors whose logits enter the loss per step (the LM head dominates)."""
    ffn: int = 0
    """Drafter MLP width (0 = the target's)."""
    draft_vocab: int = 8192
    taps: tuple[int, ...] = ()
    """() = low / mid / final layers of the target."""
    tap_norm: str = "auto"
    """RMS-normalize each tap before the fuse: on / off / auto (on when the target's tapped
    states differ in scale by more than 32x, as Gemma 3's; fixed per work directory)."""
    eval_prompts: int = 16
    eval_tokens: int = 64
    eval_budget: int = 32
    seed: int = 0
    checkpoint_s: float = 60.0
    max_steps: int | None = None
    """Stop after this many optimizer steps (tests); None = the time budget only."""

    def __post_init__(self) -> None:
        if self.kind not in ("head", "block"):
            raise ConfigError(f"--kind must be head or block, got {self.kind!r}")
        if not self.minutes > 0:
            raise ConfigError(
                f"--minutes must be > 0 (the training loop's budget), got {self.minutes}"
            )
        if self.gen_minutes < 0:
            raise ConfigError(f"--gen-minutes must be >= 0, got {self.gen_minutes}")
        for name in ("max_new_tokens", "gen_batch", "seq_len", "batch", "unroll", "eval_budget"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kind == "block" and self.block < 2:
            raise ConfigError("--block must be >= 2")
        if self.tap_norm not in ("auto", "on", "off"):
            raise ConfigError(f"--tap-norm must be auto, on or off, got {self.tap_norm!r}")


@dataclass
class TrainResult:
    out: Path
    steps: int
    train_s: float
    data_tokens: int
    eval_init: dict[str, float]
    eval_final: dict[str, float]
    moved_aside: Path | None = None
    """Where the earlier content of ``out`` went (``--overwrite``), if anywhere."""


def default_taps(n_layers: int) -> tuple[int, ...]:
    """Low, middle and final (normed) target states, as EAGLE-3's low/mid/high features."""
    return tuple(sorted({min(2, n_layers - 1), n_layers // 2, n_layers}))


class _State:
    """``state.json`` of the work directory (phases done, counters), written atomically; it
    carries the wall time of every run of this work directory (``wall_s``, across resumes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.d: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        self._t0 = time.time()
        self._before = float(self.d.get("wall_s", 0.0))

    def wall(self) -> float:
        """Seconds spent by all runs of this work directory, up to now."""
        return self._before + time.time() - self._t0

    def save(self) -> None:
        self.d["wall_s"] = self.wall()
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.d, indent=1))
        tmp.replace(self.path)


def train_drafter(
    loaded: Any,
    cfg: TrainConfig,
    out: str | Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    command: str = "",
    progress: Progress | None = None,
) -> TrainResult:
    """Train a drafter for ``loaded`` (a LoadedModel) and save it to directory ``out`` (checked
    first: see :mod:`.output`; ``overwrite`` moves other content there aside at the end)."""
    out = check_out(out, overwrite=overwrite, resume=resume)
    check_taps(cfg.taps, loaded.model.cfg.n_layers)
    work = work_dir(out)
    if work.exists() and not resume:
        shutil.rmtree(work)
    (work / "data").mkdir(parents=True, exist_ok=True)
    st = _State(work / "state.json")
    st.d["config"] = asdict(cfg)
    report = progress or (lambda *a: None)
    model, tok = loaded.model, loaded.tokenizer
    model.prepack("onednn")
    taps = cfg.taps or default_taps(model.cfg.n_layers)
    store = tuple(sorted(set(taps) | {model.cfg.n_layers}))

    prompts = D.load_prompts([s for s in cfg.sources if s != "text"], seed=cfg.seed)
    if cfg.max_prompts is not None:
        prompts = prompts[: cfg.max_prompts]
    if not prompts and not ("text" in cfg.sources and cfg.text_tokens > 0):
        raise WorkloadError(
            "the training data set is empty: give --data code, chat, text or a file"
        )
    n_eval = min(cfg.eval_prompts, max(len(prompts) - 1, 0))
    train_p, eval_p = D.split(prompts, n_eval, cfg.seed) if n_eval else (prompts, [])
    fmt = _features(model, tok, train_p, cfg, store, taps, work, st)
    _collect(model, tok, train_p, cfg, store, work, st, report, getattr(torch, fmt["dtype"]))
    seqs = [s for f in sorted((work / "data").glob("shard_*.safetensors")) for s in load_shard(f)]
    seqs = [s for s in seqs if len(s.tokens) >= 3]
    if not seqs:
        raise WorkloadError("the training data set is empty after generation; add prompts")
    n_tokens = sum(len(s.tokens) for s in seqs)
    vocab = _saved_vocab(work, st)
    if vocab is None:  # fixed once: more data on --resume must not reorder a trained head's rows
        vocab = _draft_vocab(seqs, cfg.draft_vocab, model.cfg.vocab_size, tok)
        st.d["vocab"] = vocab.tolist()
        st.save()

    net = _new_net(loaded, cfg, taps, vocab, bool(fmt["tap_norm"]))
    eval_ids = [tok.encode_prompt(p.text, chat=p.chat) for p in eval_p]
    if "eval_init" not in st.d:
        report("evaluate", 0, 1, {})
        st.d["eval_init"] = evaluate(loaded, net, eval_ids, cfg)
        st.d["eval_init_prompts"] = [p.id for p in eval_p]
        st.save()
    steps, train_s = _train(net, seqs, store, cfg, work, st, report)
    report("evaluate", 0, 1, {})
    final = evaluate(loaded, net, eval_ids, cfg)
    record = training_record(
        loaded, asdict(cfg), command, st, (train_p, eval_p, seqs), steps, train_s, final
    )
    aside = save_output(net, out, record)
    st.save()  # the final evaluation's time counts toward a later --resume's wall time
    return TrainResult(out, steps, train_s, n_tokens, st.d["eval_init"], final, aside)


def _new_net(
    loaded: Any, cfg: TrainConfig, taps: tuple[int, ...], vocab: Tensor, tap_norm: bool
) -> FeatureNet:
    """A freshly initialized drafter network for the target, its embedding and LM head attached."""
    model = loaded.model
    net_cfg = FeatureNetConfig(
        kind=cfg.kind,
        dim=model.cfg.dim,
        vocab_size=model.cfg.vocab_size,
        taps=taps,
        n_layers=cfg.n_layers or (1 if cfg.kind == "head" else 2),
        n_heads=model.cfg.n_heads,
        n_kv_heads=model.cfg.n_kv_heads,
        head_dim=model.cfg.head_dim,
        intermediate_size=cfg.ffn or model.cfg.intermediate_size,
        rms_eps=model.cfg.rms_eps,
        block=cfg.block if cfg.kind == "block" else 0,
        draft_vocab=len(vocab),
        tap_norm=tap_norm,
        extra={"target_fingerprint": loaded.fingerprint, "target": Path(loaded.source).name},
    )
    net = FeatureNet(net_cfg)
    net.init_weights(cfg.seed)
    net.vocab_ids.copy_(vocab)
    net.to(model.device)  # trained in fp32 on the target's device
    net.attach(model.model.embed_tokens.weight, model.head_weight())
    return net


def _features(
    model: Any,
    tok: Any,
    prompts: list[Any],
    cfg: TrainConfig,
    store: tuple[int, ...],
    taps: tuple[int, ...],
    work: Path,
    st: _State,
) -> dict[str, Any]:
    """The features' storage dtype and ``tap_norm``, fixed at a work directory's first run (a
    probe of the target's states on a few training prompts and a text window); work directories
    from before the choice was kept hold fp16 shards of a net without ``tap_norm``."""
    if "features" not in st.d:
        if st.d.get("shards", 0) or (work / "ckpt.pt").exists():
            fmt: dict[str, Any] = {"dtype": "float16", "tap_norm": False}
        else:
            windows = [tok.encode_prompt(p.text, chat=p.chat)[:256] for p in prompts[:4]]
            windows += D.text_windows(tok, 256, 256, cfg.seed)
            fmt = feature_format(model, windows, store, taps)
        if cfg.tap_norm != "auto":
            fmt["tap_norm"] = cfg.tap_norm == "on"
        st.d["features"] = fmt
        st.save()
    return st.d["features"]


def _collect(
    model: Any,
    tok: Any,
    prompts: list[Any],
    cfg: TrainConfig,
    store: tuple[int, ...],
    work: Path,
    st: _State,
    report: Progress,
    dtype: torch.dtype,
) -> None:
    """Phase 1: generate shards until the generation budget or the prompts run out.

    On ``--resume`` with a larger ``--gen-minutes`` generation continues where it stopped (the
    prompt order is seeded), so a drafter can be trained further on more data."""
    eos = tuple(tok.eos_ids)
    nxt = st.d.get("next_prompt", 0)
    gen_s = st.d.get("gen_s", 0.0)
    shard = st.d.get("shards", 0)
    budget = cfg.gen_minutes * 60
    total = max(len(prompts), 1)
    while nxt < len(prompts) and gen_s < budget:
        t0 = time.time()
        batch = prompts[nxt : nxt + cfg.gen_batch]
        ids = [tok.encode_prompt(p.text, chat=p.chat) for p in batch]
        ids = [i for i in ids if 1 < len(i) <= cfg.max_prompt_tokens]
        ids.sort(key=len)
        seqs = generate_batch(model, ids, cfg.max_new_tokens, store, eos, dtype) if ids else []
        if seqs:
            save_shard(work / "data" / f"shard_{shard:05d}.safetensors", seqs)
            shard += 1
        nxt += len(batch)
        gen_s += time.time() - t0
        st.d.update(next_prompt=nxt, gen_s=gen_s, shards=shard)
        st.save()
        report("generate", min(gen_s, budget), budget, {"prompts": nxt, "of": total})
    if "text" in cfg.sources and cfg.text_tokens > 0 and not st.d.get("text_done"):
        windows = D.text_windows(tok, cfg.text_tokens, cfg.text_window, cfg.seed)
        for i in range(0, len(windows), 8):
            seqs = teacher_forced(model, windows[i : i + 8], store, dtype)
            save_shard(work / "data" / f"shard_{shard:05d}.safetensors", seqs)
            shard += 1
            st.d["shards"] = shard
            report("text", i + 8, len(windows), {})
        st.d["text_done"] = True
    st.d["data_done"] = True
    st.save()


def _saved_vocab(work: Path, st: _State) -> Tensor | None:
    """The draft vocabulary fixed by an earlier run of this work directory, if any."""
    if "vocab" in st.d:
        return torch.tensor(st.d["vocab"], dtype=torch.long)
    ckpt = work / "ckpt.pt"
    if ckpt.exists():  # work directories from before the vocabulary was kept in the state
        c = torch.load(ckpt, map_location="cpu", weights_only=False)
        return c["net"]["vocab_ids"].clone()
    return None


def _draft_vocab(seqs: list[Sequence], k: int, vocab_size: int, tok: Any) -> Tensor:
    """The ``k`` most frequent token ids of the data (ties by id), EOS ids always in, sorted."""
    if k <= 0 or k >= vocab_size:
        return torch.arange(vocab_size)
    counts: Counter[int] = Counter()
    for s in seqs:
        counts.update(s.tokens.tolist())
    for e in tok.eos_ids:
        counts[e] += 1 << 40
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
    ids = {t for t, _ in top}
    fill = 0
    while len(ids) < k:  # fewer distinct tokens than k: pad with the lowest unused ids
        if fill not in ids:
            ids.add(fill)
        fill += 1
    return torch.tensor(sorted(ids), dtype=torch.long)


def _batches(
    seqs: list[Sequence], seq_len: int, batch: int, seed: int
) -> list[list[tuple[int, int]]]:
    """Segments (sequence index, start) of at most ``seq_len`` tokens, shuffled into batches."""
    segs = [
        (i, a) for i, s in enumerate(seqs) for a in range(0, max(len(s.tokens) - 2, 1), seq_len)
    ]
    random.Random(seed).shuffle(segs)
    return [segs[i : i + batch] for i in range(0, len(segs), batch)]


def _collate(
    seqs: list[Sequence],
    segs: list[tuple[int, int]],
    seq_len: int,
    store: tuple[int, ...],
    taps: tuple[int, ...],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(tokens (B,T), taps (B,T,n,d), final (B,T,d), valid (B,T)) right-padded."""
    parts = [(seqs[i].tokens[a : a + seq_len], seqs[i].feats[a : a + seq_len]) for i, a in segs]
    t = max(len(p[0]) for p in parts)
    b = len(parts)
    d = parts[0][1].shape[-1]
    toks = torch.zeros(b, t, dtype=torch.long)
    feats = torch.zeros(b, t, len(store), d)
    valid = torch.zeros(b, t, dtype=torch.bool)
    for r, (tk, f) in enumerate(parts):
        toks[r, : len(tk)] = tk
        feats[r, : len(tk)] = f.float()
        valid[r, : len(tk)] = True
    sel = [store.index(x) for x in taps]
    return toks, feats[:, :, sel], feats[:, :, -1], valid


def distill_loss(
    net: FeatureNet,
    toks: Tensor,
    taps: Tensor,
    final: Tensor,
    valid: Tensor,
    cfg: TrainConfig,
    seed: int = 0,
) -> tuple[Tensor, dict[str, float]]:
    """KL(target || drafter) over the draft vocabulary, summed over unrolled steps / block rows."""
    with torch.no_grad():
        tgt = torch.log_softmax(final @ net.head.T, dim=-1)  # (B, T, V) over the draft vocab
    if net.cfg.kind == "head":
        from specpilot.drafters.head import head_unroll

        pairs = head_unroll(net, taps, toks, cfg.unroll, keep=cfg.loss_share, seed=seed)
    else:
        from specpilot.drafters.block import block_train_logits

        pairs = block_train_logits(net, taps, toks, seed=seed)
    total = torch.zeros(())
    info: dict[str, float] = {}
    for s, (logits, off) in enumerate(pairs):
        idx = off.clamp(max=tgt.shape[1] - 1)  # target positions of the rows
        p_log, ok = tgt[:, idx], valid[:, idx] & (off < tgt.shape[1])[None]
        q_log = torch.log_softmax(logits.float(), dim=-1)
        kl = (p_log.exp() * (p_log - q_log)).sum(-1)  # (B, m)
        w = 0.8**s
        n_ok = ok.sum().clamp(min=1)
        total = total + w * (kl * ok).sum() / n_ok
        if s < 3:
            acc = ((q_log.argmax(-1) == p_log.argmax(-1)) & ok).sum() / n_ok
            info[f"acc{s + 1}"] = float(acc)
    info["loss"] = float(total.detach())
    return total, info


def _train(
    net: FeatureNet,
    seqs: list[Sequence],
    store: tuple[int, ...],
    cfg: TrainConfig,
    work: Path,
    st: _State,
    report: Progress,
) -> tuple[int, float]:
    """Phase 3: the training loop with time-based warmup + cosine schedule and checkpoints."""
    net.train()
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    ckpt = work / "ckpt.pt"
    step, train_s, epoch = 0, 0.0, 0
    if ckpt.exists():
        c = torch.load(ckpt, map_location="cpu", weights_only=False)
        net.load_state_dict(c["net"])
        opt.load_state_dict(c["opt"])
        step, train_s, epoch = c["step"], c["train_s"], c["epoch"]
    budget = cfg.minutes * 60
    taps = tuple(net.cfg.taps)
    last_ckpt = time.time()
    ema: dict[str, float] = {}
    while train_s < budget and (cfg.max_steps is None or step < cfg.max_steps):
        batches = _batches(seqs, cfg.seq_len, cfg.batch, cfg.seed + epoch)
        skip = step - st.d.get("epoch_start_step", 0) if epoch == st.d.get("epoch", -1) else 0
        st.d.update(epoch=epoch, epoch_start_step=step - skip)
        for segs in batches[skip:]:
            if train_s >= budget or (cfg.max_steps is not None and step >= cfg.max_steps):
                break
            t0 = time.time()
            frac = train_s / budget if budget else 1.0
            if cfg.max_steps:
                frac = max(frac, step / cfg.max_steps)
            warm = min(1.0, (step + 1) / 30)
            for g in opt.param_groups:
                g["lr"] = cfg.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1))))
            batch = _collate(seqs, segs, cfg.seq_len, store, taps)
            toks, tp, fin, valid = (x.to(net.head.device) for x in batch)
            loss, info = distill_loss(net, toks, tp, fin, valid, cfg, seed=step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            dt = time.time() - t0
            train_s += dt
            info["tok_s"] = float(valid.sum()) / dt
            for k, v in info.items():
                ema[k] = v if k not in ema else 0.9 * ema[k] + 0.1 * v
            report("train", min(train_s, budget), budget, {**ema, "step": step, "epoch": epoch})
            if time.time() - last_ckpt >= cfg.checkpoint_s:
                _save_ckpt(ckpt, net, opt, step, train_s, epoch, st)
                last_ckpt = time.time()
        else:
            epoch += 1
    _save_ckpt(ckpt, net, opt, step, train_s, epoch, st)
    net.eval()
    return step, train_s


def _save_ckpt(
    path: Path, net: FeatureNet, opt: Any, step: int, train_s: float, epoch: int, st: _State
) -> None:
    tmp = path.with_suffix(".tmp")
    state = {"net": net.state_dict(), "opt": opt.state_dict(), "step": step}
    torch.save({**state, "train_s": train_s, "epoch": epoch}, tmp)
    os.replace(tmp, path)
    st.save()
