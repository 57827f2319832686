"""Hardware peaks for the roofline: a cited table for known GPUs, a measured calibration otherwise.

Known GPUs (matched on ``torch.cuda.get_device_name``) take their dense (no structured sparsity)
bf16/fp16 tensor FLOP/s, memory bandwidth and fp64 FLOP/s from the vendor datasheets cited next
to each entry. A model run in fp32 on a GPU uses the table's fp32 figure where the datasheet gives
one, else a calibration of the FLOP/s.

CPUs and unknown devices are calibrated once and cached per machine:

* FLOP/s: the best of a few large square GEMMs (``torch.mm``, n = 1024 and 2048) in the model's
  dtype, and one in fp64 (for ``exact`` attention). A large GEMM is the most a BLAS reaches on
  the device, which is what a floor should assume.
* bandwidth: a 256 MiB streaming read (``x.sum()``) and a 256 MiB copy (``y.copy_(x)``, read +
  write counted); the larger is the peak. Decode traffic is dominated by streaming weight reads,
  which the reduction measures directly; the copy is kept as a cross-check (it is usually lower,
  since writes cost extra on most CPUs).

The cache is ``hardware.json`` under ``$SPECPILOT_CACHE`` (else ``~/.cache/specpilot``), keyed by
device model, thread count, dtype and torch version, so a change of any of them recalibrates.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CALIBRATION_VERSION = 1
CACHE_FILE = "hardware.json"


@dataclass(frozen=True)
class Hardware:
    """Peak rates the floors are computed from."""

    name: str
    peak_flops: float
    """FLOP/s in the model's dtype (dense)."""
    peak_bw: float
    """Memory bandwidth, bytes/s."""
    peak_flops_fp64: float
    """fp64 FLOP/s (``exact`` attention)."""
    source: str
    """"table: <citation>", "calibrated" or "calibrated (cached)"."""

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class _Entry:
    match: tuple[str, ...]
    """All of these (lowercase) occur in the device name."""
    name: str
    bf16: float
    bw: float
    fp64: float
    fp32: float | None
    cite: str


T = 1e12
A100_DS = "NVIDIA A100 datasheet"
# Dense figures; the datasheets print the sparse tensor figures as 2x these.
GPU_TABLE: tuple[_Entry, ...] = (
    # NVIDIA H100 Tensor Core GPU datasheet (2023): PCIe BF16 1,513 TF sparse, 2.0 TB/s, FP64 TC 51.
    _Entry(("h100", "pcie"), "H100 PCIe", 756 * T, 2.0e12, 51 * T, 51 * T, "NVIDIA H100 datasheet"),
    # Same datasheet, H100 NVL: BF16 1,671 TF sparse, 3.9 TB/s, FP64 TC 60, FP32 60.
    _Entry(("h100", "nvl"), "H100 NVL", 835 * T, 3.9e12, 60 * T, 60 * T, "NVIDIA H100 datasheet"),
    # Same datasheet, H100 SXM: BF16 1,979 TF sparse, 3.35 TB/s HBM3, FP64 TC 67, FP32 67.
    _Entry(("h100",), "H100 SXM", 989 * T, 3.35e12, 67 * T, 67 * T, "NVIDIA H100 datasheet"),
    # NVIDIA H200 Tensor Core GPU datasheet (2024): NVL BF16 1,671 TF sparse, 4.8 TB/s, FP64 TC 60.
    _Entry(("h200", "nvl"), "H200 NVL", 835 * T, 4.8e12, 60 * T, 60 * T, "NVIDIA H200 datasheet"),
    # Same datasheet, H200 SXM: BF16 1,979 TF sparse, 4.8 TB/s HBM3e, FP64 TC 67, FP32 67.
    _Entry(("h200",), "H200 SXM", 989 * T, 4.8e12, 67 * T, 67 * T, "NVIDIA H200 datasheet"),
    # NVIDIA A100 Tensor Core GPU datasheet (2021): BF16 312 TF dense, FP64 TC 19.5, FP32 19.5;
    # 40GB 1,555 GB/s; 80GB PCIe 1,935 GB/s; 80GB SXM 2,039 GB/s.
    _Entry(("a100", "40gb"), "A100 40GB", 312 * T, 1.555e12, 19.5 * T, 19.5 * T, A100_DS),
    _Entry(("a100", "pcie"), "A100 80GB PCIe", 312 * T, 1.935e12, 19.5 * T, 19.5 * T, A100_DS),
    _Entry(("a100",), "A100 80GB SXM", 312 * T, 2.039e12, 19.5 * T, 19.5 * T, A100_DS),
    # NVIDIA L40S datasheet (2023): BF16 733 TF sparse (362.05 dense), FP32 91.6 TF, 864 GB/s
    # GDDR6; FP64 is not listed (Ada runs it at 1/64 of FP32: 1.4 TF).
    _Entry(("l40s",), "L40S", 362.05 * T, 864e9, 1.43 * T, 91.6 * T, "NVIDIA L40S datasheet"),
    # NVIDIA HGX B200 specifications (2024), per GPU: FP16/BF16 4.5 PF sparse (2.25 dense),
    # FP64 TC 40 TF, HBM3e 8 TB/s (64 TB/s for 8 GPUs). FP32 is not listed: calibrated.
    _Entry(("b200",), "B200", 2250 * T, 8.0e12, 40 * T, None, "NVIDIA HGX B200 specifications"),
    # NVIDIA Ada GPU architecture whitepaper (2022), RTX 4090: BF16 tensor with FP32 accumulate
    # 165.2 TF dense (330.4 sparse), FP32 82.6 TF, FP64 1.29 TF, 1,008 GB/s GDDR6X.
    _Entry(("4090",), "RTX 4090", 165.2 * T, 1.008e12, 1.29 * T, 82.6 * T, "NVIDIA Ada whitepaper"),
)


