"""Linux Landlock through ``ctypes`` (no dependency): a filesystem and TCP allow-list that the
calling process puts on itself and every process it starts, irrevocably.

References: the kernel's ``Documentation/userspace-api/landlock.rst`` and
``include/uapi/linux/landlock.h`` (ABI 1: filesystem; 2: REFER; 3: TRUNCATE; 4: TCP bind/connect;
5: IOCTL_DEV; 6: scoping of abstract Unix sockets and signals). The syscall numbers 444-446 are
the same on every architecture (they were added after the syscall tables were unified).

Used by :mod:`specpilot.pilot.sandbox` in the trial subprocess, before any untrusted code is
imported and while the process is still single-threaded (a ruleset restricts the calling thread
and the threads and processes it creates afterwards).
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Iterable

SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446
CREATE_RULESET_VERSION = 1 << 0
RULE_PATH_BENEATH, RULE_NET_PORT = 1, 2
PR_SET_NO_NEW_PRIVS = 38

FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_REMOVE_DIR = 1 << 4
FS_REMOVE_FILE = 1 << 5
FS_MAKE_CHAR = 1 << 6
FS_MAKE_DIR = 1 << 7
FS_MAKE_REG = 1 << 8
FS_MAKE_SOCK = 1 << 9
FS_MAKE_FIFO = 1 << 10
FS_MAKE_BLOCK = 1 << 11
FS_MAKE_SYM = 1 << 12
FS_REFER = 1 << 13
FS_TRUNCATE = 1 << 14
FS_IOCTL_DEV = 1 << 15
NET_BIND_TCP = 1 << 0
NET_CONNECT_TCP = 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0
SCOPE_SIGNAL = 1 << 1

READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
"""Read-only (and execute: the interpreter and compilers may start helpers)."""
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
"""The rights a rule on a regular file (not a directory) may carry."""


def _fs_rights(abi: int) -> int:
    """Every filesystem right this ABI knows (all of them are handled, i.e. denied by default)."""
    rights = (1 << 13) - 1
    if abi >= 2:
        rights |= FS_REFER
    if abi >= 3:
        rights |= FS_TRUNCATE
    if abi >= 5:
        rights |= FS_IOCTL_DEV
    return rights


_L = ctypes.c_long
"""Every integer argument of the variadic ``syscall`` is passed as a full register."""


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def abi_version() -> int:
    """The kernel's Landlock ABI (0 when Landlock is missing or disabled)."""
    try:
        ver = _libc().syscall(_L(SYS_CREATE_RULESET), None, _L(0), _L(CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(int(ver), 0)


class LandlockError(OSError):
    """A Landlock call failed (the message names the call and the errno)."""


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise LandlockError(err, f"landlock {what}: {os.strerror(err)}")
    return ret


def restrict(
    read: Iterable[str],
    write: Iterable[str],
    devices: Iterable[str] = (),
    deny_tcp: bool = True,
) -> int:
    """Allow only: reading (and executing) beneath ``read``; everything beneath ``write``;
    reading, writing and device ioctls on the files in ``devices``; no TCP bind or connect when
    ``deny_tcp`` (ABI >= 4); no signals to, and no abstract Unix sockets of, processes outside
    the sandbox (ABI >= 6). Paths that do not exist are skipped. Returns the ABI enforced."""
    abi = abi_version()
    if abi < 1:
        raise LandlockError(0, "landlock is not available in this kernel")
    libc = _libc()
    handled_fs = _fs_rights(abi)
    handled_net = (NET_BIND_TCP | NET_CONNECT_TCP) if abi >= 4 and deny_tcp else 0
    scoped = (SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if abi >= 6 else 0
    if abi >= 6:
        attr = struct.pack("=QQQ", handled_fs, handled_net, scoped)
    elif abi >= 4:
        attr = struct.pack("=QQ", handled_fs, handled_net)
    else:
        attr = struct.pack("=Q", handled_fs)
    buf = ctypes.create_string_buffer(attr, len(attr))
    fd = _check(libc.syscall(_L(SYS_CREATE_RULESET), buf, _L(len(attr)), _L(0)), "create")
    try:
        rules = [(p, READ) for p in read] + [(p, handled_fs) for p in write]
        rules += [(p, FS_READ_FILE | FS_WRITE_FILE | FS_IOCTL_DEV) for p in devices]
        for path, rights in rules:
            _add_path(libc, fd, path, rights & handled_fs)
        _check(libc.prctl(_L(PR_SET_NO_NEW_PRIVS), _L(1), _L(0), _L(0), _L(0)), "no_new_privs")
        _check(libc.syscall(_L(SYS_RESTRICT_SELF), _L(fd), _L(0)), "restrict_self")
    finally:
        os.close(fd)
    return abi


def _add_path(libc: ctypes.CDLL, ruleset: int, path: str, rights: int) -> None:
    try:
        pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # a path that does not exist grants nothing
    try:
        if not os.path.isdir(path):
            rights &= FILE_RIGHTS
        attr = struct.pack("=Qi", rights, pfd)  # struct landlock_path_beneath_attr is packed
        buf = ctypes.create_string_buffer(attr, len(attr))
        ret = libc.syscall(_L(SYS_ADD_RULE), _L(ruleset), _L(RULE_PATH_BENEATH), buf, _L(0))
        _check(ret, f"add_rule {path}")
    finally:
        os.close(pfd)
