"""The sandbox of trial subprocesses that import agent-written code.

Layers, each detected at run time (:func:`probe`) and applied by the child itself at start, before
it imports torch or any untrusted module, while it is still single-threaded (:func:`apply`):

* ``netns``    - a new user and network namespace (``unshare(CLONE_NEWUSER | CLONE_NEWNET)``):
                 the only interface is a loopback that is down, so no packet leaves the process;
* ``landlock`` - a Landlock ruleset (:mod:`.landlock`): read-only access to the interpreter,
                 the installed packages, the specpilot package, the model files and system
                 directories (``/usr``, ``/lib*``, ``/etc``, ``/proc``, ``/sys``, ``/dev``);
                 read-write access to the child's scratch directory (its working directory, which
                 the trial deletes) and nothing else. The run directory (journal: held-back
                 prompts; references) and the memory database are never granted. TCP bind and
                 connect are denied (ABI >= 4); signals and abstract Unix sockets cannot reach
                 processes outside the sandbox, and it cannot ptrace them or read their
                 ``/proc/PID/environ`` or memory (ABI >= 6, and Landlock's ptrace rule);
* ``audit``    - a Python audit hook (:func:`sys.addaudithook`) refusing socket creation,
                 subprocesses, signals to other processes, file writes outside the scratch
                 directory and any access to the protected paths. It is advisory: native code
                 (``ctypes``, extension modules) does not raise audit events and can bypass it.
The *level* is the ``+``-joined list of layers in force, e.g. ``landlock+netns+audit`` (strong)
or ``audit`` (the weak fallback). Time and memory limits (``RLIMIT_AS``, request and trial
deadlines, SIGSTOP outside requests, killing the whole process tree) come from the trial harness
(:mod:`specpilot.pilot.trial`) at every level. This module imports only the standard library.
"""

from __future__ import annotations

import contextlib
import json
import os
import site
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
LAYERS = ("landlock", "netns", "audit")
SYSTEM_READ = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/proc",
               "/sys", "/dev")  # fmt: skip
WRITABLE_DEVICES = ("/dev/null", "/dev/zero", "/dev/full")


class SandboxError(RuntimeError):
    """A requested layer could not be applied (the child then refuses to run anything)."""


@dataclass(frozen=True)
class SandboxSpec:
    """What the parent asks of a child (JSON on the child's command line)."""

    layers: tuple[str, ...]
    """Layers to apply; each one is required (see :data:`LAYERS`)."""
    read: tuple[str, ...] = ()
    """Read-only paths (Landlock)."""
    protected: tuple[str, ...] = ()
    """Paths no sandboxed code may touch (run directory, memory database) except read paths
    inside them (the agent source directory); the audit layer checks them, and the read paths
    never contain them (:func:`read_paths`)."""
    devices: tuple[str, ...] = field(default_factory=lambda: _devices())
    """Device files granted read-write (null/zero/full, GPUs)."""

    @property
    def level(self) -> str:
        return "+".join(self.layers) or "none"

    def to_arg(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_arg(cls, arg: str) -> SandboxSpec:
        d = json.loads(arg)
        return cls(**{k: tuple(v) for k, v in d.items()})


def _devices() -> tuple[str, ...]:
    gpu: list[str] = []
    with contextlib.suppress(OSError):
        gpu = sorted(f"/dev/{n}" for n in os.listdir("/dev") if n.startswith(("nvidia", "dri")))
    return (*WRITABLE_DEVICES, *gpu)


def _inside(path: str, root: str) -> bool:
    """True when ``path`` is ``root`` or beneath it (both resolved)."""
    p, r = os.path.realpath(path), os.path.realpath(root)
    return p == r or p.startswith(r.rstrip(os.sep) + os.sep)


def read_paths(extra: Iterable[str], protected: Sequence[str]) -> tuple[tuple[str, ...], list[str]]:
    """The read-only paths of a sandboxed child: the interpreter, its packages, specpilot, the
    system directories and ``extra`` (model files, ``--python-path``, agent source directories).
    Returns (paths, conflicts): a path that contains a protected one is a conflict (left out)."""
    import specpilot

    cands = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable)),
             str(Path(specpilot.__file__).resolve().parents[1]), *site.getsitepackages(),
             *sys.path[1:], *SYSTEM_READ, *extra]  # fmt: skip
    out: list[str] = []
    conflicts: list[str] = []
    for c in cands:
        if not c or not os.path.exists(c):
            continue
        real = os.path.realpath(c)
        if any(_inside(p, real) for p in protected):
            conflicts.append(real)
        elif real not in out:
            out.append(real)
    return tuple(out), conflicts


# -- detection (parent) ------------------------------------------------------------------------


