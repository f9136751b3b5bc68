"""Cache directory, checksums and atomic writes.

Every cache entry lives under :func:`default_cache_dir` (or an explicit ``cache_dir``) and is keyed by a hash of the
source content (or its checksum) plus every parameter that changes the result, see :func:`cache_key`. Entries are
written atomically: files through a temporary file in the same directory followed by :func:`os.replace`, multi-file
entries as a temporary directory renamed into place. An interrupted run therefore leaves either a complete entry or
nothing (at most a ``.tmp-*`` leftover that is never read), and the next run simply rebuilds it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

__all__ = [
    "NpyFile",
    "atomic_dir",
    "atomic_write",
    "cache_key",
    "default_cache_dir",
    "file_md5",
    "resolve_cache_dir",
    "texts_sha256",
]

CACHE_ENV = "EFFI_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$EFFI_CACHE_DIR`` if set, else ``~/.cache/lightning_effi`` (not created here)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lightning_effi"


def resolve_cache_dir(cache_dir: str | os.PathLike | None = None, *subdirs: str) -> Path:
    """``cache_dir`` (or :func:`default_cache_dir`) joined with ``subdirs``, created if missing."""
    path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = path.joinpath(*subdirs)
    path.mkdir(parents=True, exist_ok=True)
    return path


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
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Build a directory entry atomically: yields an empty temporary directory next to ``path``, renamed to
    ``path`` on success and deleted on failure. If ``path`` appeared meanwhile (a concurrent run), it is kept and the
    temporary copy is discarded."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".tmp-{path.name}."))
    try:
        yield tmp
        try:
            os.rename(tmp, path)
        except OSError:
            if not path.is_dir():
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
            self._array = np.load(self.path, mmap_mode="r")
        return self._array

    def __len__(self) -> int:
        return len(self.array)

    def __getstate__(self) -> dict:
        return {"path": self.path, "_array": None}

    def __repr__(self) -> str:
        return f"NpyFile({self.path!r})"


def save_npy(directory: Path, **arrays: np.ndarray) -> None:
    """Write each array as ``directory/<name>.npy`` (used inside :func:`atomic_dir`)."""
    for name, array in arrays.items():
        np.save(directory / f"{name}.npy", np.ascontiguousarray(array))
