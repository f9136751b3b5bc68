import errno
import hashlib
import os
import stat
import time
import warnings

import numpy as np
import pytest

from lightning_effi.data import (
    CausalLMDataModule,
    CIFAR10DataModule,
    DataConfigError,
    NpyFile,
    SST2DataModule,
    atomic_dir,
    atomic_write,
    cache_key,
    default_cache_dir,
    file_md5,
    resolve_cache_dir,
    train_bpe_tokenizer,
)
from lightning_effi.reference.data import text as text_module


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


def test_entries_readable_by_others(tmp_path):
    with atomic_dir(tmp_path / "entry") as tmp:
        np.save(tmp / "a.npy", np.arange(3))
    with atomic_write(tmp_path / "f.json", "w") as f:
        f.write("{}")
    assert stat.S_IMODE((tmp_path / "entry").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "f.json").stat().st_mode) == 0o644


def test_cache_dir_that_is_a_file(tmp_path):
    (tmp_path / "hostname").write_text("x")
    with pytest.raises(DataConfigError, match=r"data.cache_dir: '.*hostname' cannot be used as the cache directory"):
        resolve_cache_dir(tmp_path / "hostname", "text")
    (tmp_path / "t.txt").write_text("abc " * 100)
    with pytest.raises(DataConfigError, match="data.cache_dir"):
        CausalLMDataModule(tmp_path / "t.txt", tokenizer="char", block_size=4, cache_dir=tmp_path / "hostname").setup()


def test_stale_tmp_leftovers_removed(tmp_path):
    (tmp_path / "text" / ".tmp-old.abc").mkdir(parents=True)
    (tmp_path / "text" / ".tmp-old.abc" / "train.npy").write_bytes(b"partial")
    (tmp_path / "text" / ".tmp-x.json.123").write_text("partial")
    (tmp_path / "text" / ".tmp-new.def").mkdir()
    (tmp_path / "text" / "entry").mkdir()
    old = time.time() - 2 * 3600
    for name in (".tmp-old.abc", ".tmp-x.json.123", "entry"):
        os.utime(tmp_path / "text" / name, (old, old))
    resolve_cache_dir(tmp_path, "text")
    assert sorted(p.name for p in (tmp_path / "text").iterdir()) == [".tmp-new.def", "entry"]


def _raise_no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_is_a_config_error_and_leaves_nothing(tmp_path, monkeypatch):
    with pytest.raises(DataConfigError, match=rf"data.cache_dir: not enough free space in '{tmp_path}'"):
        with atomic_dir(tmp_path / "entry") as tmp:
            (tmp / "a.npy").write_bytes(b"partial")
            _raise_no_space()
    with pytest.raises(DataConfigError, match="not enough free space"), atomic_write(tmp_path / "x.json") as f:
        f.write(b"partial")
        _raise_no_space()
    assert list(tmp_path.iterdir()) == []

    def save_partially(directory, **arrays):
        (directory / "train.npy").write_bytes(b"partial")
        _raise_no_space()

    monkeypatch.setattr(text_module, "save_npy", save_partially)
    (tmp_path / "t.txt").write_text("abc " * 100)
    cache = tmp_path / "cache"
    with pytest.raises(DataConfigError, match=rf"not enough free space in '{cache / 'text'}'"):
        CausalLMDataModule(tmp_path / "t.txt", tokenizer="char", block_size=4, cache_dir=cache).prepare_data()
    assert list((cache / "text").iterdir()) == []


def _text_source(tmp, cache):
    (tmp / "t.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    return lambda: CausalLMDataModule(tmp / "t.txt", tokenizer="bpe", vocab_size=300, block_size=4, cache_dir=cache)


def _sst2_source(tmp, cache):
    (tmp / "sst2").mkdir()
    for name, n in (("train.tsv", 40), ("dev.tsv", 8)):
        rows = "".join(f"{i % 2}\tsentence number {i} is {'good' if i % 2 else 'bad'}\n" for i in range(n))
        (tmp / "sst2" / name).write_text("label\tsentence\n" + rows)
    return lambda: SST2DataModule(tmp / "sst2", vocab_size=64, cache_dir=cache)


def _cifar10_source(tmp, cache):
    from .test_cifar10 import _image_folder

    _image_folder(tmp / "tree", per_class=1)
    return lambda: CIFAR10DataModule(tmp / "tree", val_size=2, num_workers=0, cache_dir=cache)


SOURCES = {
    "text": (_text_source, "train.npy"),
    "sst2": (_sst2_source, "train_ids.npy"),
    "cifar10": (_cifar10_source, "test_images.npy"),
}  # cache subfolder -> (source, a file of its entry)


@pytest.mark.parametrize(
    "module,damage",
    [(m, d) for m in sorted(SOURCES) for d in ("truncate", "empty", "missing")]
    + [("sst2", "tokenizer"), ("text", "tokenizer")],
)
def test_damaged_entry_is_rebuilt(tmp_path, module, damage):
    """A damaged file in an existing entry folder: warn naming the entry, rebuild it once, then work."""
    source, name = SOURCES[module]
    if damage == "tokenizer":
        name = "tokenizer.json"
    cache = tmp_path / "cache"
    make = source(tmp_path, cache)
    dm = make()
    dm.setup()
    first = dm.test_dataset[0]
    (entry,) = (cache / module).iterdir()
    target = entry / name
    if damage == "missing":
        target.unlink()
    else:
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2 if damage == "truncate" else 0])
    again = make()
    with pytest.warns(RuntimeWarning, match=rf"cache entry '{entry}' is damaged"):
        again.setup()
    for key, value in again.test_dataset[0].items():
        assert value.shape == first[key].shape
    assert [p.name for p in (cache / module).iterdir()] == [entry.name]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        make().setup()  # the rebuilt entry is read back without a warning


def test_entry_unreadable_after_rebuild(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    dm = _text_source(tmp_path, cache)()
    monkeypatch.setattr(text_module, "load_tokenizer", lambda path: (_ for _ in ()).throw(ValueError("broken")))
    with (
        pytest.warns(RuntimeWarning, match="is damaged"),
        pytest.raises(
            DataConfigError,
            match=r"data.cache_dir: the cache entry '.*' cannot be read even after "
            r"rebuilding it \(ValueError: broken\); delete the folder",
        ),
    ):
        dm.setup()


def test_damaged_tokenizer_cache_file_is_retrained(tmp_path):
    tok = train_bpe_tokenizer("abc abd " * 50, 260, tmp_path)
    (path,) = (tmp_path / "tokenizers").iterdir()
    path.write_text("")
    with pytest.warns(RuntimeWarning, match=f"cached tokenizer '{path}' is damaged"):
        again = train_bpe_tokenizer("abc abd " * 50, 260, tmp_path)
    assert again.get_vocab() == tok.get_vocab() and path.stat().st_size > 0
