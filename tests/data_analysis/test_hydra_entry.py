"""Hydra entry of the analyzer (conf/analyze.yaml, experiments/analyze.py) on a tiny slice of Tiny Shakespeare."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from lightning_effi.curriculum.analysis import MetricIndex, MMapIndexedDataset
from lightning_effi.curriculum.analysis.__main__ import analyze
from lightning_effi.utils.instantiate import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = ROOT.parent / "shared" / "data"
TINY = [
    "data=shakespeare",
    "data.max_chars=20000",
    "data.block_size=32",
    "analyzer.progress=false",
    "analyzer.batch_size=16",
]


def _compose(overrides, out_dir):
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="analyze", overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(out_dir)
        cfg.hydra.runtime.cwd = str(ROOT)
        cfg.paths.data_dir = str(DATA_DIR)
    HydraConfig.instance().set_config(cfg)
    return cfg


@pytest.fixture
def _data(data_root):
    return data_root


def _train_tokens(save):
    """Token blocks of the training set, re-derived from the DataModule for the expected values."""
    from lightning_effi.data import CausalLMDataModule

    dm = CausalLMDataModule(
        DATA_DIR / "tinyshakespeare" / "input.txt", tokenizer="char", block_size=32, max_chars=20000, seed=42
    )
    dm.prepare_data()
    dm.setup("fit")
    return np.stack([dm.train_dataset[i]["input_ids"].numpy() for i in range(len(dm.train_dataset))]), dm


@pytest.mark.slow
def test_script_end_to_end_then_two_pass_and_sharded(_data, tmp_path):
    save = tmp_path / "analysis"
    cmd = [
        sys.executable,
        str(ROOT / "experiments" / "analyze.py"),
        f"paths.data_dir={DATA_DIR}",
        f"save_path={save}",
        f"hydra.run.dir={tmp_path / 'run'}",
        *TINY,
        "analyzer.metrics=[seqlen,total_vocab_freq]",
        "analyzer.num_threads=2",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "analysis.json").read_text())
    tokens, dm = _train_tokens(save)
    n = len(tokens)
    assert summary["num_samples"] == n and summary["metrics"] == ["seqlen", "total_vocab_freq"]
    s2m = MMapIndexedDataset(save / "seqlen" / "seqlen_sample_to_metric")
    assert np.asarray(s2m.flat).tolist() == [32] * n  # fixed-length GPT blocks, no padding
    freq = MMapIndexedDataset(save / "total_vocab_freq" / "total_vocab_freq_metric_value")[0]
    V = dm.model_hints()["vocab_size"]
    assert freq.tolist() == np.bincount(tokens.reshape(-1), minlength=V + 1).tolist()

    # pass 2 (vocab_rarity reads pass 1's file), sharded over 2 "machines" then one reduce, in-process
    base = [*TINY, f"save_path={save}", "analyzer.metrics=[vocab_rarity]", "analyzer.num_workers=2"]
    for w in (0, 1):
        analyze(_compose([*base, "stage=map", f"analyzer.worker_id={w}"], tmp_path / f"w{w}"))
    with pytest.raises(Exception, match="missing|stale"):  # a reduce with another partitioning finds nothing
        analyze(_compose([*base, "stage=reduce", "analyzer.num_workers=3"], tmp_path / "r0"))
    out = analyze(_compose([*base, "stage=reduce"], tmp_path / "r"))
    assert out["reduce"]["vocab_rarity"]["num_samples"] == n
    f = freq.astype(np.float64)
    f[f == 0] = 1
    rho = -np.log(f / f.sum())
    expected = rho[tokens].sum(1).astype(np.int64)
    idx = MetricIndex.load(
        save / "vocab_rarity" / "vocab_rarity_index_to_sample",
        save / "vocab_rarity" / "vocab_rarity_index_to_metric",
        num_samples=n,
    )
    assert idx.fingerprint() == MetricIndex.from_sample_to_metric(expected).fingerprint()


def test_config_errors(_data, tmp_path):
    with pytest.raises(ConfigError, match="unknown metric 'nope'"):
        analyze(_compose([*TINY, f"save_path={tmp_path}", "analyzer.metrics=[nope]"], tmp_path))
    with pytest.raises(ConfigError, match="stage"):
        analyze(_compose([*TINY, f"save_path={tmp_path}", "stage=both"], tmp_path))
    with pytest.raises(ConfigError, match="total_vocab_freq analysis first"):
        analyze(_compose([*TINY, f"save_path={tmp_path}", "analyzer.metrics=[vocab_rarity]"], tmp_path))


def test_pass_two_refuses_the_frequencies_of_another_data_config(_data, tmp_path):
    """One save_path per data choice: pass 1 of another subset (or tokenizer) left its frequency vector there, and
    pass 2 applied it in silence (qa108-break 04)."""
    save = f"save_path={tmp_path / 'analysis'}"
    analyze(_compose([*TINY, save, "analyzer.metrics=[total_vocab_freq]"], tmp_path / "p1"))
    other = [o if not o.startswith("data.max_chars") else "data.max_chars=15000" for o in TINY]
    with pytest.raises(
        ConfigError,
        match=r"^analyzer.metrics.vocab_rarity.freq: '.*' is the total_vocab_freq "
        r"analysis of another data set .*run pass 1 again",
    ):
        analyze(_compose([*other, save, "analyzer.metrics=[vocab_rarity]"], tmp_path / "p2"))
    out = analyze(_compose([*TINY, save, "analyzer.metrics=[vocab_rarity]"], tmp_path / "p3"))  # the same data
    assert out["reduce"]["vocab_rarity"]["num_samples"] > 0


@pytest.mark.slow
def test_module_entry_finds_the_config(tmp_path):
    """``python -m lightning_effi.curriculum.analysis`` reads the repository's conf/analyze.yaml, like the script."""
    cmd = [sys.executable, "-m", "lightning_effi.curriculum.analysis", "--cfg", "job", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "analyzer:" in proc.stdout and "metrics:" in proc.stdout
