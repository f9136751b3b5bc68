"""Language-modelling DataModules over one plain-text corpus: causal LM (GPT-style) and masked LM (BERT-style).

The text is a UTF-8 file (``text_path``, e.g. Tiny Shakespeare) or the embedded stdlib corpus
(``corpus="stdlib"``, :mod:`lightning_effi.reference.data.corpus`), optionally cut to its first ``max_chars``
characters. It is split by characters:
the first ``1 - val_fraction`` for training, the rest for validation (the usual Tiny Shakespeare 90/10 split). The
tokenizer is trained on the training part only; both parts are encoded once and cached as ``.npy`` token arrays
(``uint16`` when the vocabulary has fewer than 65,536 entries, else ``int32``) under ``<cache_dir>/text/<key>/``,
next to the tokenizer (``tokenizer.json``), keyed by the text's sha256, the split point, the tokenizer kind and
``vocab_size``, and memory-mapped at run time.
``test_dataset`` is ``val_dataset`` (a plain-text corpus has no third split).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_effi.core.errors import DataConfigError

from .base import EffiDataModule, PaddingCollate, check_choice, check_file, check_fraction, check_int, seeded_subset
from .cache import NpyFile, atomic_dir, cache_key, resolve_cache_dir, save_npy, texts_sha256
from .corpus import stdlib_corpus, stdlib_corpus_files
from .tokenization import (
    BERT_SPECIAL_TOKENS,
    CharTokenizer,
    encode_text,
    load_tokenizer,
    save_tokenizer,
    token_dtype,
    train_bpe_tokenizer,
    train_wordpiece_tokenizer,
)

__all__ = ["CausalLMDataModule", "MaskedBlockDataset", "MaskedLMDataModule", "TokenBlockDataset", "mask_tokens"]

_CACHE_VERSION = 1
_UNK_CHAR = "\ufffd"


def _check_index(i: int, n: int) -> int:
    i = int(i)
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"index {i} out of range for {n} blocks")
    return i


class TokenBlockDataset(Dataset):
    """Non-overlapping blocks of ``block_size`` tokens of a token array (the incomplete tail is dropped).

    Sample: ``{"input_ids": int64[block_size]}``. ``sequence_lengths()`` is ``block_size`` for every block.
    """

    specials_per_block = 0  # tokens added around each block (MaskedBlockDataset: [CLS], [SEP])

    def __init__(self, tokens: NpyFile, block_size: int):
        self.tokens = tokens
        self.block_size = block_size  # sample length
        self._span = block_size - self.specials_per_block  # text tokens per block
        self.num_blocks = len(tokens) // self._span

    def __len__(self) -> int:
        return self.num_blocks

    def _block(self, i: int) -> torch.Tensor:
        i = _check_index(i, self.num_blocks)
        return torch.from_numpy(self.tokens.array[i * self._span : (i + 1) * self._span].astype(np.int64))

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self._block(i)}

    def sequence_lengths(self) -> np.ndarray:
        return np.full(self.num_blocks, self.block_size, dtype=np.int64)


def mask_tokens(
    input_ids: torch.Tensor,
    special_mask: torch.Tensor,
    mlm_probability: float,
    mask_token_id: int,
    random_token_range: tuple[int, int],
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking of a 1-D ``input_ids``: each non-special token is selected with probability
    ``mlm_probability`` (at least one is selected when any non-special token exists); a selected token becomes
    ``mask_token_id`` with probability 0.8, a uniform random id from ``random_token_range`` (``[low, high)``) with
    probability 0.1, and stays unchanged otherwise. Returns ``(masked input_ids, labels)`` with
    ``labels = input_ids`` at selected positions and ``-100`` elsewhere. Draws from ``generator`` (default RNG if
    ``None``)."""
    probs = torch.full(input_ids.shape, float(mlm_probability)).masked_fill_(special_mask, 0.0)
    selected = torch.bernoulli(probs, generator=generator).bool()
    if not selected.any():
        candidates = (~special_mask).nonzero().flatten()
        if len(candidates):
            selected[candidates[torch.randint(len(candidates), (1,), generator=generator)]] = True
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, -100))
    u = torch.rand(input_ids.shape, generator=generator)
    out = input_ids.masked_fill(selected & (u < 0.8), mask_token_id)
    rand = selected & (u >= 0.8) & (u < 0.9)
    out[rand] = torch.randint(*random_token_range, (int(rand.sum()),), generator=generator)
    return out, labels


