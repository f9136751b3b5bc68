"""Tokenizers trained with Hugging Face ``tokenizers`` and a character-level tokenizer, cached as JSON.

Trained tokenizers are stored as ``<cache_dir>/tokenizers/<kind>-<key>.json`` where the key hashes the training
text(s) (sha256) and every parameter; they are loaded back with ``tokenizers.Tokenizer.from_file``. Training is
deterministic enough for caching but not guaranteed bit-identical across ``tokenizers`` versions; the cache hides that.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from lightning_effi.core.errors import DataConfigError

from .cache import atomic_write, cache_key, resolve_cache_dir, texts_sha256

__all__ = [
    "BERT_SPECIAL_TOKENS",
    "EOT_TOKEN",
    "CharTokenizer",
    "encode_text",
    "load_tokenizer",
    "save_tokenizer",
    "token_dtype",
    "train_bpe_tokenizer",
    "train_wordpiece_tokenizer",
]

EOT_TOKEN = "<|endoftext|>"
BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # ids 0..4
_VERSION = 1
_LINES_PER_CHUNK = 256


def _line_chunks(text: str) -> list[str]:
    """``text`` cut after line ends into chunks of whole lines (their concatenation is ``text``)."""
    lines = text.splitlines(keepends=True)
    return ["".join(lines[i : i + _LINES_PER_CHUNK]) for i in range(0, len(lines), _LINES_PER_CHUNK)]


def _cached_tokenizer(
    kind: str, texts: str | Sequence[str], cache_dir, params: dict, build: Callable[[], Tokenizer]
) -> Tokenizer:
    key = cache_key(kind=kind, text_sha256=texts_sha256(texts), version=_VERSION, **params)
    path = resolve_cache_dir(cache_dir, "tokenizers") / f"{kind}-{key}.json"
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a plain Exception for a damaged file
            warnings.warn(
                f"cached tokenizer '{path}' is damaged ({err}); deleting and retraining it",
                RuntimeWarning,
                stacklevel=3,
            )
            path.unlink(missing_ok=True)
    tokenizer = build()
    with atomic_write(path, "w", encoding="utf-8") as f:
        f.write(tokenizer.to_str())
    return tokenizer


def _as_texts(texts: str | Iterable[str]) -> str | list[str]:
    return texts if isinstance(texts, str) else list(texts)


def train_bpe_tokenizer(
    texts_or_text: str | Iterable[str], vocab_size: int, cache_dir: str | os.PathLike | None = None
) -> Tokenizer:
    """Byte-level BPE (GPT-2 style, no prefix space) with the special token ``<|endoftext|>`` (id 0).

    ``vocab_size`` (>= 257: 256 bytes + the special token) is an upper bound; the trained vocabulary can be smaller
    for a small text (use ``get_vocab_size()``). ``decode(encode(text).ids) == text`` for any text.

    Raises:
        DataConfigError: ``vocab_size`` < 257.
    """
    if vocab_size < 257:
        raise DataConfigError(f"data.vocab_size: {vocab_size} is too small for byte-level BPE; expected >= 257")
    texts = _as_texts(texts_or_text)

    def build() -> Tokenizer:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT_TOKEN],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(_line_chunks(texts) if isinstance(texts, str) else texts, trainer)
        return tok

    return _cached_tokenizer("bpe", texts, cache_dir, {"vocab_size": vocab_size}, build)


def train_wordpiece_tokenizer(
    texts: str | Iterable[str], vocab_size: int, cache_dir: str | os.PathLike | None = None, lowercase: bool = True
) -> Tokenizer:
    """BERT-style WordPiece: BERT normaliser (lower-casing and accent stripping if ``lowercase``), BERT
    pre-tokeniser, ``##`` continuation prefix, special tokens ``[PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4``, and a
    post-processor adding ``[CLS] ... [SEP]`` (disable with ``add_special_tokens=False``).

    Raises:
        DataConfigError: ``vocab_size`` < 64.
    """
    if vocab_size < 64:
        raise DataConfigError(f"data.vocab_size: {vocab_size} is too small for WordPiece; expected >= 64")
    texts = _as_texts(texts)

    def build() -> Tokenizer:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(
            vocab_size=vocab_size, special_tokens=list(BERT_SPECIAL_TOKENS), show_progress=False
        )
        tok.train_from_iterator(_line_chunks(texts) if isinstance(texts, str) else texts, trainer)
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
        )
        return tok

    return _cached_tokenizer("wordpiece", texts, cache_dir, {"vocab_size": vocab_size, "lowercase": lowercase}, build)


class CharTokenizer:
    """Character-level tokenizer: the vocabulary is the sorted set of characters (id = rank).

    ``unk_token`` (a single character, added to the vocabulary) receives characters outside the vocabulary; without
    it, :meth:`encode` raises ``ValueError`` on an unknown character.
    """

    def __init__(self, chars: Iterable[str], unk_token: str | None = None):
        vocab = set(chars) | ({unk_token} if unk_token is not None else set())
        if not vocab or any(not isinstance(c, str) or len(c) != 1 for c in vocab):
            raise ValueError("CharTokenizer needs a non-empty set of single characters")
        self.chars = sorted(vocab)
        self.unk_token = unk_token
        self._codepoints = np.array([ord(c) for c in self.chars], dtype=np.uint32)

    @classmethod
    def from_text(cls, text: str, unk_token: str | None = None) -> CharTokenizer:
        return cls(set(text), unk_token)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def get_vocab_size(self) -> int:  # same name as tokenizers.Tokenizer
        return self.vocab_size

    def encode_array(self, text: str) -> np.ndarray:
        """Ids of the characters of ``text`` as ``int64[len(text)]`` (vectorised)."""
        codepoints = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
        ids = np.minimum(np.searchsorted(self._codepoints, codepoints), len(self.chars) - 1)
        unknown = self._codepoints[ids] != codepoints
        if unknown.any():
            if self.unk_token is None:
                pos = int(np.argmax(unknown))
                raise ValueError(f"character {text[pos]!r} at position {pos} is not in the vocabulary")
            ids[unknown] = self.chars.index(self.unk_token)
        return ids.astype(np.int64)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def decode(self, ids: Iterable[int]) -> str:
        ids = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64)
        return self._codepoints[ids].astype("<u4").tobytes().decode("utf-32-le", "surrogatepass")

    def save(self, path: str | os.PathLike) -> None:
        """Write ``{"type": "CharTokenizer", "chars": [...], "unk_token": ...}`` as JSON (atomically)."""
        with atomic_write(path, "w", encoding="utf-8") as f:
            json.dump({"type": "CharTokenizer", "chars": self.chars, "unk_token": self.unk_token}, f)

    @classmethod
    def load(cls, path: str | os.PathLike) -> CharTokenizer:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if data.get("type") != "CharTokenizer":
            raise ValueError(f"{path}: not a CharTokenizer file")
        return cls(data["chars"], data.get("unk_token"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and (self.chars, self.unk_token) == (other.chars, other.unk_token)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size}, unk_token={self.unk_token!r})"


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (vocab < 65536), else ``int32``."""
    return np.dtype(np.uint16 if vocab_size < 65536 else np.int32)


