"""Child processes for trials: framed pipes with deadlines, stop/continue, and killing whole trees.

A trial's decoding runs in an untrusted child process started in its own session (so its own
process group). The trusted parent talks to it over two dedicated pipes (not stdin/stdout: the
child's prints go to a log file and cannot corrupt the protocol) with length-prefixed JSON frames
(4-byte big-endian length, UTF-8 JSON; frames over :data:`MAX_FRAME` are a protocol error).

* Deadlines: every read waits with ``select`` until a deadline; past it the caller gets
  :class:`ChildTimeout` and kills the tree. A read given an ``abort`` event (set on the first
  SIGINT) checks it every :data:`ABORT_POLL_S` and raises :class:`ChildInterrupted`.
* Killing: :meth:`ChildProcess.kill` sends SIGKILL to the process group, to every descendant
  (psutil's process tree), and to every process whose environment carries the trial's random
  token (grandchildren that left the group with ``setsid`` and were re-parented) - the
  OpenEvolve #79 failure mode (a timeout that leaves grandchildren running) is closed three ways.
* Stop/continue: the parent keeps the child's group stopped (SIGSTOP) whenever it is not serving a
  request, so a background thread can neither precompute outside the timed window nor steal CPU
  from the other plan being timed.
* :class:`TimingSlot`: a reader/writer file lock per device. Work (model loading, forcing,
  references) holds it shared; timing holds it exclusive, so on a CPU machine no timed request
  overlaps any other trial's work, across threads, processes and Ray actors alike.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import select
import signal
import struct
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from time import monotonic as _monotonic
from typing import Any, Protocol

MAX_FRAME = 64 << 20
TOKEN_ENV = "SPECPILOT_TRIAL_TOKEN"
_HEADER = struct.Struct(">I")
ABORT_POLL_S = 0.1


class Abort(Protocol):
    """What a read polls to stop early (a :class:`threading.Event`)."""

    def is_set(self) -> bool: ...


class ChildError(Exception):
    """Base: the child did not answer as the protocol requires."""


class ChildTimeout(ChildError):
    """No complete answer before the deadline."""


class ChildGone(ChildError):
    """The child closed its pipe (exited, crashed, was killed)."""


class ProtocolError(ChildError):
    """The child sent something that is not a valid frame."""


class ChildInterrupted(ChildError):
    """The run was asked to stop (SIGINT) while waiting for the child."""


def write_frame(fd: int, obj: Any) -> None:
    """Write one frame (blocking)."""
    data = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    if len(data) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds {MAX_FRAME}")
    buf = _HEADER.pack(len(data)) + data
    view = memoryview(buf)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def read_frame_blocking(fd: int) -> Any:
    """Read one frame without a deadline (the child side); None at end of file."""
    head = _read_exact(fd, _HEADER.size)
    if head is None:
        return None
    (n,) = _HEADER.unpack(head)
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    body = _read_exact(fd, n)
    if body is None:
        raise ProtocolError("pipe closed inside a frame")
    return json.loads(body)


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        b = os.read(fd, n - got)
        if not b:
            return None if got == 0 else b"".join(chunks)
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


class FrameReader:
    """Reads frames from a non-blocking fd with deadlines (the parent side)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()
        os.set_blocking(fd, False)

    def read(self, deadline: float, abort: Abort | None = None) -> Any:
        """The next frame, waiting until ``deadline`` (``time.monotonic`` seconds) or until
        ``abort`` is set."""
        while True:
            if len(self.buf) >= _HEADER.size:
                (n,) = _HEADER.unpack_from(self.buf)
                if n > MAX_FRAME:
                    raise ProtocolError(f"child sent a frame of {n} bytes (limit {MAX_FRAME})")
                if len(self.buf) >= _HEADER.size + n:
                    body = bytes(self.buf[_HEADER.size : _HEADER.size + n])
                    del self.buf[: _HEADER.size + n]
                    try:
                        return json.loads(body)
                    except (UnicodeDecodeError, json.JSONDecodeError) as e:
                        raise ProtocolError(f"child sent a frame that is not JSON: {e}") from None
            if abort is not None and abort.is_set():
                raise ChildInterrupted("the run was interrupted")
            left = deadline - _monotonic()
            if left <= 0:
                raise ChildTimeout("no answer before the deadline")
            wait = left if abort is None else min(left, ABORT_POLL_S)
            ready, _, _ = select.select([self.fd], [], [], wait)
            if not ready:
                continue
            try:
                b = os.read(self.fd, 1 << 20)
            except BlockingIOError:
                continue
            if not b:
                raise ChildGone("the child closed its pipe")
            self.buf.extend(b)