class MaskedBlockDataset(TokenBlockDataset):
    """Blocks of ``block_size - 2`` tokens wrapped as ``[CLS] ... [SEP]`` and masked by :func:`mask_tokens`.

    Sample: ``{"input_ids": int64[block_size], "labels": int64[block_size]}`` (-100 = not masked). Random replacement
    ids exclude the special tokens. With ``mask_seed=None`` masks are drawn from the default RNG at every access
    (training); otherwise from a generator seeded by ``(mask_seed, index)``, identical at every access (validation).
    """

    specials_per_block = 2

    def __init__(
        self, tokens: NpyFile, block_size: int, vocab_size: int, mlm_probability: float, mask_seed: int | None = None
    ):
        super().__init__(tokens, block_size)
        self.vocab_size = vocab_size
        self.mlm_probability = mlm_probability
        self.mask_seed = mask_seed
        self.cls_id, self.sep_id, self.mask_id = (BERT_SPECIAL_TOKENS.index(t) for t in ("[CLS]", "[SEP]", "[MASK]"))

    def __getitem__(self, i: int) -> dict:
        body = self._block(i)
        ids = torch.cat([torch.tensor([self.cls_id]), body, torch.tensor([self.sep_id])])
        special = torch.zeros(len(ids), dtype=torch.bool)
        special[[0, -1]] = True
        generator = None
        if self.mask_seed is not None:
            seed = np.random.SeedSequence([self.mask_seed, _check_index(i, self.num_blocks)]).generate_state(1)[0]
            generator = torch.Generator().manual_seed(int(seed))
        input_ids, labels = mask_tokens(
            ids, special, self.mlm_probability, self.mask_id, (len(BERT_SPECIAL_TOKENS), self.vocab_size), generator
        )
        return {"input_ids": input_ids, "labels": labels}


