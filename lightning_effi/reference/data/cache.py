"""Cache directory, checksums and atomic writes.

Every cache entry lives under :func:`default_cache_dir` (or an explicit ``cache_dir``) and is keyed by a hash of the
source content (or its checksum) plus every parameter that changes the result, see :func:`cache_key`. Entries are
written atomically: files through a temporary file in the same directory followed by :func:`os.replace`, multi-file
entries as a temporary directory renamed into place. An interrupted run therefore leaves either a complete entry or
nothing (at most a ``.tmp-*`` leftover that is never read, removed by :func:`resolve_cache_dir` once it is an hour
old), and the next run simply rebuilds it. Entry folders are made ``0755`` and files ``0644`` so a shared cache is
readable by others. A full disk while writing raises :class:`DataConfigError` naming the cache directory, leaving no
partial entry. An entry found damaged when loaded is removed with :func:`discard_entry` and rebuilt (see
``EffiDataModule.setup``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from lightning_effi.core.errors import DataConfigError

__all__ = [
    "CacheFileError",
    "NpyFile",
    "atomic_dir",
    "atomic_write",
    "cache_key",
    "default_cache_dir",
    "discard_entry",
    "file_md5",
    "load_npy",
    "resolve_cache_dir",
    "texts_sha256",
]

CACHE_ENV = "EFFI_CACHE_DIR"
STALE_TMP_SECONDS = 3600  # .tmp-* leftovers older than this are removed by resolve_cache_dir
_NO_SPACE = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


class CacheFileError(OSError):
    """A cache file cannot be read (truncated, empty or not in the expected format); the message names it."""


def default_cache_dir() -> Path:
    """``$EFFI_CACHE_DIR`` if set, else ``~/.cache/lightning_effi`` (not created here)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lightning_effi"


def resolve_cache_dir(cache_dir: str | os.PathLike | None = None, *subdirs: str) -> Path:
    """``cache_dir`` (or :func:`default_cache_dir`) joined with ``subdirs``, created if missing; ``.tmp-*``
    leftovers of interrupted writes older than :data:`STALE_TMP_SECONDS` in it are removed.

    Raises:
        DataConfigError: the directory cannot be created or is not a directory (names ``data.cache_dir``).
    """
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = base.joinpath(*subdirs)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataConfigError(
            f"data.cache_dir: '{base}' cannot be used as the cache directory "
            f"({type(err).__name__}: {err}); expected a writable directory (set paths.cache_dir "
            f"or ${CACHE_ENV})"
        ) from None
    _remove_stale_tmp(path)
    return path


def _remove_stale_tmp(directory: Path, max_age: float = STALE_TMP_SECONDS) -> None:
    now = time.time()
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if not entry.name.startswith(".tmp-"):
                continue
            with contextlib.suppress(OSError):
                if now - entry.stat(follow_symlinks=False).st_mtime < max_age:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)


def discard_entry(path: str | os.PathLike) -> None:
    """Remove a cache entry folder: renamed to a ``.tmp-*`` name first (so no reader sees it half deleted), then
    deleted. Missing entries are ignored."""
    path = Path(path)
    trash = path.with_name(f".tmp-{path.name}.discard-{os.getpid()}-{time.time_ns()}")
    try:
        os.rename(path, trash)
    except OSError:  # missing, or cannot be renamed: delete in place
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


def _no_space(err: OSError, directory: Path) -> DataConfigError:
    return DataConfigError(
        f"data.cache_dir: not enough free space in '{directory}' ({err.strerror or err}); free "
        f"some space or point paths.cache_dir (${CACHE_ENV}) to another disk"
    )


def file_md5(path: str | os.PathLike, chunk_size: int = 1 << 20) -> str:
    """Hex md5 of a file, read in ``chunk_size``-byte chunks."""
    digest = hashlib.md5()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def texts_sha256(texts: str | Iterable[str]) -> str:
    """Hex sha256 of one text or of a sequence of texts (length-prefixed, so boundaries count)."""
    digest = hashlib.sha256()
    if isinstance(texts, str):
        texts = [texts]
    for text in texts:
        data = text.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def cache_key(**params: Any) -> str:
    """A 24-hex-digit key from JSON-serialisable parameters (content hashes, sizes, versions...)."""
    blob = json.dumps(params, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", **kwargs: Any) -> Iterator[IO]:
    """Open a temporary file next to ``path``; on success move it onto ``path`` with :func:`os.replace`.

    On any exception the temporary file is removed and ``path`` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name}.")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600 files; a shared cache must be readable
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(err, OSError) and err.errno in _NO_SPACE:
            raise _no_space(err, path.parent) from err
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Build a directory entry atomically: yields an empty temporary directory next to ``path``, renamed to
    ``path`` on success and deleted on failure. If ``path`` appeared meanwhile (a concurrent run), it is kept and the
    temporary copy is discarded."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".tmp-{path.name}."))
    except OSError as err:
        if err.errno in _NO_SPACE:
            raise _no_space(err, path.parent) from err
        raise
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700 folders; a shared cache must be readable
        yield tmp
        try:
            os.rename(tmp, path)
        except OSError:
            if not path.is_dir():
                raise
    except OSError as err:
        if err.errno in _NO_SPACE:
            raise _no_space(err, path.parent) from err
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class NpyFile:
    """Picklable handle on a ``.npy`` file, opened lazily with ``np.load(mmap_mode='r')``.

    Pickles as its path, so DataLoader workers started with ``spawn`` re-open the file instead of receiving a copy.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self._array: np.ndarray | None = None

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = load_npy(self.path, mmap_mode="r")
        return self._array

    def __len__(self) -> int:
        return len(self.array)

    def __getstate__(self) -> dict:
        return {"path": self.path, "_array": None}

    def __repr__(self) -> str:
        return f"NpyFile({self.path!r})"


def load_npy(path: str | os.PathLike, mmap_mode: str | None = None) -> np.ndarray:
    """``np.load(path, mmap_mode=mmap_mode)``; a missing, truncated or malformed file raises
    :class:`CacheFileError` naming it."""
    try:
        return np.load(path, mmap_mode=mmap_mode)
    except (OSError, ValueError, EOFError) as err:
        raise CacheFileError(f"'{path}' cannot be read as a .npy file ({type(err).__name__}: {err})") from err


def save_npy(directory: Path, **arrays: np.ndarray) -> None:
    """Write each array as ``directory/<name>.npy`` (used inside :func:`atomic_dir`)."""
    for name, array in arrays.items():
        np.save(directory / f"{name}.npy", np.ascontiguousarray(array))
