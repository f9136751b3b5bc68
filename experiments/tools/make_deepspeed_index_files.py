"""Make the DeepSpeed index files that ``tests/data_analysis/test_deepspeed_files.py`` compares lightning_effi with.

DeepSpeed is not a dependency of lightning_effi, so CI cannot run DeepSpeed's ``DataAnalyzer`` itself. This script runs
DeepSpeed 0.19.8's ``DataAnalyzer`` (map, then reduce) and ``MMapIndexedDatasetBuilder`` once, on a small synthetic data
set defined here (pure integer arithmetic, no RNG: the test rebuilds it bit for bit from :func:`make_tokens`), and
writes the files DeepSpeed produced into ``tests/data_analysis/deepspeed_files/`` with a ``MANIFEST.json`` (DeepSpeed
version, command, data-set recipe and digest, the analyzer configurations, the sha256 of every file).

What is written (all DeepSpeed output, nothing computed by lightning_effi):

- ``analyzer/<config>/<metric>/<metric>_<file>.{bin,idx}``: the reduced files of ``DataAnalyzer`` for each
  configuration of :data:`CONFIGS` (one or several map workers, one or several map threads (processes), one or several
  reduce threads, ``sample_indices``) and each metric of :data:`METRICS` (``seqlen`` and ``wsum``:
  ``single_value_per_sample``, four files each; ``hist``: ``accumulate_value_over_samples``, one file);
- ``builder/<dtype>.{bin,idx}``: ``MMapIndexedDatasetBuilder`` files of :data:`BUILDER_ITEMS` in every dtype of the
  current dtype table (two documents, so ``doc_idx`` is not trivial).

Run it in an environment with DeepSpeed 0.19.8 (never in the project's own venv; DeepSpeed's CUDA ops are not needed)::

    python3 -m venv /tmp/dsvenv
    echo /work/main/.venv/lib/python3.11/site-packages > /tmp/dsvenv/lib/python3.11/site-packages/main_venv.pth
    /tmp/dsvenv/bin/pip install wheel setuptools
    DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install --no-build-isolation deepspeed==0.19.8
    /tmp/dsvenv/bin/python experiments/tools/make_deepspeed_index_files.py

Importing this module does not import DeepSpeed (the test imports the data set and the metrics from here).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data_analysis" / "deepspeed_files"
DEEPSPEED_VERSION = "0.19.8"

#: the synthetic data set: ``num_samples`` rows of ``width`` token ids in ``[1, vocab]``, right-padded with 0
RECIPE: dict[str, Any] = {
    "num_samples": 300,
    "width": 12,
    "vocab": 29,
    "seed": 20240229,
    "generator": "LCG x <- (1103515245 * x + 12345) mod 2**31 from x = seed; per row: one draw for the length "
    "1 + (x >> 16) % width, then one draw per position j < width for the token 1 + (x >> 16) % vocab "
    "(positions j >= length are set to 0, the draw is still made)",
}
#: ``wsum`` = position-weighted sum of a row's tokens minus this (negative and positive values: a signed fitted dtype;
#: about 250 distinct values: the ``_percentile_merged`` file merges rows in pairs)
WSUM_OFFSET = 345
#: metric names, types (DeepSpeed's), declared dtypes
METRICS: dict[str, Any] = {
    "names": ["seqlen", "wsum", "hist"],
    "types": ["single_value_per_sample", "single_value_per_sample", "accumulate_value_over_samples"],
    "dtypes": ["int64", "int64", "int64"],
}
SINGLE_FILES = ("sample_to_metric", "index_to_sample", "index_to_metric", "index_to_sample_percentile_merged")
#: analyzer configurations: DeepSpeed DataAnalyzer arguments (``sample_indices``: the name of a permutation below)
CONFIGS: dict[str, dict[str, Any]] = {
    "w1_t1_r1": {"num_workers": 1, "num_threads": 1, "num_threads_reduce": 1, "batch_size": 16},
    "w1_t3_r2": {"num_workers": 1, "num_threads": 3, "num_threads_reduce": 2, "batch_size": 7},
    "w2_t2_r3": {"num_workers": 2, "num_threads": 2, "num_threads_reduce": 3, "batch_size": 10},
    "w1_t2_r1_si": {
        "num_workers": 1,
        "num_threads": 2,
        "num_threads_reduce": 1,
        "batch_size": 9,
        "sample_indices": "stride7",
    },
}
#: items written by ``MMapIndexedDatasetBuilder`` per dtype: ``end_document()`` after the second and the fourth item
BUILDER_ITEMS: list[list[int]] = [[1, 2, 3], [4], [], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
BUILDER_DTYPES = ("uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")


def make_tokens(num_samples: int, width: int, vocab: int, seed: int, **_: Any) -> np.ndarray:
    """``int64[num_samples, width]`` (the recipe in :data:`RECIPE`)."""
    x = seed % 2**31
    out = np.zeros((num_samples, width), dtype=np.int64)

    def draw() -> int:
        nonlocal x
        x = (1103515245 * x + 12345) % 2**31
        return x >> 16

    for i in range(num_samples):
        length = 1 + draw() % width
        for j in range(width):
            token = 1 + draw() % vocab
            if j < length:
                out[i, j] = token
    return out


def tokens_digest(tokens: np.ndarray) -> str:
    """sha256 of the token matrix as little-endian int64, C order."""
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype="<i8").tobytes()).hexdigest()


def sample_indices(name: str | None, num_samples: int) -> np.ndarray | None:
    """The ``sample_indices`` permutation of a configuration: ``"stride7"`` is ``k -> 7 k mod N`` (N coprime to 7)."""
    if name is None:
        return None
    if name == "stride7":
        if np.gcd(7, num_samples) != 1:
            raise ValueError(f"stride7 needs num_samples coprime to 7, got {num_samples}")
        return (7 * np.arange(num_samples, dtype=np.int64)) % num_samples
    raise ValueError(f"unknown sample_indices {name!r}")


class Tokens(torch.utils.data.Dataset[torch.Tensor]):
    """The data set: item ``i`` is row ``i`` of :func:`make_tokens` (``int64[width]``)."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.x = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


