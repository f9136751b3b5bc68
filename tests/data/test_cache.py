import errno
import hashlib
import os
import stat
import time

import numpy as np
import pytest

from lightning_effi.data import (CausalLMDataModule, CIFAR10DataModule, DataConfigError, NpyFile, SST2DataModule,
                                 atomic_dir, atomic_write, cache_key, default_cache_dir, file_md5, resolve_cache_dir,
                                 train_bpe_tokenizer)
from lightning_effi.data import text as text_module


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


def _sst2(root):
    root.mkdir()
    for name, n in (("train.tsv", 40), ("dev.tsv", 8)):
        rows = "".join(f"{i % 2}\tsentence number {i} is {'good' if i % 2 else 'bad'}\n" for i in range(n))
        (root / name).write_text("label\tsentence\n" + rows)
    return root


def _tree(root):
    from .test_cifar10 import _image_folder

    _image_folder(root, per_class=1)
    return root


MODULES = {  # name -> (make DataModule, file to damage in its entry)
    "text": (lambda tmp, cache: CausalLMDataModule(_text_file(tmp), tokenizer="bpe", vocab_size=300, block_size=4,
                                                   cache_dir=cache), "train.npy"),
    "sst2": (lambda tmp, cache: SST2DataModule(_sst2(tmp / "sst2"), vocab_size=64, cache_dir=cache),
             "train_ids.npy"),
    "cifar10": (lambda tmp, cache: CIFAR10DataModule(_tree(tmp / "tree"), val_size=2, num_workers=0,
                                                     cache_dir=cache), "test_images.npy"),
}


def _text_file(tmp):
    (tmp / "t.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    return tmp / "t.txt"


@pytest.mark.parametrize("damage", ["truncate", "empty", "tokenizer", "missing"])
@pytest.mark.parametrize("module", sorted(MODULES))
def test_damaged_entry_is_rebuilt(tmp_path, module, damage):
    make, name = MODULES[module]
    if damage == "tokenizer":
        if module == "cifar10":
            pytest.skip("no tokenizer")
        name = "tokenizer.json"
    cache = tmp_path / "cache"
    dm = make(tmp_path, cache)
    dm.setup()
    first = dm.test_dataset[0]
    (entry,) = (cache / module).iterdir()
    target = entry / name
    if damage == "missing":
        target.unlink()
    else:
        target.write_bytes(target.read_bytes()[:0 if damage != "truncate" else target.stat().st_size // 2])
    again = type(dm).__new__(type(dm))
    again.__dict__.update({k: v for k, v in dm.__dict__.items()})  # same arguments, nothing set up yet
    again.train_dataset = again.val_dataset = again.test_dataset = None
    with pytest.warns(RuntimeWarning, match=rf"cache entry '{entry}' is damaged"):
        again.setup()
    for key, value in again.test_dataset[0].items():
        assert value.shape == first[key].shape
    assert [p.name for p in (cache / module).iterdir()] == [entry.name]


def test_entry_unreadable_after_rebuild(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    dm = MODULES["text"][0](tmp_path, cache)
    monkeypatch.setattr(text_module, "load_tokenizer", lambda path: (_ for _ in ()).throw(ValueError("broken")))
    with pytest.warns(RuntimeWarning, match="is damaged"), \
            pytest.raises(DataConfigError, match=r"data.cache_dir: the cache entry '.*' cannot be read even after "
                                                 r"rebuilding it \(ValueError: broken\); delete the folder"):
        dm.setup()


def test_damaged_tokenizer_cache_file_is_retrained(tmp_path):
    tok = train_bpe_tokenizer("abc abd " * 50, 260, tmp_path)
    (path,) = (tmp_path / "tokenizers").iterdir()
    path.write_text("")
    with pytest.warns(RuntimeWarning, match=f"cached tokenizer '{path}' is damaged"):
        again = train_bpe_tokenizer("abc abd " * 50, 260, tmp_path)
    assert again.get_vocab() == tok.get_vocab() and path.stat().st_size > 0
