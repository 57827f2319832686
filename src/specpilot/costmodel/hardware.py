"""Hardware peaks for the roofline: a cited table for known GPUs, a measured calibration otherwise.

Known GPUs (matched on ``torch.cuda.get_device_name``) take their dense (no structured sparsity)
bf16/fp16 tensor FLOP/s, memory bandwidth and fp64 FLOP/s from the vendor datasheets cited next
to each entry. A model run in fp32 on a GPU uses the table's fp32 figure where the datasheet gives
one, else a calibration of the FLOP/s.

CPUs and unknown devices are calibrated once and cached per machine:

* FLOP/s: the best of a few large square GEMMs (``torch.mm``, n = 1024 and 2048) in the model's
  dtype, and one in fp64 (for ``exact`` attention). A large GEMM is the most a BLAS reaches on
  the device, which is what a floor should assume.
* int8 OP/s: the same for an int8 x int8 -> int32 GEMM (``torch._int_mm``, oneDNN's VNNI / AMX
  kernels on CPU): the peak of the int8-activation numerics profile's integer block dot
  products (0 where torch has no such kernel: those FLOPs are then held against the model
  dtype's peak).
* bandwidth: a 256 MiB streaming read (``x.sum()``) and a 256 MiB copy (``y.copy_(x)``, read +
  write counted); the larger is the peak. Decode traffic is dominated by streaming weight reads,
  which the reduction measures directly; the copy is kept as a cross-check (it is usually lower,
  since writes cost extra on most CPUs).

Each figure is the best of several short repeats, and a cached peak is the best of every quiet
calibration on the machine: a peak is a maximum, so a new calibration can raise a cached figure but
never lower it (on a shared host the bandwidth a calibration reads moves with the neighbours'
traffic; a floor from a low reading is no floor). A calibration must also be taken on a quiet
machine (a busy one measures low peaks, so every floor comes out too high and kernels look faster
than their floors): the CPU time other processes use (``/proc/stat`` busy time minus this process's
own, :func:`specpilot.machine.other_load`) is sampled before and during the measurement. A
calibration taken while other work used more than :func:`load_limit` cores is retried once, and if
still busy it is used for this run only, never cached, and says so in :attr:`Hardware.notes` (a
cached quiet one is kept instead where there is one). A profile whose measured kernels beat their
floors calls :func:`recheck`: one forced re-calibration per process, and a warning in the notes.

The cache is ``hardware.json`` under ``$SPECPILOT_CACHE`` (else ``~/.cache/specpilot``), keyed by
device model, thread count, dtype and torch version, so a change of any of them recalibrates.
``specpilot profile --recalibrate`` re-measures.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from specpilot.machine import cpu_model, cpu_times, load_limit, sample_load
from specpilot.machine import other_load as other_load  # the load check's public helper

R = TypeVar("R")

CALIBRATION_VERSION = 3
"""2: calibrations taken under load are no longer cached (version 1 entries may be); 3: an int8
GEMM peak, and cached peaks are the best over quiet calibrations."""
PEAK_KEYS = ("peak_flops", "peak_bw", "peak_flops_fp64", "peak_ops_int8", "read_bw", "copy_bw")
"""The figures of a calibration that are maxima (merged by max into the cache)."""
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
    """"table: <citation>", "calibrated", "calibrated (cached)" or "calibrated (not cached)"."""
    measured_at: float = 0.0
    """Unix time of the calibration (0 for a datasheet table entry)."""
    load: float | None = None
    """CPU cores other processes used during the calibration (None: unknown or a table)."""
    notes: tuple[str, ...] = ()
    """Warnings about these peaks (a busy calibration, kernels faster than their floors)."""
    peak_ops_int8: float | None = None
    """int8 x int8 -> int32 GEMM OP/s (a multiply-add is 2), the int8 profile's integer block
    dot products; None where not measured (a datasheet table entry, torch without the kernel):
    :attr:`int8_peak` falls back to :attr:`peak_flops`."""

    @property
    def int8_peak(self) -> float:
        """The peak int8 FLOPs are held against."""
        return self.peak_ops_int8 if self.peak_ops_int8 else self.peak_flops

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    def describe(self) -> str:
        """One line: the peaks, where they come from and when they were measured."""
        when = ""
        if self.measured_at:
            stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.measured_at))
            when = f", measured {stamp}"
        busy = f", other processes {self.load:.2f} cores" if self.load is not None else ""
        i8 = f", int8 {self.peak_ops_int8 / 1e9:.0f} GOP/s" if self.peak_ops_int8 else ""
        return (
            f"peaks {self.peak_flops / 1e9:.1f} GFLOP/s, {self.peak_bw / 1e9:.1f} GB/s, fp64 "
            f"{self.peak_flops_fp64 / 1e9:.1f} GFLOP/s{i8}; source: {self.source}{when}{busy}"
        )


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
A100_DS = "NVIDIA A100 datasheet (2021)"
H100_DS = "NVIDIA H100 datasheet (2023)"
H200_DS = "NVIDIA H200 datasheet (2024)"
L40S_DS = "NVIDIA L40S datasheet (2023)"
B200_DS = "NVIDIA HGX B200 specifications (2024)"
ADA_WP = "NVIDIA Ada whitepaper (2022)"
# Dense figures; the datasheets print the sparse tensor figures as 2x these.
GPU_TABLE: tuple[_Entry, ...] = (
    # NVIDIA H100 Tensor Core GPU datasheet (2023): PCIe BF16 1,513 TF sparse, 2.0 TB/s, FP64 TC 51.
    _Entry(("h100", "pcie"), "H100 PCIe", 756 * T, 2.0e12, 51 * T, 51 * T, H100_DS),
    # Same datasheet, H100 NVL: BF16 1,671 TF sparse, 3.9 TB/s, FP64 TC 60, FP32 60.
    _Entry(("h100", "nvl"), "H100 NVL", 835 * T, 3.9e12, 60 * T, 60 * T, H100_DS),
    # Same datasheet, H100 SXM: BF16 1,979 TF sparse, 3.35 TB/s HBM3, FP64 TC 67, FP32 67.
    _Entry(("h100",), "H100 SXM", 989 * T, 3.35e12, 67 * T, 67 * T, H100_DS),
    # NVIDIA H200 Tensor Core GPU datasheet (2024): NVL BF16 1,671 TF sparse, 4.8 TB/s, FP64 TC 60.
    _Entry(("h200", "nvl"), "H200 NVL", 835 * T, 4.8e12, 60 * T, 60 * T, H200_DS),
    # Same datasheet, H200 SXM: BF16 1,979 TF sparse, 4.8 TB/s HBM3e, FP64 TC 67, FP32 67.
    _Entry(("h200",), "H200 SXM", 989 * T, 4.8e12, 67 * T, 67 * T, H200_DS),
    # NVIDIA A100 Tensor Core GPU datasheet (2021): BF16 312 TF dense, FP64 TC 19.5, FP32 19.5;
    # 40GB 1,555 GB/s; 80GB PCIe 1,935 GB/s; 80GB SXM 2,039 GB/s.
    _Entry(("a100", "40gb"), "A100 40GB", 312 * T, 1.555e12, 19.5 * T, 19.5 * T, A100_DS),
    _Entry(("a100", "pcie"), "A100 80GB PCIe", 312 * T, 1.935e12, 19.5 * T, 19.5 * T, A100_DS),
    _Entry(("a100",), "A100 80GB SXM", 312 * T, 2.039e12, 19.5 * T, 19.5 * T, A100_DS),
    # NVIDIA L40S datasheet (2023): BF16 733 TF sparse (362.05 dense), FP32 91.6 TF, 864 GB/s
    # GDDR6; FP64 is not listed (Ada runs it at 1/64 of FP32: 1.4 TF).
    _Entry(("l40s",), "L40S", 362.05 * T, 864e9, 1.43 * T, 91.6 * T, L40S_DS),
    # NVIDIA HGX B200 specifications (2024), per GPU: FP16/BF16 4.5 PF sparse (2.25 dense),
    # FP64 TC 40 TF, HBM3e 8 TB/s (64 TB/s for 8 GPUs). FP32 is not listed: calibrated.
    _Entry(("b200",), "B200", 2250 * T, 8.0e12, 40 * T, None, B200_DS),
    # NVIDIA Ada GPU architecture whitepaper (2022), RTX 4090: BF16 tensor with FP32 accumulate
    # 165.2 TF dense (330.4 sparse), FP32 82.6 TF, FP64 1.29 TF, 1,008 GB/s GDDR6X.
    _Entry(("4090",), "RTX 4090", 165.2 * T, 1.008e12, 1.29 * T, 82.6 * T, ADA_WP),
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


def calibrate(device: torch.device, dtype: torch.dtype, repeats: int = 5) -> dict[str, float]:
    """Measure GEMM FLOP/s (model dtype and fp64) and streaming bandwidth (see module doc): the
    best of ``repeats`` short runs of each."""
    flops = 0.0
    for n in (1024, 2048):
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        flops = max(flops, 2 * n**3 / _best(lambda a=a, b=b: torch.mm(a, b), device, repeats))
    n = 1024
    a64 = torch.randn(n, n, device=device, dtype=torch.float64)
    fp64 = 2 * n**3 / _best(lambda: torch.mm(a64, a64), device, repeats)
    int8 = _int8_ops(device, repeats)
    x = torch.ones(64 * 2**20, device=device)  # 256 MiB of fp32
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    read_bw = nbytes / _best(lambda: x.sum(), device, repeats + 2)
    copy_bw = 2 * nbytes / _best(lambda: y.copy_(x), device, repeats + 2)
    return {
        "peak_flops": flops,
        "peak_flops_fp64": fp64,
        "peak_ops_int8": int8,
        "read_bw": read_bw,
        "copy_bw": copy_bw,
        "peak_bw": max(read_bw, copy_bw),
    }


def _int8_ops(device: torch.device, repeats: int) -> float:
    """Best int8 GEMM OP/s over square n = 1024 and 2048 (``torch._int_mm``); 0.0 where torch
    has no int8 GEMM for the device."""
    best = 0.0
    for n in (1024, 2048):
        a = torch.randint(-127, 128, (n, n), device=device, dtype=torch.int8)
        b = torch.randint(-127, 128, (n, n), device=device, dtype=torch.int8)
        try:
            t = _best(lambda a=a, b=b: torch._int_mm(a, b), device, repeats)
        except (RuntimeError, NotImplementedError, AttributeError):
            return 0.0
        best = max(best, 2 * n**3 / t)
    return best


# -- load check ---------------------------------------------------------------------------------

LOAD_SAMPLE_S = 0.25
"""Shortest window over which the load of other processes is sampled."""
RETRY_WAIT_S = 1.0
"""Wait before the second try of a calibration that found the machine busy."""

_cpu_times = cpu_times
"""The load sampler :func:`measure` uses (:func:`specpilot.machine.cpu_times`; tests replace it)."""


def _window(fn: Callable[[], R]) -> tuple[R, float | None]:
    """``fn()`` and the other processes' load while it ran (sampled at least LOAD_SAMPLE_S)."""
    return sample_load(fn, LOAD_SAMPLE_S, _cpu_times)


