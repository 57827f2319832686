"""Build, cache and load the C++ kernels (``csrc/``) on first use.

The kernel translation units (:data:`PORTABLE_UNITS`, and on x86 :data:`AVX2_UNITS` with
``-mavx2 -mfma -mf16c``, :data:`AVX512_UNITS` with AVX-512 F/BW/DQ/VL and VNNI as well and
:data:`AMX_UNITS` with AMX-TILE/INT8 on top; a compiler that cannot build the wider ones keeps
the narrower path) are compiled to objects with their own
flags, then the torch op registrations (:data:`OP_UNITS`: ``ops.cpp`` defines the
``specpilot`` library, other units add to it with ``TORCH_LIBRARY_FRAGMENT``) are built by
``torch.utils.cpp_extension.load`` and linked with them. Every unit gets
``-ffp-contract=off``: no multiply-add is fused unless the source says so. The build directory is
``$SPECPILOT_KERNELS_DIR/<key>`` (else ``~/.cache/specpilot/kernels/<key>``); the key
hashes the sources, the flags, the compiler and the torch version, so a changed input builds anew.
Processes share a build through an advisory lock on ``<key>/build.lock`` (``flock``: the kernel
drops it when its holder dies), so a build killed half-way (Ctrl-C, a trial's time limit) never
leaves later processes waiting on torch's own ``lock`` file, which a killed holder leaves behind;
a finished build is loaded with :func:`torch.ops.load_library` without running ninja again.
Failure is never raised: :func:`load` returns the one-line reason and callers fall back to fp32.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

CSRC = Path(__file__).parent / "csrc"
COMMON_FLAGS = ("-std=c++17", "-O3", "-fPIC", "-ffp-contract=off")
AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
PORTABLE_UNITS = ("gemm_scalar.cpp", "gemm_q8_scalar.cpp", "attention_scalar.cpp",
    "rowops_scalar.cpp",
)
"""Kernels compiled for any CPU."""
AVX2_UNITS = ("gemm_avx2.cpp", "gemm_q8_avx2.cpp", "attention_avx2.cpp",
    "rowops_avx2.cpp",
)
"""Kernels compiled with AVX2_FLAGS (x86 only), called after a run-time CPU check."""
AVX512_FLAGS = (*AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl",
                "-mavx512vnni")
AVX512_UNITS = ("gemm_avx512.cpp", "gemm_q8_avx512.cpp", "attention_avx512.cpp")
"""The GEMMs and the attention compiled with AVX512_FLAGS (x86 only), called after a run-time
CPU check."""
AMX_FLAGS = (*AVX512_FLAGS, "-mamx-tile", "-mamx-int8")
AMX_UNITS = ("gemm_q8_amx.cpp",)
"""The int8 GEMM's AMX schedule, compiled with AMX_FLAGS (x86 only), called after a run-time
check of the CPU and of the process's permission to use the tiles."""
OP_UNITS = ("ops.cpp", "ops_q8.cpp", "attention_ops.cpp",
    "rowops_ops.cpp", "forward_ops.cpp",
)
"""Torch op registrations (compiled by cpp_extension with torch's headers)."""
OPENMP_FLAGS = ("-fopenmp",)
"""The op units' ``at::parallel_for`` splits work over torch's threads only when compiled with
OpenMP (its header runs the loop inline on the calling thread otherwise); the linked
``libgomp.so.1`` is the one torch has already loaded. A compiler without OpenMP builds the ops
without it: the same bits (threads split output columns or rows only), on one thread."""
BUILD_VERSION = 3
"""Bump to force a rebuild when the build itself changes."""

_lock = threading.Lock()
_state: dict[str, str | None] = {}
_fakes: dict[str, bool] = {}
"""Op groups whose fake kernels are registered (see :func:`ops`)."""


KERNELS_ENV = "SPECPILOT_KERNELS_DIR"


