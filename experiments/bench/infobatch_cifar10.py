"""Benchmark: InfoBatch vs baseline on CIFAR-10 with the small CNN, in one run, same seeds and epochs.

For each seed both arms train the same model (``effi_cnn_small``, SGD + warmup-cosine, batch 128) for the same number
of epochs on the same training subset; InfoBatch uses the paper's defaults (r = 0.5, delta = 0.875). Reported per arm:
training sample-forwards, training wall time (train + data time of EfficiencyMonitor; evaluation excluded), test
accuracy on the 10,000 test images, the per-epoch kept fraction and validation accuracy vs cumulative
sample-forwards. Also the cost of planning one epoch for 10 million samples.

Targets (issue #3): >= 30% fewer sample-forwards and >= 25% less training wall time, mean test accuracy within 0.5
points of the baseline; planning overhead for 10M samples under 1 s.

    python experiments/bench/infobatch_cifar10.py                       # defaults below (~30-40 min on 2 CPUs)
    python experiments/bench/infobatch_cifar10.py --epochs 2 --train-subset 2000 --seeds 0   # smoke run

Writes ``<out>/infobatch_cifar10<tag>.json`` and ``<out>/infobatch_cifar10<tag>.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_effi import EfficiencyMonitor
from lightning_effi.callbacks import InfoBatchCallback
from lightning_effi.core.lr_schedules import warmup_cosine
from lightning_effi.data import CIFAR10DataModule, InfoBatchDataModule
from lightning_effi.functional import infobatch as ib
from lightning_effi.tasks import ImageClassifier

ROOT = Path(__file__).resolve().parents[2]


class Curve(pl.Callback):
    """Validation accuracy against cumulative training sample-forwards, per epoch."""

    def __init__(self, monitor: EfficiencyMonitor):
        self.monitor = monitor
        self.points: list[dict[str, float]] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or "val/acc" not in trainer.callback_metrics:
            return
        self.points.append(
            {
                "epoch": trainer.current_epoch,
                "samples": self.monitor.totals["samples"],
                "val_acc": float(trainer.callback_metrics["val/acc"]),
            }
        )


def run_arm(args: argparse.Namespace, seed: int, infobatch: bool) -> dict:
    pl.seed_everything(seed, workers=True)
    torch.set_num_threads(args.threads)
    data = CIFAR10DataModule(
        args.data_root,
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        train_subset=args.train_subset,
        val_subset=args.val_subset,
        seed=seed,
    )
    model = ImageClassifier(
        "effi_cnn_small",
        model_kwargs={"widths": args.widths},
        weight_decay=5e-4,
        optimizer=lambda p: torch.optim.SGD(p, lr=args.lr, momentum=0.9, nesterov=True),
        scheduler=lambda opt, total_steps, progress=None: warmup_cosine(opt, total_steps, 0.02, 0.0, progress),
    )
    monitor = EfficiencyMonitor(print_summary=False)
    callbacks: list[pl.Callback] = [monitor, Curve(monitor)]
    datamodule: pl.LightningDataModule = data
    if infobatch:
        cb = InfoBatchCallback(prune_ratio=args.prune_ratio, delta=args.delta, seed=seed)
        callbacks.append(cb)
        datamodule = InfoBatchDataModule(data)
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    trainer.fit(model, datamodule=datamodule)
    test = trainer.test(model, datamodule=data, verbose=False)[0]
    s = monitor.summary
    result = {
        "arm": "infobatch" if infobatch else "baseline",
        "seed": seed,
        "sample_forwards": s["samples"],
        "optimizer_steps": s["optimizer_steps"],
        "train_wall_s": s["time_train_s"] + s["time_data_s"],
        "eval_wall_s": s["time_eval_s"],
        "train_s_per_step": (s["time_train_s"] + s["time_data_s"]) / max(s["optimizer_steps"], 1),
        "flops": s["flops"],
        "test_acc": float(test["test/acc"]),
        "curve": callbacks[1].points,
    }
    if infobatch:
        result["epochs"] = [{k: h[k] for k in ("epoch", "kind", "size", "saved", "well_learned")} for h in cb.history]
        result["kept_fraction"] = [h["size"] / cb.dataset_size for h in cb.history]
        result["saved_fraction"] = s["infobatch/saved_fraction"]
    return result


def planning_overhead(n: int = 10_000_000, repeats: int = 7) -> dict:
    """Seconds to plan one prune epoch (threshold, split, sampling, shuffle, weights) for ``n`` samples."""
    g = torch.Generator().manual_seed(0)
    score = torch.empty(n).exponential_(generator=g)
    seen = torch.ones(n, dtype=torch.bool)
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        plan = ib.plan_epoch(score, seen, epoch=1 + r, num_epochs=10, prune_ratio=0.5, delta=0.875, seed=0)
        times.append(time.perf_counter() - t0)
    return {
        "n": n,
        "seconds": min(times),
        "median_seconds": statistics.median(times),
        "all_seconds": times,
        "saved_fraction": plan.saved / n,
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        style = "-" if r["arm"] == "baseline" else "--"
        ax1.plot(
            [p["samples"] for p in r["curve"]],
            [p["val_acc"] for p in r["curve"]],
            style,
            marker="o",
            label=f"{r['arm']} seed {r['seed']}",
        )
        if r["arm"] == "infobatch":
            ax2.plot(range(len(r["kept_fraction"])), r["kept_fraction"], marker="o", label=f"seed {r['seed']}")
    ax1.set_xlabel("cumulative training sample-forwards")
    ax1.set_ylabel("validation accuracy")
    ax1.legend()
    ax1.set_title("CIFAR-10, small CNN")
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("kept fraction of the training set")
    ax2.set_ylim(0, 1.05)
    ax2.legend()
    ax2.set_title("InfoBatch per-epoch kept fraction")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data-root", default=os.environ.get("EFFI_DATA_DIR", str(ROOT.parent / "shared" / "data")) + "/cifar10"
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--train-subset", type=int, default=20000, help="training images (of 45,000); null = all")
    p.add_argument("--val-subset", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--widths", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--prune-ratio", type=float, default=0.5)
    p.add_argument("--delta", type=float, default=0.875)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "experiments" / "bench" / "results"))
    p.add_argument("--tag", default="", help="suffix of the output file names, e.g. _subset20k")
    p.add_argument(
        "--planning-only",
        action="store_true",
        help="only time the planning of one epoch for 10M samples; writes infobatch_planning<tag>.json",
    )
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.planning_only:
        overhead = planning_overhead()
        with open(out / f"infobatch_planning{args.tag}.json", "w") as f:
            json.dump({"planning_overhead": overhead, "threads": torch.get_num_threads()}, f, indent=2)
        print(json.dumps(overhead, indent=2))
        return

    results = []
    for i, seed in enumerate(args.seeds):
        # alternate which arm runs first, so a slow drift of the machine's speed does not favour one arm
        for infobatch in (False, True) if i % 2 == 0 else (True, False):
            results.append(run_arm(args, seed, infobatch))
            r = results[-1]
            print(
                f"seed {seed} {r['arm']:9s}: {r['sample_forwards']} sample-forwards, {r['train_wall_s']:.1f} s, "
                f"test acc {r['test_acc']:.4f}",
                flush=True,
            )
    results.sort(key=lambda r: (r["seed"], r["arm"] != "baseline"))
    base = [r for r in results if r["arm"] == "baseline"]
    ibr = [r for r in results if r["arm"] == "infobatch"]
    mean = statistics.mean
    summary = {
        "sample_forward_saving": 1 - mean(r["sample_forwards"] for r in ibr) / mean(r["sample_forwards"] for r in base),
        "train_wall_saving": 1 - mean(r["train_wall_s"] for r in ibr) / mean(r["train_wall_s"] for r in base),
        "flops_saving": 1 - mean(r["flops"] for r in ibr) / mean(r["flops"] for r in base),
        "test_acc_baseline": mean(r["test_acc"] for r in base),
        "test_acc_infobatch": mean(r["test_acc"] for r in ibr),
        "train_s_per_step_baseline": mean(r["train_s_per_step"] for r in base),
        "train_s_per_step_infobatch": mean(r["train_s_per_step"] for r in ibr),
    }
    summary["test_acc_delta_points"] = 100 * (summary["test_acc_infobatch"] - summary["test_acc_baseline"])
    overhead = planning_overhead()
    report = {"config": vars(args), "summary": summary, "planning_overhead": overhead, "runs": results}
    with open(out / f"infobatch_cifar10{args.tag}.json", "w") as f:
        json.dump(report, f, indent=2)
    plot(results, out / f"infobatch_cifar10{args.tag}.png")
    print(json.dumps({"summary": summary, "planning_overhead_s": overhead["seconds"]}, indent=2))


if __name__ == "__main__":
    main()
