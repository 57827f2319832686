"""Output paths a user names on the command line: checked before the work starts, never lost.

:func:`check_output_path` is the one check every command with an output path runs first (bench
and profile ``--json``/``--html``, optimize and train-drafter ``--out``, memory export): a
directory where a file is expected, a file on the way (``FILE/sub``), a missing parent or a place
that cannot be written (``/proc/x``, a read-only directory) is a one-line :class:`ConfigError`
before anything runs. An existing output directory that the command does not own (not a drafter
directory, say) is refused unless the user passed ``--overwrite``; then :func:`move_aside` keeps
the old one, under a visible sibling name, once the new one is complete.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from specpilot.errors import ConfigError


def _nearest_existing(p: Path) -> Path:
    """The deepest existing ancestor of ``p`` (``p`` itself excluded)."""
    for a in p.parents:
        if a.exists() or a.is_symlink():
            return a
    return Path(p.anchor or ".")


def _probe(directory: Path, flag: str, path: str | Path) -> None:
    """Create and remove a file in ``directory``: the only check root and odd filesystems obey."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".specpilot-probe-", dir=directory)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise ConfigError(
            f"{flag} {path}: cannot write in {directory} ({e.strerror or e}); choose another path"
        ) from None


def check_output_path(
    path: str | Path,
    flag: str,
    *,
    kind: str = "file",
    overwrite: bool | None = True,
    reusable: Callable[[Path], bool] | None = None,
    what: str = "",
) -> Path:
    """Check that ``path`` (given as ``flag``) can take the command's output; the expanded path.

    ``kind`` "file": an existing file is replaced (unless ``overwrite`` is False); an existing
    directory, a missing parent or an unwritable one is an error. ``kind`` "dir": missing parent
    directories are created later; an existing file or an existing directory for which
    ``reusable`` is not True (``what`` names what it should be) is an error unless
    ``overwrite``, in which case the caller moves it aside (:func:`move_aside`) after its new
    output is complete. ``overwrite`` None: refused, and the command has no ``--overwrite``.
    """
    if kind not in ("file", "dir"):
        raise ValueError(f"kind must be file or dir, got {kind!r}")
    p = Path(path).expanduser()
    if not str(path).strip():
        raise ConfigError(f"{flag} needs a path")
    base = _nearest_existing(p)
    if not base.is_dir():
        raise ConfigError(f"{flag} {path}: {base} is a file, not a directory")
    if kind == "file" and base != p.parent:
        raise ConfigError(f"{flag} {path}: directory {p.parent} does not exist")
    if p.exists() or p.is_symlink():
        _check_existing(p, flag, path, kind, overwrite, reusable, what)
        if kind == "file":  # an existing file is rewritten in place: it must be writable
            if not os.access(p, os.W_OK):
                raise ConfigError(f"{flag} {path}: the file exists and is not writable")
            return p
    _probe(base if not p.is_dir() else p, flag, path)
    return p


def _check_existing(
    p: Path,
    flag: str,
    path: str | Path,
    kind: str,
    overwrite: bool | None,
    reusable: Callable[[Path], bool] | None,
    what: str,
) -> None:
    if kind == "file":
        if p.is_dir():
            raise ConfigError(f"{flag} {path} is a directory; give a file name (e.g. {p}/out.json)")
        if not overwrite:
            hint = "" if overwrite is None else " or pass --overwrite"
            raise ConfigError(f"{flag} {path} exists; choose another path{hint}")
        return
    if p.is_dir() and (reusable is None or reusable(p)):
        return
    if overwrite:
        return
    is_what = "is a file" if not p.is_dir() else f"exists and is not {what or 'ours'}"
    hint = (
        ""
        if overwrite is None
        else ", or pass --overwrite (the old one is then moved aside, not deleted, once the new "
        "one is complete)"
    )
    raise ConfigError(f"{flag} {path} {is_what}; choose another path{hint}")


def move_aside(path: Path) -> Path:
    """Rename ``path`` to a free sibling ``NAME.old-YYYYmmdd-HHMMSS[-n]``; the new name."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        aside = path.with_name(f"{path.name}.old-{stamp}" + (f"-{n}" if n else ""))
        if not aside.exists() and not aside.is_symlink():
            os.replace(path, aside)
            return aside
    raise ConfigError(f"cannot find a free name to move {path} aside")
