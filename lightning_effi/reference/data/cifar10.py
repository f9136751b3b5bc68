"""CIFAR-10 (Krizhevsky, 2009) as uint8 arrays decoded once and memory-mapped from the cache.

Sources, tried in order (``root`` is ``data.root``):

1. ``root/cifar10-jpeg.tar.gz`` (or ``root`` naming that ``.tar.gz`` file): the ImageFolder layout
   ``train/<class>/NNNN.jpg`` (50,000 images) and ``test/<class>/NNNN.jpg`` (10,000) inside a gzipped tar;
2. an ImageFolder tree on disk: ``root/train/<class>/*.jpg`` and ``root/test/<class>/*.jpg`` (``.png`` also read);
3. ``download=True``: ``torchvision.datasets.CIFAR10(root, download=True)`` (the standard pickled release).

The archive and torchvision sources must hold exactly the CIFAR-10 images (5,000 per class under ``train``, 1,000
under ``test``) and the archive's compressed stream is read to its end (so its CRC is checked): a damaged or
truncated file is an error, never a smaller cached dataset. An ImageFolder tree may hold any number of images, but
every class needs at least one in each split.

``prepare_data()`` decodes the source once (PIL, two worker processes when available; they die with the parent) into
``train_images.npy uint8[N,32,32,3]``, ``train_labels.npy int64[N]`` and the same for ``test``, written atomically
under ``<cache_dir>/cifar10/<key>/``; the key hashes the archive md5 (source 1), the sorted file list with sizes and
mtimes (source 2) or the fixed torchvision release (source 3). Images are ordered by (class, file name); labels index
the sorted class names, i.e. the standard CIFAR-10 order :data:`CIFAR10_CLASSES`.
"""

from __future__ import annotations

import ctypes
import io
import multiprocessing
import os
import re
import signal
import sys
import tarfile
import warnings
import zlib
from collections.abc import Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from lightning_effi.core.errors import DataConfigError
from lightning_effi.core.loader import EpochCell, current_draw

from .base import EffiDataModule, check_bool, check_int, seeded_subset
from .cache import NpyFile, atomic_dir, cache_key, file_md5, load_npy, resolve_cache_dir, save_npy

