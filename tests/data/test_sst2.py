import numpy as np
import pytest
import torch

from lightning_effi.data import (
    DataConfigError,
    IndexedDataset,
    PaddingCollate,
    SST2DataModule,
    indexed_collate,
    read_sst2_tsv,
    sequence_lengths,
)


@pytest.fixture(scope="module")
def sst2_dm(data_root):
    dm = SST2DataModule(data_root / "sst2", batch_size=32)
    dm.prepare_data()
    dm.setup()
    return dm


def test_counts_and_hints(sst2_dm):
    train, dev = sst2_dm.train_dataset, sst2_dm.val_dataset
    assert len(train) == 67_349 and int(train.labels.sum()) == 37_569 and len(dev) == 872
    assert sst2_dm.test_dataset is dev
    assert sst2_dm.model_hints() == {"vocab_size": 8192, "pad_token_id": 0, "num_classes": 2, "max_length": 66}
    lengths = sequence_lengths(train)
    assert lengths.dtype == np.int64 and lengths.shape == (67_349,) and 3 <= lengths.min() and lengths.max() <= 66
    sample = train[0]
    assert sample["input_ids"][0] == 2 and sample["input_ids"][-1] == 3 and len(sample["input_ids"]) == lengths[0]
    assert sst2_dm.tokenizer.decode(sample["input_ids"].tolist()) == "hide new secretions from the parental units"


def test_padding_collate_matches_lengths(sst2_dm):
    dev = sst2_dm.val_dataset
    lengths = sequence_lengths(dev)
    loader = torch.utils.data.DataLoader(
        IndexedDataset(dev), batch_size=50, shuffle=True, collate_fn=indexed_collate(sst2_dm.collate_fn)
    )
    for collated in loader:
        batch, idx = collated.batch, collated.meta["index"].numpy()
        assert batch["input_ids"].shape == batch["attention_mask"].shape
        assert batch["input_ids"].shape[1] == lengths[idx].max()
        assert batch["attention_mask"].sum(1).tolist() == lengths[idx].tolist()
        assert bool((batch["input_ids"][batch["attention_mask"] == 0] == 0).all())
        assert batch["labels"].shape == idx.shape and batch["labels"].dtype == torch.int64


def test_subsets_and_loader(data_root):
    dm = SST2DataModule(data_root / "sst2", train_subset=100, val_subset=10, batch_size=64)
    dm.setup()
    assert len(dm.train_dataset) == 100 and len(dm.val_dataset) == 10
    assert sequence_lengths(dm.train_dataset).shape == (100,)
    assert [b["labels"].shape[0] for b in dm.train_dataloader()] == [64, 36]


def test_collate_pads_labels():
    out = PaddingCollate(0)(
        [
            {"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([1, -100, 2])},
            {"input_ids": torch.tensor([8]), "labels": torch.tensor([-100])},
        ]
    )
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out["labels"].tolist() == [[1, -100, 2], [-100, -100, -100]]


def test_tsv_errors(tmp_path):
    bad = tmp_path / "train.tsv"
    bad.write_text("label\tsentence\n1\tfine\n2\tbad label\n")
    with pytest.raises(DataConfigError, match=r"train.tsv' line 3: label '2'; expected 0 or 1"):
        read_sst2_tsv(bad)
    bad.write_text("label\tsentence\n1\tfine\n0\ttoo\tmany\n")
    with pytest.raises(DataConfigError, match=r"train.tsv' line 3: 3 tab-separated columns; expected 2"):
        read_sst2_tsv(bad)
    sentences, labels = read_sst2_tsv(_write(tmp_path / "ok.tsv"))
    assert sentences == ["a b", "c"] and labels.tolist() == [1, 0]
    with pytest.raises(DataConfigError, match="dev.tsv' does not exist"):
        SST2DataModule(tmp_path, cache_dir=tmp_path / "c").prepare_data()
    with pytest.raises(DataConfigError, match="data.root"):
        SST2DataModule(tmp_path / "nope")
    with pytest.raises(DataConfigError, match="data.max_length"):
        SST2DataModule(tmp_path, max_length=2)


def _write(path):
    path.write_text("label\tcontent\n1\ta b\n\n0\tc\n")
    return path


def test_tsv_not_utf8_names_file_and_line(tmp_path):
    bad = tmp_path / "train.tsv"
    bad.write_bytes(b"label\tsentence\n1\tfine\n0\tcaf\xe9 latin-1\n")
    with pytest.raises(DataConfigError, match=r"train.tsv' line 3: byte 0xe9 at position 6 is not valid UTF-8"):
        read_sst2_tsv(bad)


@pytest.mark.parametrize("content", ["", "label\tsentence\n", "label\tsentence\n\n\n"])
def test_tsv_without_data_rows(tmp_path, content):
    (tmp_path / "train.tsv").write_text(content)
    with pytest.raises(DataConfigError, match=r"train.tsv' has no data rows"):
        read_sst2_tsv(tmp_path / "train.tsv")
    _write(tmp_path / "train.tsv")
    (tmp_path / "dev.tsv").write_text(content)
    with pytest.raises(DataConfigError, match=r"dev.tsv' has no data rows"):
        SST2DataModule(tmp_path, vocab_size=64, cache_dir=tmp_path / "c").prepare_data()
    assert list((tmp_path / "c" / "sst2").iterdir()) == []