@dataclass(frozen=True)
class Calibration:
    peaks: dict[str, float]
    load: float | None
    """Highest load of other processes seen before or during the measurement."""
    quiet: bool


def measure(device: torch.device, dtype: torch.dtype, attempts: int = 2) -> Calibration:
    """:func:`calibrate` on a quiet machine: each try samples the load before and during; the
    first quiet try wins. When every try is busy, each peak is the best over the tries."""
    best: dict[str, float] = {}
    loads: list[float] = []
    limit = load_limit()
    for i in range(attempts):
        if i:
            time.sleep(RETRY_WAIT_S)
        _, before = _window(lambda: None)
        if before is not None and before > limit and i < attempts - 1:
            loads.append(before)
            continue
        peaks, during = _window(lambda: calibrate(device, dtype))
        seen = [x for x in (before, during) if x is not None]
        if not seen or max(seen) <= limit:
            return Calibration(peaks, max(seen) if seen else None, True)
        loads.append(max(seen))
        best = {k: max(v, best.get(k, 0.0)) for k, v in peaks.items()}
    return Calibration(best, min(loads), False)


# -- cache ------------------------------------------------------------------------------------


def _load(path: Path) -> dict[str, dict[str, float]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _store(path: Path, key: str, value: dict[str, float | None]) -> None:
    """Atomic read-modify-write; a cache that cannot be written is skipped silently."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load(path)
        data[key] = value  # type: ignore[assignment]
        fd, tmp = tempfile.mkstemp(prefix=".hardware.", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        return


def _valid(entry: object) -> dict[str, float] | None:
    keys = ("peak_flops", "peak_bw", "peak_flops_fp64")
    if isinstance(entry, dict) and all(isinstance(entry.get(k), (int, float)) for k in keys):
        return entry
    return None


def _date(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t)) if t else "an unknown date"


def detect(
    device: torch.device | str,
    dtype: torch.dtype,
    cache_dir: str | Path | None = None,
    recalibrate: bool = False,
) -> Hardware:
    """Peaks for ``device`` running ``dtype``: the GPU table, else a cached quiet calibration,
    else a new one (cached only when the machine was quiet; see the module docstring)."""
    device = torch.device(device)
    dname = str(dtype).replace("torch.", "")
    entry = None
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
    cached = _valid(_load(path).get(key))
    if cached is not None and not recalibrate:
        return _hardware(name, entry, cached, "calibrated (cached)")
    cal = measure(device, dtype)
    rec: dict[str, float | None] = {**cal.peaks, "measured_at": time.time(), "load": cal.load}
    if cal.quiet:
        best = merge_peaks(cached, rec)
        _store(path, key, best)
        raised = [k for k in PEAK_KEYS if (best.get(k) or 0.0) > (rec.get(k) or 0.0)]
        if not raised:
            return _hardware(name, entry, best, "calibrated")
        note = (
            f"{', '.join(raised)} kept from an earlier quiet calibration of this machine (a peak "
            f"is the best reading; this one read {_reading(rec)})"
        )
        return _hardware(name, entry, best, "calibrated", (note,))
    why = (
        f"a calibration taken while other processes used {cal.load:.2f} CPU cores (limit "
        f"{load_limit():.2f}) was not cached"
    )
    if cached is not None:
        when = _date(float(cached.get("measured_at") or 0.0))
        note = f"{why}; the quiet calibration of {when} is used instead"
        return _hardware(name, entry, cached, "calibrated (cached)", (note,))
    note = f"{why}; its peaks may be low (floors too high): rerun profile on a quiet machine"
    return _hardware(name, entry, rec, "calibrated (not cached)", (note,))


def merge_peaks(
    cached: dict[str, float] | None, new: dict[str, float | None]
) -> dict[str, float | None]:
    """``new`` with each of :data:`PEAK_KEYS` raised to the ``cached`` figure where that is
    higher: the best reading of each peak over the quiet calibrations."""
    out = dict(new)
    for k in PEAK_KEYS:
        old = cached.get(k) if cached else None
        if isinstance(old, (int, float)) and old > float(out.get(k) or 0.0):
            out[k] = float(old)
    return out


def _reading(rec: dict[str, float | None]) -> str:
    flops, bw = float(rec.get("peak_flops") or 0.0), float(rec.get("peak_bw") or 0.0)
    return f"{flops / 1e9:.1f} GFLOP/s, {bw / 1e9:.1f} GB/s"


def _hardware(
    name: str, entry: _Entry | None, rec: dict, source: str, notes: tuple[str, ...] = ()
) -> Hardware:
    when = float(rec.get("measured_at") or 0.0)
    load = rec.get("load")
    load = float(load) if isinstance(load, (int, float)) else None
    if entry is not None:  # known GPU, dtype without a datasheet figure: measured FLOP/s
        return Hardware(
            entry.name, float(rec["peak_flops"]), entry.bw, entry.fp64, source, when, load, notes
        )
    int8 = rec.get("peak_ops_int8")
    return Hardware(
        name,
        float(rec["peak_flops"]),
        float(rec["peak_bw"]),
        float(rec["peak_flops_fp64"]),
        source,
        when,
        load,
        notes,
        float(int8) if isinstance(int8, (int, float)) and int8 > 0 else None,
    )


# -- floors beaten ------------------------------------------------------------------------------

_RECHECKED: set[tuple[str, str, str]] = set()
"""(device, dtype, hardware name) already re-calibrated by :func:`recheck` in this process."""


def beaten_floors(rows: Sequence[Any], slack: float = 1.0) -> list[str]:
    """Names of the kernel rows (``name``, ``floor_ms``, ``measured_ms``) measured faster than
    ``slack`` x their floor."""
    return [r.name for r in rows if r.floor_ms > 0 and r.measured_ms < slack * r.floor_ms]


def recheck(
    hw: Hardware,
    beaten: Sequence[str],
    device: torch.device | str,
    dtype: torch.dtype,
    cache_dir: str | Path | None = None,
) -> Hardware:
    """Peaks to use after kernels ``beaten`` ran faster than their floors under ``hw``: calibrated
    peaks are re-measured (once per process for a device and dtype), table peaks kept; either
    way the notes say so."""
    names = ", ".join(beaten)
    if not hw.source.startswith("calibrated"):
        note = f"{names} measured faster than the floor from the {hw.source} peaks"
        return replace(hw, notes=(*hw.notes, note))
    key = (str(torch.device(device)), str(dtype), hw.name)
    if key in _RECHECKED:
        note = f"{names} measured faster than the floor; already re-calibrated in this process"
        return replace(hw, notes=(*hw.notes, note))
    _RECHECKED.add(key)
    new = detect(device, dtype, cache_dir, recalibrate=True)
    note = f"{names} measured faster than the floor with the earlier {hw.describe()}: re-calibrated"
    return replace(new, notes=(note, *new.notes))


def floors_checked(
    hw: Hardware,
    rows_of: Callable[[Hardware], tuple[Any, ...]],
    device: torch.device | str,
    dtype: torch.dtype,
) -> tuple[Hardware, tuple[Any, ...]]:
    """``rows_of(hw)`` (kernel rows), re-done with :func:`recheck`'s peaks when a class beats
    its floor; the peaks used and the rows. A class still below its floor is noted."""
    rows = rows_of(hw)
    beaten = beaten_floors(rows)
    if not beaten:
        return hw, rows
    hw = recheck(hw, beaten, device, dtype)
    rows = rows_of(hw)
    if still := beaten_floors(rows):
        note = (
            f"{', '.join(still)} still measured faster than the floor: its data may fit in a "
            "cache, or --alpha/--beta are too high for this machine"
        )
        hw = replace(hw, notes=(*hw.notes, note))
    return hw, rows
