"""Dense fp32 linears through oneDNN with prepacked weights: the dequantized (``--weights fp32``)
path's kernel.

oneDNN's fp32 GEMM gives each row of the output the same bits for any number of rows in the call
(checked in the tests), which is what makes a verified tree row equal a plain decoding row on
this path. It is not a fixed documented order like :mod:`specpilot.kernels`' native kernels: it
is oneDNN's, observed batch-invariant, with one exception handled here (a one-row path for some
shapes, detected by a probe and padded to two rows).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    )


class PackedLinear(nn.Module):
    """fp32 CPU linear with oneDNN-prepacked weights; row results are batch-invariant.

    oneDNN takes a separate one-row path for some shapes (seen for in_features=1536); a probe at
    construction detects it and such layers pad one-row calls to two rows.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 2)
        self.bias = None if bias is None else bias.detach().contiguous()
        self.pad_single = False
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            probe = torch.randn(2, self.in_features, generator=g)
            if not torch.equal(self._mm(probe)[:1], self._mm(probe[:1])):
                self.pad_single = True

    def _mm(self, x2: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        m = x2.shape[0]
        if m == 1 and self.pad_single:
            return self._mm(x2.expand(2, -1))[:1].reshape(*lead, self.out_features)
        return self._mm(x2).reshape(*lead, self.out_features)