def build_root() -> Path:
    """``$SPECPILOT_KERNELS_DIR``, else ``~/.cache/specpilot/kernels``. Deliberately not under
    ``$SPECPILOT_CACHE``: a build is keyed by its inputs, so every model cache (a test's temporary
    one included) can share it instead of compiling for minutes again."""
    env = os.environ.get(KERNELS_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "specpilot" / "kernels"


def _compiler() -> str | None:
    cxx = os.environ.get("CXX", "c++")
    return shutil.which(cxx)


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def build_key(cxx: str) -> str:
    h = hashlib.sha256()
    for p in sorted(CSRC.iterdir()):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    flags = (COMMON_FLAGS, AVX2_FLAGS, AVX512_FLAGS, AMX_FLAGS, OPENMP_FLAGS)
    h.update(f"{BUILD_VERSION}\0{torch.__version__}\0{cxx}\0{flags}".encode())
    return h.hexdigest()[:16]


def _compile_object(cxx: str, src: Path, out: Path, flags: tuple[str, ...]) -> None:
    """Compile one kernel unit to ``out`` atomically (a temporary file renamed into place)."""
    if out.exists():
        return
    fd, tmp = tempfile.mkstemp(suffix=".o", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *COMMON_FLAGS, *flags, "-c", str(src), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"compiling {src.name} failed: {last}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` for the block (none where ``fcntl`` is missing)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: builds are not shared safely, as torch's alone
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _load_built(out: Path, key: str) -> bool:
    """Load the op library of ``key`` from ``out`` if it was built: True when loaded. A library
    a killed linker left unreadable is removed, to be built again."""
    lib = out / f"specpilot_kernels_{key}.so"
    if not lib.exists():
        return False
    try:
        torch.ops.load_library(str(lib))
    except OSError:
        lib.unlink(missing_ok=True)
        return False
    _state["key"] = key
    return True


def _build() -> None:
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    key = build_key(cxx)
    out = build_root() / key
    out.mkdir(parents=True, exist_ok=True)
    with _exclusive(out / "build.lock"):
        if _load_built(out, key) or _load_built(out, key + "s"):
            return
        (out / "lock").unlink(missing_ok=True)  # torch's baton: any live holder holds ours too
        _compile_and_load(cxx, key, out)


def _compile_and_load(cxx: str, key: str, out: Path) -> None:
    from torch.utils import cpp_extension

    units = [(u, ()) for u in PORTABLE_UNITS]
    defines = []
    if _x86():
        units += [(u, AVX2_FLAGS) for u in AVX2_UNITS]
    else:
        defines.append("-DSP_NO_AVX2")
    objs = []
    for unit, flags in units:
        objs.append(out / (Path(unit).stem + ".o"))
        _compile_object(cxx, CSRC / unit, objs[-1], flags)
    # optional: a compiler without AVX-512 VNNI (or AMX) support keeps the narrower path
    for wide_units, flags, define in ((AVX512_UNITS, AVX512_FLAGS, "-DSP_NO_AVX512"),
                                      (AMX_UNITS, AMX_FLAGS, "-DSP_NO_AMX")):
        if not _x86() or "-DSP_NO_AVX512" in defines:
            defines.append(define)
            continue
        try:
            wide = [out / (Path(u).stem + ".o") for u in wide_units]
            for unit, obj in zip(wide_units, wide, strict=True):
                _compile_object(cxx, CSRC / unit, obj, flags)
            objs += wide
        except RuntimeError:
            defines.append(define)
    try:
        _load_ops(cpp_extension, key, out, [*defines, *OPENMP_FLAGS], objs, OPENMP_FLAGS)
        _state["key"] = key
    except Exception:  # a compiler without OpenMP: the same ops, on one thread
        _load_ops(cpp_extension, key + "s", out, defines, objs, ())
        _state["key"] = key + "s"


def _load_ops(cpp_extension: Any, key: str, out: Path, cflags: list[str], objs: list[Path],
              ldflags: tuple[str, ...]) -> None:
    cpp_extension.load(
        name=f"specpilot_kernels_{key}",
        sources=[str(CSRC / u) for u in OP_UNITS],
        extra_cflags=[*COMMON_FLAGS[1:], *cflags],
        extra_ldflags=[str(o) for o in objs] + list(ldflags),
        extra_include_paths=[str(CSRC)],
        build_directory=str(out),
        is_python_module=False,
        verbose=False,
    )


def ops(group: str, register_fakes: Callable[[], None]) -> Any:
    """``torch.ops.specpilot`` built and loaded, with the fake (meta) kernels of the op group
    ``group`` registered once by ``register_fakes`` (torch.compile traces the ops through them).
    Raises RuntimeError with the one-line reason when the kernels are unavailable."""
    if _fakes.get(group):  # loaded before: no lock to take (torch.compile traces through this)
        return torch.ops.specpilot
    reason = load()
    if reason is not None:
        raise RuntimeError(reason)
    with _lock:
        if not _fakes.get(group):
            register_fakes()
            _fakes[group] = True
    return torch.ops.specpilot


def loaded_key() -> str | None:
    """The build key of the loaded ops (``s`` appended: built without OpenMP), None when not
    loaded: a measurement of the kernels' speed (the goodput curve) is keyed by it."""
    return _state.get("key")


def load() -> str | None:
    """Build and load the ops: None when ``torch.ops.specpilot`` is ready, else why not."""
    with _lock:
        if "reason" not in _state:
            try:
                _build()
                _state["reason"] = None
            except Exception as e:  # any build or load failure means: use the fp32 path
                msg = " ".join(str(e).split()) or type(e).__name__
                _state["reason"] = f"native GGUF kernels unavailable: {msg[:300]}"
        return _state["reason"]
