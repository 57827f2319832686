"""Converted-model cache: a GGUF file is dequantized once and stored as a Hugging Face directory.

The entry for a source file is ``<root>/<key>``, where the key hashes the resolved path, size and
modification time (and a format version), so an edited or replaced file gets a fresh entry. The
root is the ``cache_dir`` argument, else ``$SPECPILOT_CACHE``, else ``~/.cache/specpilot/models``.
Entries are written into a temporary sibling directory and renamed into place with ``os.replace``,
so a reader never sees a half-written entry and two concurrent writers cannot corrupt one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "SPECPILOT_CACHE"
CACHE_FORMAT = 1
"""Bump when the converted layout or the conversion changes; old entries are then ignored."""


def cache_root(cache_dir: str | Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "specpilot" / "models"


def cache_key(source: Path) -> str:
    """Hash of the resolved path, size and mtime of ``source`` (plus :data:`CACHE_FORMAT`)."""
    st = source.stat()
    ident = f"v{CACHE_FORMAT}\0{source.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode("utf-8")).hexdigest()[:24]


def cache_entry(source: Path, cache_dir: str | Path | None = None) -> Path:
    """Where the converted copy of ``source`` lives (it may not exist yet)."""
    return cache_root(cache_dir) / f"{source.stem}-{cache_key(source)}"


def is_complete(entry: Path, required: tuple[str, ...]) -> bool:
    return entry.is_dir() and all((entry / name).is_file() for name in required)


def write_atomic(entry: Path, write: Callable[[Path], None]) -> Path:
    """Create directory ``entry`` by calling ``write(tmp_dir)`` then renaming ``tmp_dir``.

    If another process finished the same entry first, its copy wins and ours is discarded.
    Raises ``OSError`` if the cache root is not writable.
    """
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", suffix=".tmp", dir=entry.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; an entry is an ordinary directory
        write(tmp)
        try:
            os.replace(tmp, entry)
        except OSError:
            if not entry.is_dir():
                raise
            # lost the race to a concurrent writer: keep theirs
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return entry