def probe(python: str | None = None, timeout: float = 30.0) -> tuple[str, ...]:
    """The layers a child on this machine can apply, found by applying them in a throwaway
    subprocess (namespaces and Landlock change the calling process for good)."""
    code = "import json, specpilot.pilot.sandbox as s; print(json.dumps(s._probe_child()))"
    try:
        out = subprocess.run(
            [python or sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PYTHONPATH": _pythonpath()},
        )
        got = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return ("audit",)
    return tuple(layer for layer in LAYERS if layer in got)


def _pythonpath() -> str:
    import specpilot

    src = str(Path(specpilot.__file__).resolve().parents[1])
    return os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])


def _probe_child() -> list[str]:
    got = []
    try:
        unshare_net()
        got.append("netns")
    except OSError:
        pass
    try:
        from specpilot.pilot.landlock import restrict

        restrict(read=(sys.prefix,), write=())
        got.append("landlock")
    except OSError:
        pass
    got.append("audit")
    return got


# -- application (child) -----------------------------------------------------------------------


def unshare_net() -> None:
    """Move this (single-threaded) process into a new user + network namespace."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(ctypes.c_int(CLONE_NEWUSER | CLONE_NEWNET)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWUSER|CLONE_NEWNET): {os.strerror(err)}")


def apply(spec: SandboxSpec, scratch: str) -> str:
    """Apply every layer of ``spec`` to this process (scratch = the only writable directory).
    Raises :class:`SandboxError` when a layer fails: the caller must then run nothing."""
    unknown = sorted(set(spec.layers) - set(LAYERS))
    if unknown:
        raise SandboxError(f"unknown sandbox layer(s) {unknown}")
    scratch = os.path.realpath(scratch)
    if any(_inside(scratch, p) for p in spec.protected):
        raise SandboxError(f"the scratch directory {scratch} lies inside a protected path")
    try:
        if "netns" in spec.layers:
            unshare_net()
        if "landlock" in spec.layers:
            from specpilot.pilot.landlock import restrict

            restrict(spec.read, (scratch,), spec.devices)
    except OSError as e:
        raise SandboxError(f"sandbox ({spec.level}) could not be applied: {e}") from None
    sys.dont_write_bytecode = True  # nothing to cache outside the scratch directory
    if "audit" in spec.layers:
        sys.addaudithook(AuditGuard(scratch, spec.protected, spec.devices, spec.read))
    return spec.level


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                "os.link", "os.symlink", "os.truncate", "os.utime", "shutil.rmtree",
                "shutil.copyfile", "shutil.move", "os.mkfifo", "os.mknod"}  # fmt: skip
_BLOCKED = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
            "os.forkpty", "pty.spawn", "socket.__new__", "socket.connect", "socket.bind",
            "socket.sendto", "socket.sendmsg", "socket.getaddrinfo", "sys.remote_exec",
            "webbrowser.open"}  # fmt: skip
_READ_EVENTS = {"os.listdir", "os.scandir", "glob.glob", "os.chdir"}


class AuditGuard:
    """The audit layer: raises PermissionError on the events it refuses."""

    def __init__(self, scratch: str, protected: Sequence[str], devices: Sequence[str],
                 read: Sequence[str] = ()) -> None:  # fmt: skip
        self.scratch = scratch
        self.protected = tuple(os.path.realpath(p) for p in protected)
        self.inner = tuple(r for r in read if any(_inside(r, p) for p in self.protected))
        """Read paths inside a protected one (the agent source directory in the run dir)."""
        self.devices = tuple(devices)
        self.pid = os.getpid()

    def _path(self, p: Any) -> str | None:
        if isinstance(p, bytes):
            p = os.fsdecode(p)
        if isinstance(p, os.PathLike):
            p = os.fspath(p)
        return os.path.realpath(p) if isinstance(p, str) else None

    def _refuse(self, event: str, what: str) -> None:
        raise PermissionError(f"sandbox (audit): {event} {what} is not allowed")

    def _check_protected(self, event: str, path: str | None) -> None:
        if path is None or any(_inside(path, r) for r in self.inner):
            return
        if any(_inside(path, p) for p in self.protected):
            self._refuse(event, path)

    def _writable(self, path: str | None) -> bool:
        return path is None or _inside(path, self.scratch) or path in self.devices

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path = self._path(args[0]) if args else None
            self._check_protected(event, path)
            mode = args[1] if len(args) > 1 else None
            flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(
                flags & _WRITE_FLAGS
            )
            if writes and not self._writable(path):
                self._refuse("writing", str(path))
        elif event in _BLOCKED or event.startswith("os.exec") or event.startswith("os.spawn"):
            self._refuse(event, "")
        elif event in ("os.kill", "os.killpg", "signal.pthread_kill") and args:
            if args[0] not in (self.pid, 0):
                self._refuse(event, str(args[0]))
        elif event in _PATH_EVENTS:
            for a in args:
                path = self._path(a)
                self._check_protected(event, path)
                if path is not None and not self._writable(path):
                    self._refuse(event, path)
        elif event in _READ_EVENTS and args:
            self._check_protected(event, self._path(args[0]))
