"""Target features for distillation: greedy continuations (batched) and teacher-forced text.

Both return :class:`Sequence`s: the token ids and the target's hidden states at the stored layers
for every token (``feats[i]`` is the target's state at position ``i``; the last stored layer is
the final normed state, from which the target's next-token distribution is recomputed).

Batched generation left-pads prompts: row ``b`` starts at slot ``pad_b``, positions count from
there, and keys before ``pad_b`` are masked out (a padding row attends to itself only, so every
cached value stays finite). Features are stored in fp16 shards (:func:`save_shard`), so a killed
run keeps what it generated; in bf16 where the target's states do not fit fp16 (Gemma 3's middle
layers pass 65,504): :func:`feature_format` decides once per work directory.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from specpilot.model import Transformer, causal_mask


@dataclass
class Sequence:
    tokens: Tensor
    """(L,) long token ids."""
    feats: Tensor
    """(L, n_store, dim) fp16 (or bf16) target hidden states at each position."""


FP16_HEADROOM = 8.0
"""Features are stored in fp16 only if the probe's largest state times this fits fp16."""
TAP_NORM_SPREAD = 32.0
"""``tap_norm`` (auto) is on when the tapped states' RMS differ by more than this factor."""


@torch.no_grad()
def feature_format(
    model: Transformer, windows: Seq[list[int]], layers: tuple[int, ...], taps: tuple[int, ...]
) -> dict[str, object]:
    """Storage dtype and the ``tap_norm`` suggestion from the target's states on ``windows``:
    ``{"dtype": "float16" | "bfloat16", "tap_norm": bool, "max_abs": float, "tap_rms": [...]}``."""
    s = [teacher_forced(model, [w], layers, dtype=torch.float32)[0] for w in windows if w]
    f = torch.cat([q.feats for q in s])  # (L, n_store, dim)
    max_abs = float(f.abs().max())
    rms = [float(f[:, layers.index(t)].pow(2).mean().sqrt()) for t in taps]
    fits = max_abs * FP16_HEADROOM < float(torch.finfo(torch.float16).max)
    spread = max(rms) / max(min(rms), 1e-30)
    return {
        "dtype": "float16" if fits else "bfloat16",
        "tap_norm": spread > TAP_NORM_SPREAD,
        "max_abs": max_abs,
        "tap_rms": rms,
    }


@torch.no_grad()
def generate_batch(
    model: Transformer,
    prompts: Seq[list[int]],
    max_new: int,
    layers: tuple[int, ...],
    eos_ids: Seq[int] = (),
    dtype: torch.dtype = torch.float16,
) -> list[Sequence]:
    """Greedy continuations of ``prompts`` in one batch, with hidden states of ``layers``.

    Each returned sequence is the prompt plus the generated tokens that were fed back (up to and
    including an EOS); the last generated token is dropped when it was never fed.
    """
    b = len(prompts)
    lens = [len(p) for p in prompts]
    p_max = max(lens)
    dev = model.device
    model.setup_cache(p_max + max_new + 1, batch=b, attention="sdpa")
    pad = torch.tensor([p_max - n for n in lens], device=dev)  # (B,)
    ids = torch.zeros(b, p_max, dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        ids[i, p_max - len(p) :] = torch.tensor(p, device=dev)
    cols = torch.arange(p_max, device=dev)
    pos = (cols[None] - pad[:, None]).clamp(min=0)  # (B, P)
    mask = causal_mask(0, p_max, p_max, dev) & (cols[None, None, :] >= pad[:, None, None])
    mask = mask | torch.eye(p_max, dtype=torch.bool, device=dev)[None]  # (B, P, P)
    out = model(ids, pos, 0, p_max, mask, logits_rows=slice(p_max - 1, p_max), hidden_layers=layers)
    feats = [torch.stack(out.hidden, dim=2).to(dtype)]  # (B, P, n, d)
    nxt = out.logits[:, -1].argmax(-1)  # (B,)
    gen = [nxt]
    eos = torch.tensor(sorted(set(eos_ids)) or [-1], device=dev)
    done = torch.isin(nxt, eos)
    fed = 0
    for s in range(max_new - 1):
        if bool(done.all()):
            break
        kv = p_max + s + 1
        m = (torch.arange(kv, device=dev)[None, None, :] >= pad[:, None, None]).expand(b, 1, kv)
        o = model(
            nxt[:, None],
            (torch.tensor(lens, device=dev) + s)[:, None],
            p_max + s,
            kv,
            m,
            hidden_layers=layers,
        )
        feats.append(torch.stack(o.hidden, dim=2).to(dtype))
        fed += 1
        nxt = o.logits[:, -1].argmax(-1)
        gen.append(nxt)
        done |= torch.isin(nxt, eos)
    all_feats = torch.cat(feats, dim=1)  # (B, P + fed, n, d)
    gen_t = torch.stack(gen, dim=1)[:, :fed]  # (B, fed): generated tokens that were fed
    out_seqs = []
    for i, p in enumerate(prompts):
        g = gen_t[i].tolist()
        cut = next((k + 1 for k, t in enumerate(g) if t in set(eos_ids)), len(g))
        toks = torch.tensor(list(p) + g[:cut], dtype=torch.long)
        f = all_feats[i, p_max - len(p) : p_max + cut]
        out_seqs.append(Sequence(toks, f.cpu().clone()))
    return out_seqs


@torch.no_grad()
def teacher_forced(
    model: Transformer,
    windows: Seq[list[int]],
    layers: tuple[int, ...],
    dtype: torch.dtype = torch.float16,
) -> list[Sequence]:
    """Hidden states of ``layers`` over equal-length token windows (one batched forward)."""
    t = len(windows[0])
    assert all(len(w) == t for w in windows), "teacher-forced windows must have equal lengths"
    dev = model.device
    model.setup_cache(t, batch=len(windows), attention="sdpa")
    ids = torch.tensor(windows, dtype=torch.long, device=dev)
    pos = torch.arange(t, device=dev)[None].expand(len(windows), -1)
    out = model(
        ids, pos, 0, t, causal_mask(0, t, t, dev), logits_rows=slice(0, 0), hidden_layers=layers
    )
    feats = torch.stack(out.hidden, dim=2).to(dtype).cpu()
    return [Sequence(ids[i].cpu().clone(), feats[i].clone()) for i in range(len(windows))]


def save_shard(path: Path, seqs: Seq[Sequence]) -> None:
    """Write sequences to one safetensors file (atomically: tmp file then rename)."""
    lens = torch.tensor([len(s.tokens) for s in seqs], dtype=torch.long)
    data = {
        "lens": lens,
        "tokens": torch.cat([s.tokens for s in seqs]),
        "feats": torch.cat([s.feats for s in seqs]).contiguous(),
    }
    tmp = path.with_suffix(".tmp")
    save_file(data, str(tmp))
    tmp.replace(path)


def load_shard(path: Path) -> list[Sequence]:
    d = load_file(str(path))
    out, at = [], 0
    for n in d["lens"].tolist():
        out.append(Sequence(d["tokens"][at : at + n], d["feats"][at : at + n]))
        at += n
    return out