class _TextDataModule(EffiDataModule):
    """Reads, splits, tokenizes and caches the text; subclasses choose the tokenizer and the datasets."""

    tokenizers: tuple[str, ...] = ()
    specials_per_block = 0

    def __init__(
        self,
        text_path,
        corpus,
        tokenizer,
        vocab_size,
        block_size,
        val_fraction,
        batch_size,
        num_workers,
        max_chars,
        train_subset,
        val_subset,
        cache_dir,
        seed,
    ):
        super().__init__(batch_size, num_workers, seed, cache_dir)
        self.corpus = check_choice("corpus", corpus, ("file", "stdlib"))
        if corpus != "file" and text_path is not None:
            # data.text_path=my.txt over the default corpus trained on the stdlib corpus, in silence (qa58-args 04)
            raise DataConfigError(
                f"data.text_path={str(text_path)!r} is given with corpus={corpus!r}, which reads no file; set "
                "corpus='file' to train on the file (Hydra: data.corpus=file data.text_path=...), or leave text_path "
                "null"
            )
        self.text_path = check_file("text_path", text_path) if corpus == "file" else None
        self.tokenizer_name = check_choice("tokenizer", tokenizer, self.tokenizers)
        self.vocab_size = check_int("vocab_size", vocab_size, optional=tokenizer == "char")  # char: unused
        self.block_size = check_int("block_size", block_size, minimum=1 + self.specials_per_block)
        self.val_fraction = check_fraction("val_fraction", val_fraction)
        self.max_chars = check_int("max_chars", max_chars, optional=True)
        self.train_subset = check_int("train_subset", train_subset, optional=True)
        self.val_subset = check_int("val_subset", val_subset, optional=True)
        self.tokenizer = None
        self.corpus_files: list[str] | None = None  # stdlib files used (corpus="stdlib")

    def _text(self) -> str:
        if self.corpus == "stdlib":
            self.corpus_files = stdlib_corpus_files()
            return stdlib_corpus(self.max_chars or 1_000_000)
        try:
            text = self.text_path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise DataConfigError(f"data.text_path: '{self.text_path}' is not UTF-8 text ({err})") from None
        text = text[: self.max_chars] if self.max_chars else text
        if not text:
            raise DataConfigError(f"data.text_path: '{self.text_path}' is empty; expected a non-empty text file")
        return text

    def _train_tokenizer(self, train_text: str, val_text: str):
        raise NotImplementedError

    def _prepare(self) -> Path:
        text = self._text()
        n_train = int(len(text) * (1 - self.val_fraction))
        key = cache_key(
            text_sha256=texts_sha256(text),
            n_train=n_train,
            tokenizer=self.tokenizer_name,
            vocab_size=None if self.tokenizer_name == "char" else self.vocab_size,
            version=_CACHE_VERSION,
        )
        entry = resolve_cache_dir(self.cache_dir, "text") / key
        if not entry.is_dir():
            train_text, val_text = text[:n_train], text[n_train:]
            tokenizer = self._train_tokenizer(train_text, val_text)
            dtype = token_dtype(tokenizer.get_vocab_size())
            arrays = {
                name: encode_text(tokenizer, part).astype(dtype)
                for name, part in (("train", train_text), ("val", val_text))
            }
            with atomic_dir(entry) as tmp:
                save_npy(tmp, **arrays)
                save_tokenizer(tokenizer, tmp / "tokenizer.json")
        return entry

    def _datasets(self, train: NpyFile, val: NpyFile) -> tuple[Dataset, Dataset]:
        raise NotImplementedError

    def _setup(self, entry: Path) -> None:
        self.tokenizer = load_tokenizer(entry / "tokenizer.json")
        train, val = NpyFile(entry / "train.npy"), NpyFile(entry / "val.npy")
        specials = self.specials_per_block
        for name, tokens in (("training", train), ("validation", val)):
            if len(tokens) == 0:  # no block_size (>= 1 + specials) fits: say what is wrong with the text instead
                source = (
                    f"text_path: '{self.text_path}'"
                    if self.corpus == "file"
                    else f"max_chars: {self.max_chars!r} (corpus=stdlib)"
                )
                raise DataConfigError(
                    f"data.{source} gives no token in the {name} split (that part of the text is empty or only "
                    "whitespace); expected at least one token in each split: use a longer text or change "
                    "max_chars/val_fraction"
                )
            if len(tokens) + specials < self.block_size:
                raise DataConfigError(
                    f"data.block_size: {self.block_size} is larger than the {name} split ({len(tokens)} tokens"
                    f"{' + [CLS]/[SEP]' if specials else ''}); expected at most {len(tokens) + specials}: lower "
                    "block_size or max_chars/val_fraction, or use a longer text"
                )
        train_ds, val_ds = self._datasets(train, val)
        self.train_dataset = seeded_subset(train_ds, self.train_subset, self.seed, 1, "train_subset")
        self.val_dataset = self.test_dataset = seeded_subset(val_ds, self.val_subset, self.seed, 2, "val_subset")

    @property
    def actual_vocab_size(self) -> int:
        """Size of the trained vocabulary (can be below ``vocab_size``; the char vocabulary ignores it)."""
        self.setup()
        return self.tokenizer.get_vocab_size()


