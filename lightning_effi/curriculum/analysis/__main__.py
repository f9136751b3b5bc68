"""Hydra entry of the DataAnalyzer: ``python -m lightning_effi.curriculum.analysis [overrides]`` (repository
checkout) or ``python experiments/analyze.py [overrides]``; configuration ``conf/analyze.yaml``. The method card is
``lightning_effi/curriculum/README.md``.

Instantiates the ``data`` config group (``conf/data/*.yaml``), runs ``prepare_data()`` / ``setup("fit")`` and
analyzes ``dm.train_dataset`` with ``dm.collate_fn`` (the training order and length), with the metrics
named in ``analyzer.metrics`` (registry names, :func:`lightning_effi.curriculum.analysis.get_metric`). ``stage`` selects
``map``, ``reduce`` or ``map_reduce``; ``analyzer.worker_id`` / ``num_workers`` / ``num_threads`` shard the work.
Writes ``analysis.json`` (what ran, where the files are) to the run's output folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from lightning_effi.utils.instantiate import ConfigError, instantiate

from .analyzer import DataAnalyzer
from .metrics import get_metric, registered_metrics

STAGES = ("map", "reduce", "map_reduce")
_CONF = str(Path(__file__).resolve().parents[3] / "conf")  # the repository's conf/


def _metric_options(name: str, options: dict, hints: dict, save_path: str) -> dict:
    """Fill options the DataModule knows (pad id, vocabulary, length) and the pass-1 frequency file."""
    opts = dict(options or {})
    if name == "seqlen":
        opts.setdefault("pad_token_id", hints.get("pad_token_id", 0 if "pad_token_id" in hints else None))
    if name == "total_vocab_freq":
        if "vocab_size" not in opts:
            if "vocab_size" not in hints:
                raise ConfigError(
                    "analyzer.metrics.total_vocab_freq.vocab_size: not set and the DataModule gives no vocab_size hint"
                )
            opts["vocab_size"] = int(hints["vocab_size"])
    if name in ("vocab_rarity", "seqlen_vocab_rarity"):
        freq = os.path.join(save_path, "total_vocab_freq", "total_vocab_freq_metric_value")
        opts.setdefault("freq", freq)
        if isinstance(opts["freq"], str) and not os.path.exists(opts["freq"] + ".idx"):
            raise ConfigError(
                f"analyzer.metrics.{name}.freq: '{opts['freq']}' not found; run the total_vocab_freq "
                "analysis first (analyzer.metrics=[total_vocab_freq])"
            )
    if name == "seqlen_vocab_rarity":
        opts.setdefault("seq_length", hints.get("max_length"))
        opts.setdefault("pad_token_id", hints.get("pad_token_id", 0))
    return opts


def _check_freq_source(name: str, freq: str, dataset: Any) -> None:
    """The pass-1 ``total_vocab_freq`` file a rarity metric reads must be the analysis of the data set analysed now:
    one ``save_path`` per data choice held the vector of another tokenizer, subset or seed, applied in silence (1513
    of 2000 difficulties changed, qa108-break 04). Compared by the data set fingerprints (its metadata's and this
    data set's), where both exist.

    Raises:
        ConfigError: naming ``analyzer.metrics.<name>.freq`` and the pass-1 command to run again.
    """
    from .index import dataset_fingerprint, read_metadata

    try:
        meta = read_metadata(os.path.dirname(os.path.abspath(freq)))
    except Exception as err:  # noqa: BLE001 - an unreadable metadata file: named as the cause
        raise ConfigError(f"analyzer.metrics.{name}.freq: '{freq}': {err}") from None
    recorded = (meta or {}).get("dataset_fingerprint")
    if not recorded:
        return
    found = dataset_fingerprint(dataset)
    if found is not None and found != recorded:
        raise ConfigError(
            f"analyzer.metrics.{name}.freq: '{freq}' is the total_vocab_freq analysis of another data set (its "
            f"fingerprint {recorded}, the data set analysed now {found}: another tokenizer, vocab_size, subset, seed "
            "or split); run pass 1 again with this data config (analyzer.metrics=[total_vocab_freq]) into this "
            "save_path, or give another save_path to each data config"
        )


def analyze(cfg: DictConfig) -> dict[str, Any]:
    """Run the configured analysis stage; returns (and writes) a summary.

    Raises:
        ConfigError: unknown stage or metric name, missing options.
    """
    stage = cfg.get("stage", "map_reduce")
    if stage not in STAGES:
        raise ConfigError(f"stage: {stage!r} is not one of {STAGES}")
    a = cfg.analyzer
    names = OmegaConf.to_container(a.metrics, resolve=True) if a.get("metrics") else []
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, list) or not names:
        raise ConfigError("analyzer.metrics: give a list of metric names, e.g. [seqlen]")
    options = OmegaConf.to_container(a.metric_options, resolve=True) if a.get("metric_options") else {}
    known = registered_metrics()
    for name in names:
        if name not in known:
            raise ConfigError(f"analyzer.metrics: unknown metric {name!r}; registered: {sorted(known)}")
    for name in options:
        if name not in names:
            raise ConfigError(f"analyzer.metric_options.{name}: not in analyzer.metrics {names}")
    metrics = {name: options.get(name) or {} for name in names}
    dm = instantiate(cfg.data, key="data")
    dm.prepare_data()
    dm.setup("fit")
    hints = dm.model_hints() if hasattr(dm, "model_hints") else {}
    save_path = str(cfg.save_path)
    filled = {name: _metric_options(name, opts, hints, save_path) for name, opts in metrics.items()}
    for name, opts in filled.items():
        if name in ("vocab_rarity", "seqlen_vocab_rarity") and isinstance(opts.get("freq"), str):
            _check_freq_source(name, opts["freq"], dm.train_dataset)
    fns = [get_metric(name, **opts) for name, opts in filled.items()]
    data_cfg = OmegaConf.to_yaml(cfg.data, resolve=True)
    analyzer = DataAnalyzer(
        dm.train_dataset,
        num_workers=a.num_workers,
        worker_id=a.worker_id,
        num_threads=a.num_threads,
        num_threads_reduce=a.num_threads_reduce,
        specific_threads=a.specific_threads,
        batch_size=a.batch_size,
        metric_names=list(metrics),
        metric_functions=fns,
        metric_types=[known[n] for n in metrics],
        metric_dtypes=[a.metric_dtype] * len(metrics),
        save_path=save_path,
        collate_fn=dm.collate_fn,
        keep_temp=a.keep_temp,
        progress=a.progress,
        run_tag=__import__("hashlib").sha256(data_cfg.encode()).hexdigest()[:16],
    )
    summary: dict[str, Any] = {
        "stage": stage,
        "save_path": save_path,
        "num_samples": analyzer.num_samples,
        "metrics": list(metrics),
        "worker_id": a.worker_id,
        "num_workers": a.num_workers,
    }
    if stage in ("map", "map_reduce"):
        summary["map"] = analyzer.run_map()
    if stage == "reduce" or (stage == "map_reduce" and a.worker_id == 0):
        if stage == "map_reduce" and a.num_workers > 1:
            analyzer.wait_for_partitions(3600.0, 1.0)
        summary["reduce"] = analyzer.run_reduce()
    out_dir = cfg.get("paths", {}).get("output_dir") if "paths" in cfg else None
    try:
        if out_dir:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / "analysis.json").write_text(json.dumps(summary, indent=1, default=str))
    except Exception:  # output_dir needs a Hydra runtime; the analysis itself is done
        pass
    return summary


@hydra.main(version_base="1.3", config_path=_CONF, config_name="analyze")
def main(cfg: DictConfig) -> None:
    analyze(cfg)


if __name__ == "__main__":
    main()
