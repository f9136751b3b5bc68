import io
import multiprocessing
import os
import pickle
import signal
import sys
import tarfile
import time

import numpy as np
import pytest
import torch
from PIL import Image

from lightning_effi.data import (
    CIFAR10_CLASSES,
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR10DataModule,
    DataConfigError,
    IndexedDataset,
    indexed_collate,
    sequence_lengths,
)
from lightning_effi.reference.data import cifar10


def _raw(dataset, i):
    """uint8[3,32,32] image behind sample i of a CIFAR10Dataset."""
    return torch.from_numpy(np.array(dataset.images.array[dataset.indices[i]])).permute(2, 0, 1)


def test_decoded_arrays(cifar_dm):
    train, test = cifar_dm.train_dataset, cifar_dm.test_dataset
    images = train.images.array
    assert images.shape == (50_000, 32, 32, 3) and images.dtype == np.uint8
    assert test.images.array.shape == (10_000, 32, 32, 3)
    assert np.bincount(train.labels, minlength=10).tolist() == [5000] * 10
    assert np.bincount(test.labels, minlength=10).tolist() == [1000] * 10
    means = images.reshape(-1, 3).mean(axis=0) / 255
    np.testing.assert_allclose(means, (0.491, 0.482, 0.447), atol=0.01)
    assert cifar_dm.classes == list(CIFAR10_CLASSES) and cifar_dm.model_hints() == {"num_classes": 10}


def test_split_is_deterministic_and_disjoint(cifar_dm, data_root):
    train, val = cifar_dm.train_dataset, cifar_dm.val_dataset
    assert (len(train), len(val), len(cifar_dm.test_dataset)) == (45_000, 5_000, 10_000)
    assert np.union1d(train.indices, val.indices).tolist() == list(range(50_000))
    again = CIFAR10DataModule(data_root / "cifar10", num_workers=0)
    again.setup()
    assert np.array_equal(again.val_dataset.indices, val.indices)
    other = CIFAR10DataModule(data_root / "cifar10", seed=1, val_size=1000, num_workers=0)
    other.setup()
    assert len(other.val_dataset) == 1000 and not np.array_equal(other.val_dataset.indices, val.indices[:1000])


def test_samples_augmentation_and_normalisation(cifar_dm):
    mean, std = torch.tensor(CIFAR10_MEAN).view(3, 1, 1), torch.tensor(CIFAR10_STD).view(3, 1, 1)
    val = cifar_dm.val_dataset
    sample = val[3]
    assert sample["pixel_values"].shape == (3, 32, 32) and sample["pixel_values"].dtype == torch.float32
    assert sample["labels"].dtype == torch.int64 and sample["labels"].shape == ()
    torch.testing.assert_close(sample["pixel_values"] * std + mean, _raw(val, 3).float() / 255)
    assert torch.equal(val[3]["pixel_values"], sample["pixel_values"])  # no augmentation

    train = cifar_dm.train_dataset
    torch.manual_seed(0)
    views = [train[7]["pixel_values"] for _ in range(6)]
    assert all(v.shape == (3, 32, 32) for v in views)
    assert any(not torch.equal(views[0], v) for v in views[1:])
    assert all(train[7]["labels"] == int(train.labels[train.indices[7]]) for _ in range(2))


def test_dataloader_and_subsets(data_root):
    dm = CIFAR10DataModule(
        data_root / "cifar10", batch_size=16, num_workers=0, train_subset=40, val_subset=20, test_subset=10
    )
    dm.setup()
    assert (len(dm.train_dataset), len(dm.val_dataset), len(dm.test_dataset)) == (40, 20, 10)
    assert sequence_lengths(dm.train_dataset) is None
    batches = list(dm.train_dataloader())
    assert [b["pixel_values"].shape[0] for b in batches] == [16, 16, 8]
    assert batches[0]["labels"].dtype == torch.int64
    loader = torch.utils.data.DataLoader(
        IndexedDataset(dm.val_dataset), batch_size=20, collate_fn=indexed_collate(dm.collate_fn)
    )
    collated = next(iter(loader))
    batch = {**collated.batch, **collated.meta}
    assert batch["index"].tolist() == list(range(20)) and batch["pixel_values"].shape == (20, 3, 32, 32)
    pickle.loads(pickle.dumps(dm.train_dataset))[0]