class ChildProcess:
    """One trial subprocess: its own session/group, two protocol pipes, a log file."""

    def __init__(
        self,
        args: Sequence[str],
        log_path: Path,
        cwd: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.token = secrets.token_hex(16)
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        full_env = dict(os.environ if env is None else env)
        full_env[TOKEN_ENV] = self.token
        self.log_path = log_path
        cmd = [
            sys.executable,
            "-m",
            "specpilot.pilot.child",
            "--fd-in",
            str(to_child_r),
            "--fd-out",
            str(from_child_w),
            "--parent-pid",
            str(os.getpid()),
            *args,
        ]
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(to_child_r, from_child_w),
                start_new_session=True,
                cwd=str(cwd),
                env=full_env,
            )
        os.close(to_child_r)
        os.close(from_child_w)
        self.pid = self.proc.pid
        self._w = to_child_w
        self._reader = FrameReader(from_child_r)
        self._r = from_child_r
        self.stopped = False
        self.killed = False

    def request(
        self, msg: dict[str, Any], deadline: float, abort: Abort | None = None
    ) -> dict[str, Any]:
        """Send ``msg`` and wait for the answer until ``deadline`` (monotonic seconds)."""
        try:
            write_frame(self._w, msg)
        except (BrokenPipeError, OSError) as e:
            raise ChildGone(f"cannot write to the child: {e}") from None
        return self.read(deadline, abort)

    def read(self, deadline: float, abort: Abort | None = None) -> dict[str, Any]:
        ans = self._reader.read(deadline, abort)
        if not isinstance(ans, dict) or not isinstance(ans.get("op"), str):
            raise ProtocolError(f"child answered {str(ans)[:80]!r}, expected an object with 'op'")
        return ans

    def stop(self) -> None:
        """Freeze the whole group (no-op once it has exited)."""
        if not self.stopped and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGSTOP)
            self.stopped = True

    def cont(self) -> None:
        if self.stopped:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGCONT)
            self.stopped = False

    def close(self, deadline: float) -> None:
        """Ask the child to exit; kill the tree if it has not by ``deadline``."""
        self.cont()
        with contextlib.suppress(OSError):
            write_frame(self._w, {"op": "exit"})
        left = max(0.0, deadline - _monotonic())
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=left)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the group, every descendant and every process carrying the token; reap."""
        kill_tree(self.pid, self.token)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        for fd in (self._w, self._r):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.killed = True

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def log_tail(self, n: int = 1200) -> str:
        """The last ``n`` characters of the child's stdout/stderr log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - n))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""


def _descendants(root: int) -> list[int]:
    import psutil  # not at import time: the trial child imports this module for framing only

    try:
        return [p.pid for p in psutil.Process(root).children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def _carrying(token: str) -> list[int]:
    """Processes whose environment holds ``TOKEN_ENV=token`` (readable ones: our own user's)."""
    import psutil

    me = os.getpid()
    found = []
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            if p.environ().get(TOKEN_ENV) == token:
                found.append(p.pid)
        except (psutil.Error, OSError):
            continue
    return found


def kill_tree(pid: int, token: str | None = None) -> None:
    """SIGKILL process group ``pid``, its descendants and processes carrying ``token``."""
    victims = set(_descendants(pid))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    if token:
        victims.update(_carrying(token))
    victims.add(pid)
    for v in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(v, signal.SIGKILL)


class TimingSlot:
    """A reader/writer lock on ``path`` (``flock``): shared for work, exclusive for timing.

    Works across threads (each acquisition opens its own file description), processes and Ray
    actors on one machine. ``path=None`` is a no-op slot (one trial per device: nothing shares).
    """

    def __init__(self, path: str | Path | None) -> None:
        self.path = None if path is None else str(path)
        if self.path is not None:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def _hold(self, exclusive: bool) -> Iterator[None]:
        """A turnstile file gives waiting writers priority: a reader passes through it (briefly
        exclusive) before taking the shared lock; a writer holds it until it owns the lock."""
        if self.path is None:
            yield
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        gate = os.open(self.path + ".gate", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(gate, fcntl.LOCK_EX)
            if exclusive:
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.close(gate)
            else:
                os.close(gate)
                fcntl.flock(fd, fcntl.LOCK_SH)
            gate = -1
            yield
        finally:
            if gate >= 0:
                os.close(gate)
            os.close(fd)  # closing the description releases the lock

    def shared(self) -> contextlib.AbstractContextManager[None]:
        return self._hold(False)

    def exclusive(self) -> contextlib.AbstractContextManager[None]:
        return self._hold(True)
