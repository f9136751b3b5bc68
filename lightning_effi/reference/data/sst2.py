"""SST-2 (GLUE; Socher et al., 2013): binary sentiment of single sentences.

Reads ``root/train.tsv`` (67,349 rows) and ``root/dev.tsv`` (872 rows): tab-separated, label (0/1) first, then the
sentence, one header row (the headers differ between the files, so columns are taken by position). A WordPiece
tokenizer is trained on the training sentences; every sentence is tokenized once into ``[CLS] tokens [SEP]``
(truncated to ``max_length``) and stored as a flat ``int32`` token array plus ``int64`` offsets and labels under
``<cache_dir>/sst2/<key>/`` (with ``tokenizer.json``), keyed by the md5 of both files, ``vocab_size`` and
``max_length``. The GLUE test labels are not public, so ``val_dataset`` and ``test_dataset`` are both the dev set.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_effi.core.errors import DataConfigError

from .base import EffiDataModule, PaddingCollate, check_int, seeded_subset
from .cache import NpyFile, atomic_dir, cache_key, file_md5, load_npy, resolve_cache_dir, save_npy
from .tokenization import BERT_SPECIAL_TOKENS, load_tokenizer, save_tokenizer, train_wordpiece_tokenizer

__all__ = ["SST2DataModule", "SST2Dataset", "read_sst2_tsv"]

_CACHE_VERSION = 2  # 2: empty splits are rejected (version 1 could cache them)
_SPLITS = {"train": "train.tsv", "dev": "dev.tsv"}


def read_sst2_tsv(path: str | os.PathLike) -> tuple[list[str], np.ndarray]:
    """``(sentences, labels int64[n])`` of a GLUE SST-2 TSV file (UTF-8; first row = header, skipped; empty lines
    skipped).

    Raises:
        DataConfigError: missing file, no data row, a line that is not UTF-8, a row without exactly 2 tab-separated
            columns, or a label other than 0/1 (naming the file and line).
    """
    path = Path(path)
    if not path.is_file():
        raise DataConfigError(
            f"data.root: '{path}' does not exist; expected the GLUE SST-2 file {path.name} "
            "(label<TAB>sentence with a header row)"
        )
    sentences, labels = [], []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as err:
                raise DataConfigError(
                    f"data.root: '{path}' line {lineno}: byte {err.object[err.start]:#04x} at "
                    f"position {err.start + 1} is not valid UTF-8 ({err.reason}); expected a UTF-8 "
                    "text file"
                ) from None
            if lineno == 1 or not line:  # the header row, an empty line
                continue
            cols = line.split("\t")
            if len(cols) != 2:
                raise DataConfigError(
                    f"data.root: '{path}' line {lineno}: {len(cols)} tab-separated columns; "
                    "expected 2 (label, sentence)"
                )
            if cols[0] not in ("0", "1"):
                raise DataConfigError(f"data.root: '{path}' line {lineno}: label {cols[0]!r}; expected 0 or 1")
            labels.append(int(cols[0]))
            sentences.append(cols[1])
    if not labels:
        raise DataConfigError(
            f"data.root: '{path}' has no data rows; expected a header row followed by label<TAB>sentence rows"
        )
    return sentences, np.asarray(labels, dtype=np.int64)


class SST2Dataset(Dataset):
    """Pre-tokenized sentences: sample ``{"input_ids": int64[L_i], "labels": int64[]}``, ``L_i`` = tokens of
    sentence ``i`` including ``[CLS]``/``[SEP]``; ``sequence_lengths()`` = ``diff(offsets)`` (vectorised)."""

    def __init__(self, ids: NpyFile, offsets: np.ndarray, labels: np.ndarray):
        self.ids = ids
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.labels = np.asarray(labels, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        i = range(len(self))[i]  # bounds check and negative indices
        ids = self.ids.array[self.offsets[i] : self.offsets[i + 1]]
        return {
            "input_ids": torch.from_numpy(ids.astype(np.int64)),
            "labels": torch.tensor(self.labels[i], dtype=torch.int64),
        }

    def sequence_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


class SST2DataModule(EffiDataModule):
    """SST-2 sentence classification (2 classes) with a WordPiece tokenizer trained on the training sentences.

    Samples ``{"input_ids": int64[L_i], "labels": int64[]}`` (variable length ``L_i <= max_length``); the collate
    (:class:`PaddingCollate`) pads to the longest sample of the batch: ``input_ids[B,T]`` (pad id 0),
    ``attention_mask[B,T]`` (int64), ``labels[B]``. ``val_dataset`` = ``test_dataset`` = the dev set (GLUE test
    labels are not public). ``train_subset``/``val_subset`` keep the first n samples of a seeded permutation
    (tests, benchmarks). ``model_hints()`` gives ``vocab_size``, ``pad_token_id``, ``num_classes=2``, ``max_length``.

    Raises:
        DataConfigError: invalid argument; missing or empty ``train.tsv``/``dev.tsv``, non-UTF-8 bytes, wrong column
            count or bad label (naming file and line).
    """

    num_classes = 2

    def __init__(
        self,
        root: str | os.PathLike,
        vocab_size: int = 8192,
        max_length: int = 66,
        batch_size: int = 32,
        num_workers: int = 0,
        train_subset: int | None = None,
        val_subset: int | None = None,
        cache_dir: str | os.PathLike | None = None,
        seed: int = 0,
    ):
        super().__init__(batch_size, num_workers, seed, cache_dir)
        if root is None or not Path(root).expanduser().is_dir():
            raise DataConfigError(
                f"data.root: '{root}' does not exist; expected a directory with the GLUE SST-2 "
                "files train.tsv and dev.tsv"
            )
        self.root = Path(root).expanduser()
        self.vocab_size = check_int("vocab_size", vocab_size)
        self.max_length = check_int("max_length", max_length, minimum=3)
        self.train_subset = check_int("train_subset", train_subset, optional=True)
        self.val_subset = check_int("val_subset", val_subset, optional=True)
        self.pad_token_id = BERT_SPECIAL_TOKENS.index("[PAD]")
        self.collate_fn = PaddingCollate(self.pad_token_id)
        self.tokenizer = None

    def _prepare(self) -> Path:
        paths = {split: self.root / name for split, name in _SPLITS.items()}
        for path in paths.values():
            if not path.is_file():
                raise DataConfigError(
                    f"data.root: '{path}' does not exist; expected the GLUE SST-2 file "
                    f"{path.name} (label<TAB>sentence with a header row)"
                )
        key = cache_key(
            md5={s: file_md5(p) for s, p in paths.items()},
            vocab_size=self.vocab_size,
            max_length=self.max_length,
            version=_CACHE_VERSION,
        )
        entry = resolve_cache_dir(self.cache_dir, "sst2") / key
        if entry.is_dir():
            return entry
        data = {split: read_sst2_tsv(path) for split, path in paths.items()}
        tokenizer = train_wordpiece_tokenizer(data["train"][0], self.vocab_size, self.cache_dir)
        cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
        arrays = {}
        for split, (sentences, labels) in data.items():
            seqs = [
                [cls_id, *e.ids[: self.max_length - 2], sep_id]
                for e in tokenizer.encode_batch(sentences, add_special_tokens=False)
            ]
            arrays[f"{split}_ids"] = np.fromiter((t for s in seqs for t in s), dtype=np.int32)
            arrays[f"{split}_offsets"] = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
            arrays[f"{split}_labels"] = labels
        with atomic_dir(entry) as tmp:
            save_npy(tmp, **arrays)
            save_tokenizer(tokenizer, tmp / "tokenizer.json")
        return entry

    def _setup(self, entry: Path) -> None:
        self.tokenizer = load_tokenizer(entry / "tokenizer.json")
        train, dev = (
            SST2Dataset(
                NpyFile(entry / f"{s}_ids.npy"),
                load_npy(entry / f"{s}_offsets.npy"),
                load_npy(entry / f"{s}_labels.npy"),
            )
            for s in _SPLITS
        )
        for ds in (train, dev):  # open now: a damaged entry is found (and rebuilt) in setup, not in a worker
            if len(ds.offsets) != len(ds) + 1 or ds.offsets[-1] != len(ds.ids):
                raise ValueError(f"'{ds.ids.path}' does not match its offsets and labels")
        self.train_dataset = seeded_subset(train, self.train_subset, self.seed, 1, "train_subset")
        self.val_dataset = self.test_dataset = seeded_subset(dev, self.val_subset, self.seed, 2, "val_subset")

    def model_hints(self) -> dict:
        self.setup()
        return {
            "vocab_size": self.tokenizer.get_vocab_size(),
            "pad_token_id": self.pad_token_id,
            "num_classes": self.num_classes,
            "max_length": self.max_length,
        }
