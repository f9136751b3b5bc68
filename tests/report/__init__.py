"""Tests of the sweep report (``lightning_effi.report``); :func:`write_record` writes synthetic schema-2 run
records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RANDOM_LTD = {"random_ltd": {"_target_": "lightning_effi.callbacks.RandomLTDCallback", "min_value": 32}}


def write_record(
    folder: Path,
    *,
    arm: str = "baseline",
    budget: float = 1.0,
    seed: int = 0,
    loss: float | None = 2.0,
    flops: float = 1e12,
    time_train_s: float = 9.0,
    time_data_s: float = 1.0,
    tokens: int = 1000,
    samples: int = 10,
    techniques: dict[str, Any] | None = None,
    metric: str = "val/loss",
    mode: str = "min",
    curve: list[dict[str, Any]] | None = None,
    schedule: list[dict[str, Any]] | None = None,
    task_name: str = "gpt_stack",
    **extra: Any,
) -> Path:
    """Write ``folder/result.json`` (schema 2, as ``lightning_effi.train`` writes it) and return the folder."""
    if techniques is None:
        techniques = {} if arm == "baseline" else RANDOM_LTD
    if curve is None:  # two validations: halfway and at the end
        curve = [
            {
                "step": s,
                "samples": samples * f,
                "tokens": tokens * f,
                "layer_tokens": 4 * tokens * f,
                "flops": flops * f,
                "train_wall_s": (time_train_s + time_data_s) * f,
                "metrics": {metric: None if loss is None else loss * (1.2 if f < 1 else 1.0)},
            }
            for s, f in ((5, 0.5), (10, 1.0))
        ]
    record = {
        "schema": 2,
        "task_name": task_name,
        "tags": ["test"],
        "seed": seed,
        "arm": arm,
        "budget": budget,
        "techniques": techniques,
        "overrides": [f"seed={seed}", f"budget={budget}"],
        "optimized_metric": metric,
        "optimized_mode": mode,
        "metric": loss,
        "metrics": {metric: loss, "train/loss": 2.5},
        "efficiency": {
            "samples": samples,
            "tokens": tokens,
            "layer_tokens": 4 * tokens,
            "flops": flops,
            "batches": 10,
            "optimizer_steps": 10,
            "time_train_s": time_train_s,
            "time_data_s": time_data_s,
            "time_eval_s": 0.5,
            "time_total_s": time_train_s + time_data_s + 0.5,
        },
        "length": {"max_steps": 10, "max_epochs": -1, "optimizer_steps": 10},
        "curve": curve,
        "schedule": schedule or [],
        "output_dir": str(folder),
        "last_checkpoint": None,
        "best_checkpoint": None,
    }
    record.update(extra)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "result.json").write_text(json.dumps(record, indent=2))
    return folder


#: the synthetic sweep of :func:`write_sweep`: seed -> budget -> (FLOPs, val/loss, train wall s) of the baseline
BASELINES = {
    0: {0.25: (1e12, 3.0, 10.0), 0.5: (2e12, 2.6, 20.0), 0.75: (3e12, 2.4, 30.0), 1.0: (4e12, 2.3, 40.0)},
    1: {0.25: (1e12, 3.1, 11.0), 0.5: (2e12, 2.7, 21.0), 0.75: (3e12, 2.5, 31.0), 1.0: (4e12, 2.35, 41.0)},
}
#: seed -> (FLOPs, val/loss, train wall s) of the random_ltd arm at budget 1.0
ARM = {0: (2e12, 2.5, 15.0), 1: (2e12, 2.55, 16.0)}


def write_sweep(root: Path, arm: dict[int, tuple[float, float, float]] | None = None) -> Path:
    """A Hydra-like sweep folder: 2 seeds x 4 baseline budgets + a random_ltd arm at budget 1.0 (job folders
    ``0..9`` with a ``.hydra/`` each, and a ``multirun.yaml``)."""
    job = 0
    root.mkdir(parents=True, exist_ok=True)
    (root / "multirun.yaml").write_text("hydra: {}\n")
    for seed, budgets in BASELINES.items():
        for budget, (flops, loss, wall) in budgets.items():
            folder = write_record(
                root / str(job), budget=budget, seed=seed, loss=loss, flops=flops, time_train_s=wall - 1, time_data_s=1
            )
            (folder / ".hydra").mkdir()
            job += 1
    for seed, (flops, loss, wall) in (arm or ARM).items():
        folder = write_record(
            root / str(job),
            arm="random_ltd",
            seed=seed,
            loss=loss,
            flops=flops,
            time_train_s=wall - 2,
            time_data_s=2,
            schedule=[
                {"step": 0, "flops": 0.0, "samples": 0, "random_ltd/reserved_length": 32},
                {"step": 5, "flops": flops / 2, "samples": 5, "random_ltd/reserved_length": 64},
                {"step": 10, "flops": flops, "samples": 10, "random_ltd/reserved_length": 128},
            ],
        )
        (folder / ".hydra").mkdir()
        job += 1
    return root
