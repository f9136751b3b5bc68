import hashlib

import numpy as np
import pytest

from lightning_effi.data import NpyFile, atomic_dir, atomic_write, cache_key, default_cache_dir, file_md5


def test_default_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("EFFI_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("EFFI_CACHE_DIR")
    assert default_cache_dir().parts[-2:] == (".cache", "lightning_effi")


def test_file_md5_chunked(tmp_path):
    data = np.random.default_rng(0).bytes(3_000_001)
    (tmp_path / "f").write_bytes(data)
    assert file_md5(tmp_path / "f", chunk_size=4096) == hashlib.md5(data).hexdigest()


def test_cache_key_depends_on_every_param():
    base = cache_key(md5="a", n=1)
    assert base == cache_key(n=1, md5="a")
    assert base != cache_key(md5="b", n=1) and base != cache_key(md5="a", n=2)


def test_atomic_write_failure_leaves_nothing(tmp_path):
    target = tmp_path / "x.bin"
    with atomic_write(target) as f:
        f.write(b"ok")
    assert target.read_bytes() == b"ok"
    with pytest.raises(RuntimeError), atomic_write(target) as f:
        f.write(b"partial")
        raise RuntimeError("interrupted")
    assert target.read_bytes() == b"ok"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin"]


def test_atomic_dir_failure_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "entry") as tmp:
        (tmp / "a.npy").write_bytes(b"partial")
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with atomic_dir(tmp_path / "entry") as tmp:
        np.save(tmp / "a.npy", np.arange(3))
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]
    handle = NpyFile(tmp_path / "entry" / "a.npy")
    assert handle.array.tolist() == [0, 1, 2] and isinstance(handle.array, np.memmap)
