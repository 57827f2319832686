"""The sandbox layers, each applied in a throwaway interpreter (no torch): what the audit layer
refuses, what Landlock + the network namespace refuse even to native code (skipped where the
kernel lacks them), and a trial child that cannot apply its sandbox runs nothing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from time import monotonic

import pytest

from specpilot.pilot.proc import ChildProcess
from specpilot.pilot.sandbox import LAYERS, SandboxSpec, probe, read_paths

from .pilot_helpers import REPO

STRONG = {"landlock", "netns"} <= set(probe())
needs_strong = pytest.mark.skipif(not STRONG, reason="no Landlock / user namespaces here")

PROGRAM = """
import ctypes, json, os, socket, subprocess, sys
from specpilot.pilot.sandbox import SandboxSpec, apply
spec = SandboxSpec.from_arg(sys.argv[1])
apply(spec, os.getcwd())
libc = ctypes.CDLL(None, use_errno=True)
out = {}

def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except OSError as e:
        out[name] = f"{type(e).__name__}: {e}"

def raw_open(path, flags):
    fd = libc.open(path.encode(), flags, 0o644)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    os.close(fd)

def raw_connect(port):
    fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
    addr = (socket.AF_INET).to_bytes(2, "little") + port.to_bytes(2, "big") + bytes([127, 0, 0, 1])
    if libc.connect(fd, addr + bytes(8), 16) < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))

P = json.loads(sys.argv[2])
attempt("write_scratch", lambda: open("inside.txt", "w").write("x"))
attempt("read_system", lambda: open("/etc/hostname").read())
attempt("write_outside", lambda: open(P["outside"], "w").write("x"))
attempt("read_protected", lambda: open(P["secret"]).read())
attempt("list_protected", lambda: os.listdir(P["run"]))
attempt("socket", lambda: socket.create_connection(("127.0.0.1", P["port"]), timeout=2))
attempt("subprocess", lambda: subprocess.run(["true"]))
attempt("raw_write_outside", lambda: raw_open(P["outside"], os.O_WRONLY | os.O_CREAT))
attempt("raw_read_protected", lambda: raw_open(P["secret"], os.O_RDONLY))
attempt("raw_connect", lambda: raw_connect(P["port"]))
attempt("parent_environ", lambda: open(f"/proc/{os.getppid()}/environ", "rb").read())
attempt("signal_parent", lambda: os.kill(os.getppid(), 0))
print(json.dumps(out))
"""


@pytest.fixture
def world(tmp_path: Path) -> dict:
    run = tmp_path / "run"
    run.mkdir()
    (run / "journal.jsonl").write_text("held-back prompts")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.3)
    yield {"run": run, "scratch": scratch, "listener": listener, "outside": tmp_path / "out.txt"}
    listener.close()


def _sandboxed(world: dict, layers: tuple[str, ...]) -> dict[str, str]:
    read, conflicts = read_paths([REPO], [str(world["run"])])
    assert not conflicts
    spec = SandboxSpec(layers, read, (str(world["run"]),))
    params = {"outside": str(world["outside"]), "secret": str(world["run"] / "journal.jsonl"),
              "run": str(world["run"]), "port": world["listener"].getsockname()[1]}  # fmt: skip
    res = subprocess.run(
        [sys.executable, "-c", PROGRAM, spec.to_arg(), json.dumps(params)],
        cwd=world["scratch"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": REPO},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _no_connection(world: dict) -> None:
    with pytest.raises(TimeoutError):
        world["listener"].accept()


def test_probe_finds_layers() -> None:
    found = probe()
    assert "audit" in found and set(found) <= set(LAYERS)


def test_audit_layer_refuses_python_level_escapes(world: dict) -> None:
    got = _sandboxed(world, ("audit",))
    assert got["write_scratch"] == got["read_system"] == "ok"
    for name in ("write_outside", "read_protected", "list_protected", "socket", "subprocess"):
        assert got[name].startswith("PermissionError: sandbox (audit)"), (name, got[name])
    assert got["raw_write_outside"] == "ok"  # the documented gap: native code is not audited
    assert world["outside"].exists()


@needs_strong
def test_landlock_and_netns_refuse_native_code_too(world: dict) -> None:
    got = _sandboxed(world, ("landlock", "netns"))
    assert got["write_scratch"] == got["read_system"] == "ok"
    for name in ("write_outside", "read_protected", "list_protected", "raw_write_outside",
                 "raw_read_protected", "parent_environ", "signal_parent"):  # fmt: skip
        assert "Permission denied" in got[name] or "Operation not permitted" in got[name], (
            name, got[name],
        )  # fmt: skip
    for name in ("socket", "raw_connect"):  # denied by Landlock (TCP) or unreachable (netns)
        assert got[name] != "ok", name
    assert got["subprocess"] == "ok"  # allowed: it inherits the sandbox
    assert not world["outside"].exists()
    _no_connection(world)


def test_read_paths_never_contain_a_protected_path(tmp_path: Path) -> None:
    inner = tmp_path / "repo" / "runs" / "x"
    inner.mkdir(parents=True)
    paths, conflicts = read_paths([str(tmp_path / "repo")], [str(inner)])
    assert conflicts == [str((tmp_path / "repo").resolve())]
    assert not any(str(tmp_path) in p for p in paths)


def test_a_child_that_cannot_apply_its_sandbox_runs_nothing(tmp_path: Path) -> None:
    bad = SandboxSpec(("landlock", "teleport"), ()).to_arg()
    env = {**os.environ, "PYTHONPATH": REPO}
    child = ChildProcess(["--sandbox", bad], tmp_path / "child.log", tmp_path, env)
    try:
        for msg in ({"op": "describe", "module": "os", "ctx": {}, "plan": {}}, {"op": "setup"}):
            ans = child.request(msg, monotonic() + 30)
            assert ans["op"] == "error" and "sandbox not applied" in ans["message"]
            assert "teleport" in ans["message"]
    finally:
        child.kill()