def test_corrupt_archive_raises_and_caches_nothing(data_root, tmp_path):
    data = (data_root / "cifar10" / "cifar10-jpeg.tar.gz").read_bytes()
    bad = tmp_path / "cifar10-jpeg.tar.gz"
    bad.write_bytes(data[: len(data) // 8])
    cache = tmp_path / "cache"
    dm = CIFAR10DataModule(bad, cache_dir=cache, num_workers=0)
    with pytest.raises(DataConfigError, match="cifar10-jpeg.tar.gz.*not a readable"):
        dm.prepare_data()
    assert not any(p.is_file() for p in cache.rglob("*"))
    assert list((cache / "cifar10").iterdir()) == []


def test_missing_root_and_bad_args(tmp_path):
    with pytest.raises(DataConfigError, match=r"data.root: .*does not exist.*download=true"):
        CIFAR10DataModule(tmp_path / "nope")
    with pytest.raises(DataConfigError, match="data.root: .*contains neither"):
        CIFAR10DataModule(tmp_path, cache_dir=tmp_path / "c").prepare_data()
    with pytest.raises(DataConfigError, match="data.batch_size"):
        CIFAR10DataModule(tmp_path, batch_size=0)
    with pytest.raises(DataConfigError, match="data.train_subset"):
        CIFAR10DataModule(tmp_path, train_subset=-1)


def _jpeg(size=32, seed=0):
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG")
    return buf.getvalue()


def _image_folder(root, classes=CIFAR10_CLASSES, per_class=3, odd=None):
    for split in ("train", "test"):
        for c in classes:
            (root / split / c).mkdir(parents=True)
            for k in range(per_class):
                (root / split / c / f"{k:04d}.jpg").write_bytes(_jpeg(seed=k))
    if odd:
        (root / odd).write_bytes(_jpeg(size=64))


def test_image_folder_source(tmp_path):
    _image_folder(tmp_path / "tree")
    dm = CIFAR10DataModule(tmp_path / "tree", val_size=10, cache_dir=tmp_path / "c", num_workers=0)
    dm.setup()
    assert (len(dm.train_dataset), len(dm.val_dataset), len(dm.test_dataset)) == (20, 10, 30)
    assert np.bincount(dm.test_dataset.labels).tolist() == [3] * 10
    with pytest.raises(DataConfigError, match="data.val_size"):
        CIFAR10DataModule(tmp_path / "tree", val_size=30, cache_dir=tmp_path / "c").setup()


def test_image_folder_errors(tmp_path):
    _image_folder(tmp_path / "a", classes=("cat", "dog"), per_class=1)
    with pytest.raises(DataConfigError, match=r"has classes \['cat', 'dog'\].*ten CIFAR-10 classes"):
        CIFAR10DataModule(tmp_path / "a", cache_dir=tmp_path / "c").prepare_data()
    _image_folder(tmp_path / "b", per_class=1, odd="train/cat/9999.jpg")
    with pytest.raises(DataConfigError, match="train/cat/9999.jpg is 64x64 pixels; expected a 32x32"):
        CIFAR10DataModule(tmp_path / "b", cache_dir=tmp_path / "c").prepare_data()
    assert not any(p.is_file() for p in (tmp_path / "c").rglob("*"))


def _archive(path, per_class=(1, 1), skip=()):
    """A tiny CIFAR-10-layout tar.gz with per_class = (train, test) images per class, minus the members in skip."""
    with tarfile.open(path, "w:gz") as tar:
        for split, n in zip(("train", "test"), per_class):
            for c in CIFAR10_CLASSES:
                for k in range(n):
                    name = f"{split}/{c}/{k:04d}.jpg"
                    if name in skip:
                        continue
                    data = _jpeg(seed=len(c) + 10 * k)
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def per_class(monkeypatch):
    """Make the exact-count check of archives expect (train, test) images per class instead of (5000, 1000)."""

    def set_counts(train, test):
        monkeypatch.setattr(cifar10, "_PER_CLASS", {"train": train, "test": test})

    return set_counts


def _no_cached_file(cache):
    return not any(p.is_file() for p in cache.rglob("*"))


def test_archive_given_as_file(tmp_path, per_class):
    per_class(1, 1)
    archive = _archive(tmp_path / "mini.tar.gz")
    dm = CIFAR10DataModule(archive, val_size=2, cache_dir=tmp_path / "c", num_workers=0)
    dm.setup()
    assert len(dm.train_dataset) == 8 and len(dm.test_dataset) == 10
    assert dm.test_dataset.labels.tolist() == list(range(10))


def test_archive_needs_exact_counts(tmp_path, per_class):
    """A well-formed archive missing images (a truncated copy) is rejected, not cached as a smaller dataset."""
    per_class(2, 2)
    archive = _archive(tmp_path / "cifar10-jpeg.tar.gz", per_class=(2, 2), skip={"test/truck/0001.jpg"})
    cache = tmp_path / "c"
    with pytest.raises(
        DataConfigError,
        match=r"cifar10-jpeg.tar.gz' holds 19 test images \(truck: 1\); expected 20 "
        r"\(2 per class\): the archive is incomplete or corrupt",
    ):
        CIFAR10DataModule(archive, val_size=2, cache_dir=cache, num_workers=0).prepare_data()
    assert _no_cached_file(cache)
    per_class(5000, 1000)  # the real CIFAR-10 counts, with thousands separators
    with pytest.raises(
        DataConfigError,
        match=r"holds 20 train images \(airplane: 2, .*truck: 2\); expected 50,000 "
        r"\(5,000 per class\)",
    ):
        CIFAR10DataModule(archive, val_size=2, cache_dir=cache, num_workers=0).prepare_data()
    assert _no_cached_file(cache)


def test_archive_gzip_crc_checked(tmp_path, per_class):
    """tarfile stops at the end-of-archive blocks without reaching the gzip trailer: a bad CRC (or 16 flipped bytes
    mid-file, which tarfile reads past silently) must still be detected."""
    per_class(2, 1)
    data = _archive(tmp_path / "good.tar.gz", per_class=(2, 1)).read_bytes()
    bad_crc = bytearray(data)
    bad_crc[-8] ^= 0xFF  # gzip trailer: CRC32, then ISIZE
    flipped = bytearray(data)
    flipped[len(data) // 2 : len(data) // 2 + 16] = bytes(b ^ 0xFF for b in data[len(data) // 2 : len(data) // 2 + 16])
    for name, content in (("crc", bad_crc), ("flipped", flipped)):
        path = tmp_path / name / "cifar10-jpeg.tar.gz"
        path.parent.mkdir()
        path.write_bytes(bytes(content))
        cache = tmp_path / f"cache-{name}"
        with pytest.raises(DataConfigError, match=rf"{name}/cifar10-jpeg.tar.gz' .*incomplete or corrupt"):
            CIFAR10DataModule(path.parent, val_size=2, cache_dir=cache, num_workers=0).prepare_data()
        assert _no_cached_file(cache)
    dm = CIFAR10DataModule(tmp_path / "good.tar.gz", val_size=2, cache_dir=tmp_path / "c", num_workers=0)
    dm.setup()
    assert len(dm.test_dataset) == 10


def test_archive_missing_split_may_be_truncated(tmp_path, per_class):
    per_class(1, 1)
    archive = _archive(tmp_path / "a.tar.gz", per_class=(1, 0))
    with pytest.raises(DataConfigError, match=r"and \[\] under test/.*the archive may be truncated or corrupt"):
        CIFAR10DataModule(archive, cache_dir=tmp_path / "c", num_workers=0).prepare_data()
    _image_folder(tmp_path / "tree", per_class=1)  # a user's tree: no word about archives
    for f in (tmp_path / "tree" / "test" / "cat").iterdir():
        f.unlink()  # an empty class folder counts as a missing class
    with pytest.raises(
        DataConfigError,
        match=r"'cat', 'deer'.* under test/; expected .*at least one image each"
        r"(?!.*archive)",
    ):
        CIFAR10DataModule(tmp_path / "tree", cache_dir=tmp_path / "c", num_workers=0).prepare_data()
    assert _no_cached_file(tmp_path / "c")


def test_image_folder_accepts_other_counts(tmp_path, per_class):
    _image_folder(tmp_path / "tree", per_class=2)
    (tmp_path / "tree" / "test" / "dog" / "0001.jpg").unlink()
    dm = CIFAR10DataModule(tmp_path / "tree", val_size=2, cache_dir=tmp_path / "c", num_workers=0)
    dm.setup()
    assert len(dm.test_dataset) == 19


def test_download_needs_exact_counts(tmp_path, monkeypatch, per_class):
    import torchvision

    class FakeCIFAR10:
        def __init__(self, root, train, download):
            n = 2 if train else 1
            self.data = np.zeros((10 * n - (0 if train else 1), 32, 32, 3), np.uint8)
            self.targets = np.repeat(np.arange(10), n)[: len(self.data)].tolist()

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", FakeCIFAR10)
    per_class(2, 1)
    with pytest.raises(
        DataConfigError,
        match=r"holds 9 test images \(truck: 0\); expected 10 \(1 per class\): "
        "the torchvision download is incomplete or corrupt",
    ):
        CIFAR10DataModule(tmp_path / "tv", download=True, val_size=2, cache_dir=tmp_path / "c").prepare_data()
    assert _no_cached_file(tmp_path / "c")


@pytest.mark.parametrize("param", ["download", "augment", "pin_memory"])
def test_boolean_args_must_be_booleans(tmp_path, param):
    for value in ("no", "false", 0, 1, None):
        with pytest.raises(DataConfigError, match=rf"data.{param}: .* is invalid; expected true or false"):
            CIFAR10DataModule(tmp_path, **{param: value})
    dm = CIFAR10DataModule(tmp_path, **{param: np.bool_(False)})
    assert getattr(dm, param) is False


_STARTS: dict[int, int | None] = {}


def _alive(pid):
    """Whether ``pid`` runs and is still the process first seen under it (under the parallel suite's load a dead
    worker's pid was taken by another process, which read as the worker alive)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    first = _STARTS.setdefault(pid, int(fields[19]))
    return fields[0] != "Z" and int(fields[19]) == first  # a zombie is dead


def _keep_pool_busy(conn):
    """Start the decode pool, keep both workers busy, send their pids, wait to be killed."""
    pool = cifar10._pool()
    if pool is None:
        conn.send(None)
        return
    for _ in range(2):
        pool.submit(time.sleep, 60)
    time.sleep(0.2)
    conn.send(list(pool._processes))
    time.sleep(60)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_decode_workers_die_with_parent(sig):
    """Killing the process that decodes CIFAR-10 must not leave its decode workers running."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    workers = None
    parent = ctx.Process(target=_keep_pool_busy, args=(send,))
    parent.start()
    try:
        assert recv.poll(30)
        workers = recv.recv()
        if workers is None:
            pytest.skip("no decode pool on this machine (fewer than 2 CPUs or no fork)")
        assert len(workers) == 2 and all(_alive(p) for p in workers)
        os.kill(parent.pid, sig)
        parent.join(30)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in workers)
    finally:
        parent.kill()
        parent.join()
        for pid in workers if isinstance(workers, list) else ():  # failed: do not leak the orphans
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_decode_worker_exits_if_parent_already_gone():
    child = multiprocessing.get_context("fork").Process(target=cifar10._init_worker, args=(os.getpid() + 10**6,))
    child.start()
    child.join(10)
    assert child.exitcode == 1
    same = multiprocessing.get_context("fork").Process(target=cifar10._init_worker, args=(os.getpid(),))
    same.start()
    same.join(10)
    assert same.exitcode == 0


def test_augmentation_is_a_function_of_seed_epoch_and_image(data_root):
    """Once the loader has told the dataset the epoch, image j's crop and flip in epoch e are those of
    ``augmentation_generator(seed, e, j)``: the same at every read, other in another epoch or with another seed; the
    loader tells persistent workers too (an EpochCell in shared memory)."""
    from lightning_effi.core.loader import EpochShuffleSampler, ResumableDataLoader

    dm = CIFAR10DataModule(data_root / "cifar10", num_workers=0, train_subset=16, seed=3)
    dm.setup()
    subset = dm.train_dataset
    base = subset.dataset
    assert base.epoch.get() == -1  # no loader yet: the default RNG, as torchvision's transforms
    from lightning_effi.core.loader import set_dataset_epoch

    set_dataset_epoch(subset, 2)  # through the Subset
    assert base.epoch.get() == 2
    other = CIFAR10DataModule(data_root / "cifar10", num_workers=0, train_subset=8, seed=4)
    other.setup()
    set_dataset_epoch(torch.utils.data.ConcatDataset([other.train_dataset, subset]), 2)  # through a ConcatDataset
    assert other.train_dataset.dataset.epoch.get() == 2
    j = int(base.indices[subset.indices[5]])
    expected = cifar10.random_crop_flip(
        _raw(base, subset.indices[5]), generator=cifar10.augmentation_generator(3, 2, j)
    )
    mean, std = torch.tensor(CIFAR10_MEAN).view(3, 1, 1), torch.tensor(CIFAR10_STD).view(3, 1, 1)
    torch.testing.assert_close(subset[5]["pixel_values"], (expected.float() / 255 - mean) / std)
    assert torch.equal(subset[5]["pixel_values"], subset[5]["pixel_values"])
    views = []
    for epoch in range(6):
        set_dataset_epoch(subset, epoch)
        views.append(subset[5]["pixel_values"])
    assert len({v.numpy().tobytes() for v in views}) > 1  # epochs draw other crops
    from lightning_effi.core.loader import sample_draw

    draws = {}  # the curriculum may draw an image twice in an epoch: each draw (step, micro) gets its own crop
    for draw in [(3, 0), (3, 0), (4, 1), (9, 0), (11, 2)]:
        with sample_draw(*draw):
            draws.setdefault(draw, []).append(subset[5]["pixel_values"])
    assert torch.equal(*draws[(3, 0)])
    expected = cifar10.random_crop_flip(
        _raw(base, subset.indices[5]), generator=cifar10.augmentation_generator(3, 5, j, (4, 1))
    )
    torch.testing.assert_close(draws[(4, 1)][0], (expected.float() / 255 - mean) / std)
    assert len({v[0].numpy().tobytes() for v in draws.values()}) > 1

    # persistent workers read the epoch set in the main process after they started
    loader = ResumableDataLoader(
        subset, batch_size=4, sampler=EpochShuffleSampler(subset, 1, 0, seed=0), num_workers=2, persistent_workers=True
    )
    inline = ResumableDataLoader(subset, batch_size=4, sampler=EpochShuffleSampler(subset, 1, 0, seed=0))
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        inline.sampler.set_epoch(epoch)
        got = torch.cat([b["pixel_values"] for b in loader])
        want = torch.cat([b["pixel_values"] for b in inline])
        assert torch.equal(got, want), epoch
    assert base.epoch.get() == 2


def _cifar_resume_run(root, tmp, ckpt=None, infobatch=False):
    """A linear classifier on 48 augmented CIFAR-10 images (batch 8, 2 persistent workers) for 3 epochs; saves a
    checkpoint at every step. Returns the final weights."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_effi.callbacks import InfoBatchCallback
    from lightning_effi.data import InfoBatchDataModule
    from tests.helpers.tiny import HandImageLinear

    dm = CIFAR10DataModule(root / "cifar10", batch_size=8, num_workers=2, train_subset=48, val_subset=8, seed=1)
    callbacks = [ModelCheckpoint(dirpath=tmp, every_n_train_steps=1, save_top_k=-1, filename="{step}")]
    if infobatch:
        dm = InfoBatchDataModule(dm)
        callbacks.append(InfoBatchCallback(prune_ratio=0.5, delta=0.875, seed=0))
    model = HandImageLinear()
    trainer = pl.Trainer(
        max_epochs=3,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("infobatch", [False, True], ids=["plain", "infobatch"])
def test_an_augmented_fit_resumed_mid_epoch_equals_the_uninterrupted_one(data_root, tmp_path, infobatch):
    """augment=true (the default) with worker processes: the fit resumed from a mid-epoch checkpoint ends with the
    uninterrupted fit's weights, bit for bit (before, each crop and flip came from a worker's random state, which no
    checkpoint holds: max |dweight| 0.074 after such a resume)."""
    full = _cifar_resume_run(data_root, tmp_path / "a", infobatch=infobatch)
    ckpt = tmp_path / "a" / "step=8.ckpt"  # epoch 1, batch 2 of 6 (of 3 to 6 under InfoBatch)
    assert ckpt.is_file()
    resumed = _cifar_resume_run(data_root, tmp_path / "b", ckpt=ckpt, infobatch=infobatch)
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
