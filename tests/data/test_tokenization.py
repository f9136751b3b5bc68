import pytest

from lightning_effi.data import (
    STDLIB_CORPUS_FILES,
    CharTokenizer,
    DataConfigError,
    load_tokenizer,
    save_tokenizer,
    stdlib_corpus,
    stdlib_corpus_files,
    train_bpe_tokenizer,
    train_wordpiece_tokenizer,
)

TEXT = "The quick brown fox jumps over the lazy dog.\n  Émile's café costs 3,50 €!\n\n\tdef f(x): return x ** 2\n" * 30


def test_char_tokenizer(tmp_path):
    tok = CharTokenizer.from_text("hello world")
    assert tok.vocab_size == 8 and tok.chars == sorted(set("hello world"))
    assert tok.decode(tok.encode("world hello")) == "world hello"
    assert tok.encode("eh") == [tok.chars.index("e"), tok.chars.index("h")]
    with pytest.raises(ValueError, match="'z' at position 1"):
        tok.encode("hz")
    unk = CharTokenizer.from_text("ab", unk_token="?")
    assert unk.decode(unk.encode("abz")) == "ab?"
    save_tokenizer(tok, tmp_path / "t.json")
    assert load_tokenizer(tmp_path / "t.json") == tok == CharTokenizer.load(tmp_path / "t.json")


def test_bpe_round_trip_and_cache(tmp_path):
    tok = train_bpe_tokenizer(TEXT, 300, tmp_path)
    assert tok.token_to_id("<|endoftext|>") == 0 and tok.get_vocab_size() <= 300
    assert tok.decode(tok.encode(TEXT).ids) == TEXT
    assert tok.decode(tok.encode("unseen ✓ ünïcode\r\n").ids) == "unseen ✓ ünïcode\r\n"
    files = list((tmp_path / "tokenizers").glob("bpe-*.json"))
    assert len(files) == 1
    again = train_bpe_tokenizer(TEXT, 300, tmp_path)
    assert again.get_vocab() == tok.get_vocab() and len(list((tmp_path / "tokenizers").iterdir())) == 1
    train_bpe_tokenizer(TEXT, 280, tmp_path)
    assert len(list((tmp_path / "tokenizers").iterdir())) == 2
    with pytest.raises(DataConfigError, match="data.vocab_size"):
        train_bpe_tokenizer(TEXT, 100, tmp_path)


def test_wordpiece_specials(tmp_path):
    tok = train_wordpiece_tokenizer(TEXT.splitlines(), 200, tmp_path)
    assert [tok.token_to_id(t) for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")] == [0, 1, 2, 3, 4]
    enc = tok.encode("The QUICK fox")
    assert enc.ids[0] == 2 and enc.ids[-1] == 3
    assert tok.decode(enc.ids) == "the quick fox"


def test_stdlib_corpus_deterministic_and_capped():
    files = stdlib_corpus_files()
    assert len(files) >= 25 and files == [f for f in STDLIB_CORPUS_FILES if f in files]
    text = stdlib_corpus()
    assert len(text) == 1_000_000 and text == stdlib_corpus()
    assert text.startswith(f"# ---- {files[0]} ----\n")
    small = stdlib_corpus(max_chars=5000)
    assert small == text[:5000]
    assert f"# ---- {files[1]} ----\n" in stdlib_corpus(max_chars=10**8)


def test_stdlib_corpus_skips_missing(tmp_path):
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "decoder.py").write_text("x = 1")
    (tmp_path / "ast.py").write_text("y = 2\n")
    assert stdlib_corpus_files(tmp_path) == ["ast.py", "json/decoder.py"]
    assert stdlib_corpus(stdlib_dir=tmp_path) == "# ---- ast.py ----\ny = 2\n# ---- json/decoder.py ----\nx = 1\n"
