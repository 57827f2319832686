"""The static per-layer KV cache (gpt-fast style): preallocated, addressed by absolute slot.

Slots are written where a call says (contiguous, a list, or per batch row), compacted onto the
committed prefix after a tree is accepted (:meth:`KVCache.compact`), and a batch row can be
copied into another when the batch is repacked (:meth:`KVCache.move_row`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class KVCache(nn.Module):
    """Static per-layer cache ``(B, n_kv_heads, max_len, head_dim)`` addressed by slot."""

    def __init__(
        self,
        batch: int,
        n_kv: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        shape = (batch, n_kv, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def write(self, slots: int | Tensor, k: Tensor, v: Tensor, rows: slice | None = None) -> None:
        # k, v: (B, n_kv, T, head_dim); rows: the B cache rows written (default: the first B)
        kc, vc = (self.k, self.v) if rows is None else (self.k[rows], self.v[rows])
        if isinstance(slots, int):
            t = k.shape[2]
            kc[:, :, slots : slots + t] = k
            vc[:, :, slots : slots + t] = v
        elif slots.dim() == 1:
            kc.index_copy_(2, slots, k.to(kc.dtype))
            vc.index_copy_(2, slots, v.to(vc.dtype))
        else:  # (B, T): per-row slots (batched decoding with ragged lengths)
            b = torch.arange(k.shape[0], device=k.device)[:, None]  # (B, 1)
            kc[b, :, slots] = k.transpose(1, 2).to(kc.dtype)  # (B, T, n_kv, head_dim)
            vc[b, :, slots] = v.transpose(1, 2).to(vc.dtype)

    def compact(self, src: Tensor, dst: int, row: int | None = None) -> None:
        """Move the entries at slots ``src`` (ascending, each >= dst + i) to ``dst, dst+1, ...``
        in batch row ``row`` (None = every row)."""
        n = src.shape[0]
        for buf in (self.k, self.v):
            view = buf if row is None else buf[row : row + 1]  # (B', n_kv, max_len, head_dim)
            view[:, :, dst : dst + n] = view.index_select(2, src)

    def move_row(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` slots of batch row ``src`` into row ``dst``."""
        self.k[dst, :, :n] = self.k[src, :, :n]
        self.v[dst, :, :n] = self.v[src, :, :n]