def encode_text(tokenizer: Tokenizer | CharTokenizer, text: str) -> np.ndarray:
    """Token ids of ``text`` without special tokens, as ``int64[n]``.

    A ``tokenizers.Tokenizer`` encodes ``text`` in chunks of whole lines (``encode_batch``, parallel); decoding the
    concatenated ids gives back ``text`` for byte-level BPE.
    """
    if isinstance(tokenizer, CharTokenizer):
        return tokenizer.encode_array(text)
    encodings = tokenizer.encode_batch(_line_chunks(text), add_special_tokens=False)
    arrays = [np.asarray(e.ids, dtype=np.int64) for e in encodings]
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)


def save_tokenizer(tokenizer: Tokenizer | CharTokenizer, path: str | os.PathLike) -> None:
    """Write a ``tokenizers.Tokenizer`` or :class:`CharTokenizer` as JSON (atomically)."""
    if isinstance(tokenizer, CharTokenizer):
        tokenizer.save(path)
        return
    with atomic_write(path, "w", encoding="utf-8") as f:
        f.write(tokenizer.to_str())


def load_tokenizer(path: str | os.PathLike) -> Tokenizer | CharTokenizer:
    """Load a tokenizer written by :func:`save_tokenizer` (``Tokenizer.from_file`` or :meth:`CharTokenizer.load`).

    Raises:
        OSError: ``path`` cannot be opened.
        ValueError: ``path`` is not a tokenizer file (empty, truncated, not JSON...); the message names it.
    """
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
            is_char = isinstance(data, dict) and data.get("type") == "CharTokenizer"
            return CharTokenizer.load(path) if is_char else Tokenizer.from_file(str(path))
        except Exception as err:  # JSON errors, CharTokenizer's ValueError/KeyError, tokenizers' plain Exception
            raise ValueError(f"'{path}' is not a valid tokenizer file ({type(err).__name__}: {err})") from err