class CausalLMDataModule(_TextDataModule):
    """Next-token prediction on fixed, non-overlapping blocks of ``block_size`` tokens.

    ``tokenizer="bpe"``: byte-level BPE with at most ``vocab_size`` entries (:func:`train_bpe_tokenizer`);
    ``"char"``: one token per character (:class:`CharTokenizer`, ``vocab_size`` ignored; characters of the
    validation part unseen in training map to U+FFFD, added to the vocabulary only when needed).
    Samples ``{"input_ids": int64[block_size]}``, batches ``input_ids[B,block_size]`` (default collate);
    ``sequence_lengths()`` is ``block_size`` everywhere. ``model_hints()`` gives ``vocab_size`` (trained) and
    ``max_length = block_size``.

    Raises:
        DataConfigError: invalid argument, missing or empty ``text_path``, or ``block_size`` larger than a split.
    """

    tokenizers = ("bpe", "char")

    def __init__(
        self,
        text_path: str | os.PathLike | None = None,
        corpus: str = "file",
        tokenizer: str = "bpe",
        vocab_size: int = 2048,
        block_size: int = 128,
        val_fraction: float = 0.1,
        batch_size: int = 32,
        num_workers: int = 0,
        max_chars: int | None = None,
        train_subset: int | None = None,
        val_subset: int | None = None,
        cache_dir: str | os.PathLike | None = None,
        seed: int = 0,
    ):
        super().__init__(
            text_path,
            corpus,
            tokenizer,
            vocab_size,
            block_size,
            val_fraction,
            batch_size,
            num_workers,
            max_chars,
            train_subset,
            val_subset,
            cache_dir,
            seed,
        )

    def _train_tokenizer(self, train_text: str, val_text: str):
        if self.tokenizer_name == "char":
            return CharTokenizer.from_text(train_text, _UNK_CHAR if set(val_text) - set(train_text) else None)
        return train_bpe_tokenizer(train_text, self.vocab_size, self.cache_dir)

    def _datasets(self, train: NpyFile, val: NpyFile) -> tuple[Dataset, Dataset]:
        return TokenBlockDataset(train, self.block_size), TokenBlockDataset(val, self.block_size)

    def model_hints(self) -> dict:
        return {"vocab_size": self.actual_vocab_size, "max_length": self.block_size}


class MaskedLMDataModule(_TextDataModule):
    """BERT-style masked LM on blocks of ``block_size - 2`` WordPiece tokens wrapped as ``[CLS] ... [SEP]``.

    The WordPiece tokenizer (lower-cased, :func:`train_wordpiece_tokenizer`) has ``[PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3
    [MASK]=4``. A fraction ``mlm_probability`` of the non-special tokens is selected (at least one per sample): 80 %
    become ``[MASK]``, 10 % a random non-special token, 10 % stay (:func:`mask_tokens`). Training masks are
    redrawn at every access (torch default RNG, seeded per DataLoader worker); validation masks depend only on
    ``(seed, index)``, so the validation loss is reproducible. Samples ``{"input_ids": int64[T], "labels":
    int64[T]}`` (-100 = not masked, ``T = block_size``); batches add ``attention_mask[B,T]`` (all ones).
    ``model_hints()`` gives ``vocab_size``, ``pad_token_id`` and ``max_length = block_size``.

    Raises:
        DataConfigError: invalid argument, missing or empty ``text_path``, or ``block_size`` larger than a split.
    """

    tokenizers = ("wordpiece",)
    specials_per_block = 2

    def __init__(
        self,
        text_path: str | os.PathLike | None = None,
        corpus: str = "file",
        tokenizer: str = "wordpiece",
        vocab_size: int = 4096,
        block_size: int = 128,
        mlm_probability: float = 0.15,
        val_fraction: float = 0.1,
        batch_size: int = 32,
        num_workers: int = 0,
        max_chars: int | None = None,
        train_subset: int | None = None,
        val_subset: int | None = None,
        cache_dir: str | os.PathLike | None = None,
        seed: int = 0,
    ):
        super().__init__(
            text_path,
            corpus,
            tokenizer,
            vocab_size,
            block_size,
            val_fraction,
            batch_size,
            num_workers,
            max_chars,
            train_subset,
            val_subset,
            cache_dir,
            seed,
        )
        self.mlm_probability = check_fraction("mlm_probability", mlm_probability)
        self.pad_token_id = BERT_SPECIAL_TOKENS.index("[PAD]")
        self.collate_fn = PaddingCollate(self.pad_token_id)

    def _train_tokenizer(self, train_text: str, val_text: str):
        return train_wordpiece_tokenizer(train_text, self.vocab_size, self.cache_dir, lowercase=True)

    def _datasets(self, train: NpyFile, val: NpyFile) -> tuple[Dataset, Dataset]:
        vocab = self.tokenizer.get_vocab_size()
        return (
            MaskedBlockDataset(train, self.block_size, vocab, self.mlm_probability),
            MaskedBlockDataset(val, self.block_size, vocab, self.mlm_probability, mask_seed=self.seed),
        )

    def model_hints(self) -> dict:
        return {"vocab_size": self.actual_vocab_size, "pad_token_id": self.pad_token_id, "max_length": self.block_size}