def seqlen_metric(batch: torch.Tensor) -> torch.Tensor:
    """Non-padding tokens per row, ``int64[B]``."""
    return torch.count_nonzero(batch, dim=1).to(torch.int64)


def wsum_metric(batch: torch.Tensor) -> torch.Tensor:
    """``sum_j (j + 1) * token_j`` of each row minus :data:`WSUM_OFFSET`, ``int64[B]``."""
    weights = torch.arange(1, batch.shape[1] + 1, dtype=torch.int64)
    return (batch.to(torch.int64) * weights).sum(dim=1) - WSUM_OFFSET


def hist_metric(batch: torch.Tensor) -> torch.Tensor:
    """Token histogram of the batch, ``int64[vocab + 1]`` (index 0 counts the padding)."""
    return torch.bincount(batch.reshape(-1), minlength=RECIPE["vocab"] + 1).to(torch.int64)


METRIC_FUNCTIONS = [seqlen_metric, wsum_metric, hist_metric]


def analyzer_files(metric: str, metric_type: str) -> list[str]:
    """The reduced files' stems of a metric (relative to its folder, without ``.bin`` / ``.idx``)."""
    if metric_type == "single_value_per_sample":
        return [f"{metric}_{name}" for name in SINGLE_FILES]
    return [f"{metric}_metric_value"]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_deepspeed_analyzer(dataset: Tokens, config: dict[str, Any], save_path: Path) -> None:
    """DeepSpeed's map (every worker, every thread) then one reduce, as ``run_map_reduce`` does without
    ``torch.distributed`` (its barriers need a process group)."""
    from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer

    kw = dict(
        num_workers=config["num_workers"],
        num_threads=config["num_threads"],
        num_threads_reduce=config["num_threads_reduce"],
        batch_size=config["batch_size"],
        metric_names=METRICS["names"],
        metric_functions=METRIC_FUNCTIONS,
        metric_types=METRICS["types"],
        metric_dtypes=[getattr(torch, d) for d in METRICS["dtypes"]],
        save_path=str(save_path),
        sample_indices=sample_indices(config.get("sample_indices"), len(dataset)),
    )
    for worker_id in range(config["num_workers"]):
        DataAnalyzer(dataset, worker_id=worker_id, **kw).run_map()
    DataAnalyzer(dataset, worker_id=0, **kw).run_reduce()


def write_builder_files(out: Path) -> None:
    from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDatasetBuilder

    out.mkdir(parents=True)
    for name in BUILDER_DTYPES:
        builder = MMapIndexedDatasetBuilder(str(out / f"{name}.bin"), dtype=getattr(np, name))
        for k, item in enumerate(BUILDER_ITEMS):
            builder.add_item(torch.tensor(item, dtype=torch.int64))
            if k in (1, 3):
                builder.end_document()
        builder.finalize(str(out / f"{name}.idx"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="output folder (replaced)")
    parser.add_argument(
        "--allow-other-version", action="store_true", help=f"run with a DeepSpeed other than {DEEPSPEED_VERSION}"
    )
    args = parser.parse_args(argv)
    import deepspeed

    if deepspeed.__version__ != DEEPSPEED_VERSION and not args.allow_other_version:
        raise SystemExit(f"DeepSpeed {DEEPSPEED_VERSION} is required, found {deepspeed.__version__}")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    tokens = make_tokens(**RECIPE)
    dataset = Tokens(tokens)
    out: Path = args.out
    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp) / "out"
        for name, config in CONFIGS.items():
            work = Path(tmp) / "runs" / name
            with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed's reader prints per file
                run_deepspeed_analyzer(dataset, config, work)
            for metric, metric_type in zip(METRICS["names"], METRICS["types"]):
                dest = staging / "analyzer" / name / metric
                dest.mkdir(parents=True)
                for stem in analyzer_files(metric, metric_type):
                    for ext in ("bin", "idx"):
                        shutil.copyfile(work / metric / f"{stem}.{ext}", dest / f"{stem}.{ext}")
        write_builder_files(staging / "builder")
        files: dict[str, dict[str, Any]] = {
            p.relative_to(staging).as_posix(): {"sha256": _sha256(p), "bytes": p.stat().st_size}
            for p in sorted(staging.rglob("*"))
            if p.is_file()
        }
        total = sum(int(f["bytes"]) for f in files.values())
        manifest = {
            "made_by": "experiments/tools/make_deepspeed_index_files.py",
            "command": "DS_BUILD_OPS=0 python experiments/tools/make_deepspeed_index_files.py"
            + ("" if out == OUT else f" --out {out}"),
            "deepspeed_version": deepspeed.__version__,
            "torch_version": torch.__version__,
            "numpy_version": np.__version__,
            "python_version": platform.python_version(),
            "recipe": {**RECIPE, "wsum_offset": WSUM_OFFSET, "tokens_sha256": tokens_digest(tokens)},
            "metrics": METRICS,
            "configs": CONFIGS,
            "builder": {"dtypes": list(BUILDER_DTYPES), "items": BUILDER_ITEMS, "end_document_after": [1, 3]},
            "files": files,
            "total_bytes": total,
        }
        (staging / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(staging, out)
    print(f"wrote {len(files)} files ({total} bytes) and MANIFEST.json to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("DS_BUILD_OPS", "0")
    raise SystemExit(main())