def match_gpu(device_name: str) -> _Entry | None:
    """The table entry for a CUDA device name (first match wins), or None."""
    low = device_name.lower()
    return next((e for e in GPU_TABLE if all(m in low for m in e.match)), None)


def cache_path(cache_dir: str | Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser() / CACHE_FILE
    env = os.environ.get("SPECPILOT_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "specpilot"
    return root / CACHE_FILE


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return min(times)


def calibrate(device: torch.device, dtype: torch.dtype, repeats: int = 3) -> dict[str, float]:
    """Measure GEMM FLOP/s (model dtype and fp64) and streaming bandwidth (see module doc)."""
    flops = 0.0
    for n in (1024, 2048):
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        flops = max(flops, 2 * n**3 / _best(lambda a=a, b=b: torch.mm(a, b), device, repeats))
    n = 1024
    a64 = torch.randn(n, n, device=device, dtype=torch.float64)
    fp64 = 2 * n**3 / _best(lambda: torch.mm(a64, a64), device, repeats)
    x = torch.ones(64 * 2**20, device=device)  # 256 MiB of fp32
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    read_bw = nbytes / _best(lambda: x.sum(), device, repeats + 2)
    copy_bw = 2 * nbytes / _best(lambda: y.copy_(x), device, repeats + 2)
    return {
        "peak_flops": flops,
        "peak_flops_fp64": fp64,
        "read_bw": read_bw,
        "copy_bw": copy_bw,
        "peak_bw": max(read_bw, copy_bw),
    }


def _load(path: Path) -> dict[str, dict[str, float]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _store(path: Path, key: str, value: dict[str, float]) -> None:
    """Atomic read-modify-write; a cache that cannot be written is skipped silently."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load(path)
        data[key] = value
        fd, tmp = tempfile.mkstemp(prefix=".hardware.", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        return


def detect(
    device: torch.device | str,
    dtype: torch.dtype,
    cache_dir: str | Path | None = None,
    recalibrate: bool = False,
) -> Hardware:
    """Peaks for ``device`` running ``dtype``: the GPU table, else a cached calibration."""
    device = torch.device(device)
    dname = str(dtype).replace("torch.", "")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        entry = match_gpu(name)
        if entry is not None:
            peak = entry.bf16 if dtype in (torch.bfloat16, torch.float16) else entry.fp32
            if peak is not None:
                return Hardware(entry.name, peak, entry.bw, entry.fp64, f"table: {entry.cite}")
        key = f"{name}|{dname}|torch={torch.__version__}|v{CALIBRATION_VERSION}"
    else:
        name = cpu_model()
        threads = torch.get_num_threads()
        key = f"{name}|threads={threads}|{dname}|torch={torch.__version__}|v{CALIBRATION_VERSION}"
        name = f"{name} ({threads} threads)"
    path = cache_path(cache_dir)
    cached = None if recalibrate else _load(path).get(key)
    source = "calibrated (cached)"
    if not isinstance(cached, dict) or not all(
        k in cached for k in ("peak_flops", "peak_bw", "peak_flops_fp64")
    ):
        cached = calibrate(device, dtype)
        cached["measured_at"] = time.time()
        _store(path, key, cached)
        source = "calibrated"
    if device.type == "cuda" and (entry := match_gpu(name)) is not None:
        # known GPU, dtype without a datasheet figure: measured FLOP/s, datasheet bandwidth
        return Hardware(entry.name, cached["peak_flops"], entry.bw, entry.fp64, source)
    return Hardware(
        name,
        float(cached["peak_flops"]),
        float(cached["peak_bw"]),
        float(cached["peak_flops_fp64"]),
        source,
    )