__all__ = [
    "CIFAR10_CLASSES",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR10DataModule",
    "CIFAR10Dataset",
    "augmentation_generator",
    "random_crop_flip",
]

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
ARCHIVE_NAME = "cifar10-jpeg.tar.gz"
_CACHE_VERSION = 2  # 2: archive/torchvision sources checked for the exact CIFAR-10 counts
_SPLITS = ("train", "test")
_IMAGE_RE = re.compile(r"^(?:\./)?(train|test)/([^/]+)/([^/.][^/]*\.(?:jpe?g|png))$", re.IGNORECASE)
_EXPECTED = (
    f"expected a directory containing {ARCHIVE_NAME} or an ImageFolder tree train/<class>/*.jpg "
    "(+ test/<class>/*.jpg), or set download=true"
)
_CHUNK = 2048  # images per decode task
_PER_CLASS = {"train": 5000, "test": 1000}  # exact CIFAR-10 counts required of the archive and torchvision sources
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def random_crop_flip(image: torch.Tensor, padding: int = 4, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random crop of the original size from ``image`` zero-padded by ``padding`` pixels, then a horizontal flip
    with probability 1/2 (the CIFAR-10 augmentation of He et al., 2016, Sec. 4.2). ``image``: ``[C,H,W]`` (any
    dtype). Draws from ``generator``, or from the torch default RNG when None."""
    _, h, w = image.shape
    dy, dx = torch.randint(0, 2 * padding + 1, (2,), generator=generator).tolist()
    out = F.pad(image, (padding, padding, padding, padding))[:, dy : dy + h, dx : dx + w]
    return out.flip(-1) if torch.randint(0, 2, (), generator=generator).item() else out


def augmentation_generator(seed: int, epoch: int, index: int, draw: tuple[int, ...] = ()) -> torch.Generator:
    """The generator of one sample's augmentation in one epoch: a pure function of ``(seed, epoch, index, *draw)``
    (NumPy's ``SeedSequence`` mixes them; ``draw``: :func:`~lightning_effi.core.loader.current_draw`, the
    curriculum's ``(step, micro-batch)`` of a sample it may draw twice in an epoch), so a resumed fit draws the crops
    and flips of the uninterrupted one."""
    state = np.random.SeedSequence([seed, epoch, index, *draw]).generate_state(2, np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> np.uint64(1)))


class CIFAR10Dataset(Dataset):
    """The images ``indices`` of a decoded split.

    Sample: ``{"pixel_values": float32[3,32,32], "labels": int64[]}``; pixels scaled to [0, 1] then normalised with
    :data:`CIFAR10_MEAN` / :data:`CIFAR10_STD`; with ``augment`` a random crop (padding 4) and horizontal flip
    are applied first (:func:`random_crop_flip`). Images are read from a memory-mapped ``.npy`` file.

    The augmentation of image ``j`` in epoch ``e`` is drawn from :func:`augmentation_generator` ``(seed, e, j)`` (and
    the curriculum's draw of it, when it may draw an image twice in an epoch) once
    the loader has told the dataset the epoch (:meth:`set_epoch`; the shipped DataModules' loaders, InfoBatch's and the
    curriculum's do, before each epoch: :func:`~lightning_effi.core.loader.set_dataset_epoch`), so a resumed fit trains
    the uninterrupted run's augmentations. Read outside such a loader (``set_epoch`` never called), it draws from the
    torch default RNG, as torchvision's transforms do. The epoch set last stays set after a fit: to read the dataset
    again with a loader that does not set it (a plain ``DataLoader``, which would get the same crop of an image every
    epoch), call ``set_epoch(-1)`` first, which returns to the default RNG.
    """

    _mean = torch.tensor(CIFAR10_MEAN).view(3, 1, 1)
    _std = torch.tensor(CIFAR10_STD).view(3, 1, 1)

    def __init__(self, images: NpyFile, labels: np.ndarray, indices: np.ndarray, augment: bool = False, seed: int = 0):
        self.images = images
        self.labels = np.asarray(labels, dtype=np.int64)
        self.indices = np.asarray(indices, dtype=np.int64)
        self.augment = augment
        self.seed = int(seed)
        self.epoch = EpochCell()

    def set_epoch(self, epoch: int) -> None:
        """Draw the augmentations of epoch ``epoch`` from now on (also in the loader's running workers); ``-1``: from
        the torch default RNG again."""
        self.epoch.set(epoch)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        j = int(self.indices[i])
        image = torch.from_numpy(np.array(self.images.array[j])).permute(2, 0, 1)
        if self.augment:
            epoch = self.epoch.get()
            image = random_crop_flip(
                image, generator=augmentation_generator(self.seed, epoch, j, current_draw()) if epoch >= 0 else None
            )
        pixels = (image.float().div_(255.0) - self._mean) / self._std
        return {"pixel_values": pixels, "labels": torch.tensor(self.labels[j], dtype=torch.int64)}

    def __repr__(self) -> str:
        return f"CIFAR10Dataset(n={len(self)}, augment={self.augment}, images={self.images!r})"


def _decode_chunk(items: list[tuple[str, bytes]]) -> np.ndarray:
    """Decode ``(display name, encoded bytes)`` pairs into ``uint8[n,32,32,3]``."""
    from PIL import Image

    out = np.empty((len(items), 32, 32, 3), np.uint8)
    for k, (name, data) in enumerate(items):
        try:
            with Image.open(io.BytesIO(data)) as im:
                array = np.asarray(im.convert("RGB"))
        except Exception as err:  # PIL raises many types for bad data
            raise DataConfigError(f"data.root: {name} cannot be decoded as an image ({err})") from None
        if array.shape != (32, 32, 3):
            raise DataConfigError(
                f"data.root: {name} is {array.shape[1]}x{array.shape[0]} pixels; expected a 32x32 CIFAR-10 image"
            )
        out[k] = array
    return out


def _iter_archive(path: Path) -> Iterator[tuple[str, str, str, bytes]]:
    with tarfile.open(path, "r:*") as tar:
        for member in tar:
            match = _IMAGE_RE.match(member.name)
            if member.isfile() and match:
                yield match[1], match[2], match[3], tar.extractfile(member).read()
        # tarfile stops quietly at a damaged header and never reaches the end of the compressed stream; reading it
        # to the end makes gzip (bz2, xz) check its CRC and length
        while tar.fileobj.read(1 << 20):
            pass


def _folder_files(root: Path) -> list[tuple[str, str, Path]]:
    return [
        (split, cls.name, f)
        for split in _SPLITS
        if (root / split).is_dir()
        for cls in sorted((root / split).iterdir())
        if cls.is_dir()
        for f in sorted(cls.iterdir())
        if _IMAGE_RE.match(f"{split}/{cls.name}/{f.name}")
    ]


def _iter_folder(root: Path) -> Iterator[tuple[str, str, str, bytes]]:
    for split, cls, f in _folder_files(root):
        yield split, cls, f.name, f.read_bytes()


def _init_worker(parent_pid: int) -> None:
    """Decode worker start-up: on Linux, ask the kernel to SIGKILL this worker when its parent dies (the parent
    killed by SIGTERM/SIGKILL cannot shut the pool down); exit at once if the parent is already gone."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # no libc / no prctl: rely on the parent-pid check only
            pass
    if os.getppid() != parent_pid:
        os._exit(1)


def _pool() -> Executor | None:
    workers = min(2, os.cpu_count() or 1)
    if workers < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return None  # decode in-process
    return ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("fork"), initializer=_init_worker, initargs=(os.getpid(),)
    )


def _check_counts(labels: dict[str, np.ndarray], src: Path, what: str) -> None:
    """Require exactly :data:`_PER_CLASS` images of every class in each split (archive and torchvision sources)."""
    for split in _SPLITS:
        counts = np.bincount(labels[split], minlength=len(CIFAR10_CLASSES))
        per_class = _PER_CLASS[split]
        if len(counts) == len(CIFAR10_CLASSES) and (counts == per_class).all():
            continue
        wrong = ", ".join(
            f"{CIFAR10_CLASSES[c] if c < len(CIFAR10_CLASSES) else c}: {n:,}"
            for c, n in enumerate(counts)
            if n != per_class
        )
        raise DataConfigError(
            f"data.root: '{src}' holds {int(counts.sum()):,} {split} images ({wrong}); expected "
            f"{per_class * len(CIFAR10_CLASSES):,} ({per_class:,} per class): {what} is incomplete or corrupt "
            "(re-copy or re-download it)"
        )


def _decode_source(
    items: Iterator[tuple[str, str, str, bytes]], src: Path, archive: bool = False
) -> dict[str, np.ndarray]:
    """Decode every image of ``items`` and return the arrays of both splits, sorted by (class, file name).
    ``archive``: ``src`` is an archive, which must hold the exact CIFAR-10 counts."""
    keys: list[tuple[str, str, str]] = []
    chunks: list = []
    batch: list[tuple[str, bytes]] = []
    pool = _pool()
    try:
        with warnings.catch_warnings():  # py>=3.12 warns on fork in a threaded process; workers only run PIL
            warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
            for split, cls, name, data in items:
                keys.append((split, cls, name))
                batch.append((f"'{src}' member {split}/{cls}/{name}", data))
                if len(batch) == _CHUNK:
                    chunks.append(pool.submit(_decode_chunk, batch) if pool else _decode_chunk(batch))
                    batch = []
            if batch:
                chunks.append(pool.submit(_decode_chunk, batch) if pool else _decode_chunk(batch))
            images = np.concatenate([c if pool is None else c.result() for c in chunks]) if chunks else None
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    classes = {split: sorted({c for s, c, _ in keys if s == split}) for split in _SPLITS}
    if classes["train"] != list(CIFAR10_CLASSES) or classes["test"] != list(CIFAR10_CLASSES):
        raise DataConfigError(
            f"data.root: '{src}' has classes {classes['train']} under train/ and {classes['test']} under test/; "
            f"expected train/<class>/*.jpg and test/<class>/*.jpg (at least one image each) for the ten CIFAR-10 "
            f"classes {' '.join(CIFAR10_CLASSES)}"
            + ("; the archive may be truncated or corrupt (re-copy or re-download it)" if archive else "")
        )
    label_of = {c: i for i, c in enumerate(CIFAR10_CLASSES)}
    out = {}
    for split in _SPLITS:
        pos = sorted((i for i, k in enumerate(keys) if k[0] == split), key=lambda i: (label_of[keys[i][1]], keys[i][2]))
        pos = np.asarray(pos, dtype=np.int64)
        out[f"{split}_images"] = images[pos]
        out[f"{split}_labels"] = np.asarray([label_of[keys[i][1]] for i in pos], dtype=np.int64)
    if archive:
        _check_counts({s: out[f"{s}_labels"] for s in _SPLITS}, src, "the archive")
    return out


class CIFAR10DataModule(EffiDataModule):
    """CIFAR-10 image classification (10 classes, 32x32 RGB); see the module docstring for the sources and cache.

    Splits (after ``setup()``): ``train_dataset`` = the 50,000 training images minus ``val_size`` images chosen by a
    permutation seeded with ``seed`` (``val_dataset``); ``test_dataset`` = the 10,000 test images. ``train_subset``,
    ``val_subset``, ``test_subset`` (int or ``None``) keep the first n samples of a seeded permutation of the split
    (a ``torch.utils.data.Subset``; for tests and benchmarks). Samples are ``{"pixel_values": float32[3,32,32],
    "labels": int64[]}``, batches ``pixel_values[B,3,32,32]``, ``labels[B]`` (default collate). Training samples are
    augmented (random crop with padding 4, horizontal flip) when ``augment``; val/test never are.

    Raises:
        DataConfigError: invalid argument, e.g. a non-boolean ``augment``/``download``/``pin_memory`` (in
            ``__init__``); missing ``root``, unreadable, truncated or corrupt archive (or download) without exactly
            5,000 training and 1,000 test images per class, wrong layout, a class without images in a split,
            undecodable or non-32x32 image (in ``prepare_data``/``setup``, naming the file; nothing is cached).
    """

    num_classes = 10
    classes = list(CIFAR10_CLASSES)

    def __init__(
        self,
        root: str | os.PathLike,
        batch_size: int = 128,
        num_workers: int = 2,
        val_size: int = 5000,
        train_subset: int | None = None,
        val_subset: int | None = None,
        test_subset: int | None = None,
        augment: bool = True,
        download: bool = False,
        seed: int = 0,
        cache_dir: str | os.PathLike | None = None,
        pin_memory: bool = False,
    ):
        super().__init__(batch_size, num_workers, seed, cache_dir, pin_memory)
        if root is None:
            raise DataConfigError(f"data.root: not set; {_EXPECTED}")
        self.root = Path(root).expanduser()
        self.val_size = check_int("val_size", val_size)
        self.train_subset = check_int("train_subset", train_subset, optional=True)
        self.val_subset = check_int("val_subset", val_subset, optional=True)
        self.test_subset = check_int("test_subset", test_subset, optional=True)
        self.augment = check_bool("augment", augment)
        self.download = check_bool("download", download)
        if not self.download and not self.root.exists():
            raise DataConfigError(f"data.root: '{self.root}' does not exist; {_EXPECTED}")

    def model_hints(self) -> dict:
        return {"num_classes": self.num_classes}

    def _source(self) -> tuple[str, Path]:
        """``("archive" | "folder" | "download", path)``."""
        root = self.root
        if root.is_file():
            return "archive", root
        if (root / ARCHIVE_NAME).is_file():
            return "archive", root / ARCHIVE_NAME
        if (root / "train").is_dir() and (root / "test").is_dir():
            return "folder", root
        if self.download:
            return "download", root
        if not root.exists():
            raise DataConfigError(f"data.root: '{root}' does not exist; {_EXPECTED}")
        raise DataConfigError(
            f"data.root: '{root}' contains neither {ARCHIVE_NAME} nor train/ and test/ ImageFolder trees; {_EXPECTED}"
        )

    def _prepare(self) -> Path:
        kind, path = self._source()
        if kind == "archive":
            key = cache_key(source=kind, md5=file_md5(path), version=_CACHE_VERSION)
        elif kind == "folder":
            listing = [
                (str(f.relative_to(path)), f.stat().st_size, f.stat().st_mtime_ns) for _, _, f in _folder_files(path)
            ]
            key = cache_key(source=kind, listing=listing, version=_CACHE_VERSION)
        else:  # torchvision verifies its archive's md5, so the content is fixed
            key = cache_key(source=kind, md5="c58f30108f718f92721af3b95e74349a", version=_CACHE_VERSION)
        entry = resolve_cache_dir(self.cache_dir, "cifar10") / key
        if not entry.is_dir():
            arrays = self._decode(kind, path)
            with atomic_dir(entry) as tmp:
                save_npy(tmp, **arrays)
        return entry

    @staticmethod
    def _decode(kind: str, path: Path) -> dict[str, np.ndarray]:
        if kind == "download":
            import torchvision

            out = {}
            for split in _SPLITS:
                ds = torchvision.datasets.CIFAR10(str(path), train=split == "train", download=True)
                out[f"{split}_images"] = np.asarray(ds.data, dtype=np.uint8)
                out[f"{split}_labels"] = np.asarray(ds.targets, dtype=np.int64)
            _check_counts({s: out[f"{s}_labels"] for s in _SPLITS}, path, "the torchvision download")
            return out
        if kind == "folder":
            return _decode_source(_iter_folder(path), path)
        try:
            return _decode_source(_iter_archive(path), path, archive=True)
        except (tarfile.TarError, EOFError, zlib.error, OSError) as err:
            raise DataConfigError(
                f"data.root: '{path}' is not a readable .tar.gz archive: it is incomplete or "
                f"corrupt ({type(err).__name__}: {err}); expected {ARCHIVE_NAME} holding "
                "train/<class>/NNNN.jpg and test/<class>/NNNN.jpg (re-copy or re-download the "
                "file)"
            ) from err

    def _setup(self, entry: Path) -> None:
        images = {s: NpyFile(entry / f"{s}_images.npy") for s in _SPLITS}
        labels = {s: load_npy(entry / f"{s}_labels.npy") for s in _SPLITS}
        for s in _SPLITS:  # open now: a damaged entry is found (and rebuilt) in setup, not in a DataLoader worker
            if len(images[s]) != len(labels[s]):
                raise ValueError(f"'{images[s].path}' holds {len(images[s])} images for {len(labels[s])} labels")
        n_train = len(labels["train"])
        if self.val_size >= n_train:
            raise DataConfigError(
                f"data.val_size: {self.val_size} is invalid; expected fewer than the {n_train} training images"
            )
        perm = np.random.default_rng([self.seed, 0]).permutation(n_train)
        val_idx, train_idx = perm[: self.val_size], perm[self.val_size :]
        self.train_dataset = seeded_subset(
            CIFAR10Dataset(images["train"], labels["train"], train_idx, augment=self.augment, seed=self.seed),
            self.train_subset,
            self.seed,
            1,
            "train_subset",
        )
        self.val_dataset = seeded_subset(
            CIFAR10Dataset(images["train"], labels["train"], val_idx), self.val_subset, self.seed, 2, "val_subset"
        )
        self.test_dataset = seeded_subset(
            CIFAR10Dataset(images["test"], labels["test"], np.arange(len(labels["test"]))),
            self.test_subset,
            self.seed,
            3,
            "test_subset",
        )
