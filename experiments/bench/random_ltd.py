"""Benchmark: random-LTD vs baseline at the same number of optimizer steps, in one run.

Two tasks, each with both arms built from the same seed and trained for the same number of steps:

- ``gpt``: character-level GPT-2 (6 layers, width 128, 4 heads, 128-token blocks, batch 32, AdamW + warmup-cosine) on
  Tiny Shakespeare; random-LTD on layers 1-4, r from ``--gpt-min`` (32) to 128 (multiples of 16).
- ``vit``: timm ViT (patch 4 on 32x32: 64 patches + CLS, width 128, depth 6, 4 heads) on a CIFAR-10 training subset
  (``--vit-subset``, 20,000 images); random-LTD on blocks 1-4 with the class token kept, r from ``--vit-min`` (17)
  to 65 (multiples of 8).

r grows linearly over ``--require-steps`` (``0.75dur``: the first 75% of the steps), then stays at the full length (the
papers' recipes also end with full-length training: GPT-3 pre-training grows r over 200k of ~286k steps).

Reported per arm: training wall time (EfficiencyMonitor train + data time; evaluation excluded), layer-tokens and
FLOPs consumed, final validation loss (GPT, on the whole validation split) or accuracy (ViT, on the 5,000 validation
images). Per task: theoretical layer-token saving ``1 - consumed / full``, measured wall-time saving, their ratio
("realised fraction"), FLOPs saving.

Targets (issue #5): wall-time saving >= 80% of the theoretical layer-token saving; final validation loss (GPT)
within 1% and accuracy (ViT) within 0.5 points of the baseline.

    python experiments/bench/random_ltd.py --seeds 0 1            # both tasks, 2 seeds (~45 min on 2 CPUs)
    python experiments/bench/random_ltd.py --tasks gpt --gpt-steps 20 --vit-steps 20 --tag _smoke

Writes ``<out>/random_ltd<tag>.json`` and ``<out>/random_ltd<tag>.png``.
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
from lightning_effi.callbacks import RandomLTDCallback
from lightning_effi.core.lr_schedules import warmup_cosine
from lightning_effi.data import CausalLMDataModule, CIFAR10DataModule
from lightning_effi.tasks import GPT2CausalLM, ImageClassifier

ROOT = Path(__file__).resolve().parents[2]


def duration(text: str) -> int | str:
    """``--require-steps``: an int of optimizer steps, else a duration string (``"0.75dur"``, ``"2ep"``)."""
    return int(text) if text.strip().isdigit() else text


def build(task: str, args: argparse.Namespace, seed: int) -> tuple[pl.LightningModule, pl.LightningDataModule, dict]:
    data_root = Path(args.data_root)
    if task == "gpt":
        data = CausalLMDataModule(
            data_root / "tinyshakespeare" / "input.txt",
            corpus="file",
            tokenizer="char",
            block_size=128,
            batch_size=32,
            seed=seed,
        )
        data.prepare_data()
        data.setup("fit")
        model = GPT2CausalLM(
            vocab_size=data.model_hints()["vocab_size"],
            n_positions=128,
            n_layer=args.gpt_layers,
            n_embd=128,
            n_head=4,
            dropout=0.0,
            attn_implementation="sdpa",
            weight_decay=0.1,
            optimizer=lambda p: torch.optim.AdamW(p, lr=2e-3, betas=(0.9, 0.95)),
            scheduler=lambda opt, total_steps, progress=None: warmup_cosine(opt, total_steps, 0.05, 0.1, progress),
        )
        ltd = dict(min_value=args.gpt_min, seq_per_step=16)
        return model, data, {"steps": args.gpt_steps, "metric": "val/loss", "ltd": ltd}
    data = CIFAR10DataModule(
        data_root / "cifar10", batch_size=128, num_workers=0, train_subset=args.vit_subset, seed=seed
    )
    model = ImageClassifier(
        "vit_tiny_patch16_224",
        num_classes=10,
        weight_decay=0.05,
        model_kwargs={"img_size": 32, "patch_size": 4, "embed_dim": 128, "depth": args.vit_layers, "num_heads": 4},
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        scheduler=lambda opt, total_steps, progress=None: warmup_cosine(opt, total_steps, 0.05, 0.0, progress),
    )
    ltd = dict(min_value=args.vit_min, seq_per_step=8, keep_prefix_tokens="auto")
    return model, data, {"steps": args.vit_steps, "metric": "val/acc", "ltd": ltd}


def run_arm(task: str, args: argparse.Namespace, seed: int, with_ltd: bool) -> dict:
    pl.seed_everything(seed, workers=True)
    torch.set_num_threads(args.threads)
    model, data, spec = build(task, args, seed)
    monitor = EfficiencyMonitor(print_summary=False)
    callbacks: list[pl.Callback] = [monitor]
    cb = None
    if with_ltd:
        cb = RandomLTDCallback(**spec["ltd"], require_steps=args.require_steps, seed=seed)
        callbacks.append(cb)
    steps = spec["steps"]
    trainer = pl.Trainer(
        max_steps=steps,
        max_epochs=-1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=data)
    fit_s = time.perf_counter() - t0
    validator = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    val = validator.validate(model, datamodule=data, verbose=False)[0]
    s = monitor.summary
    result = {
        "task": task,
        "arm": "random_ltd" if with_ltd else "baseline",
        "seed": seed,
        "steps": trainer.global_step,
        "train_wall_s": s["time_train_s"] + s["time_data_s"],
        "fit_wall_s": fit_s,
        "layer_tokens": s["layer_tokens"],
        "flops": s["flops"],
        "samples": s["samples"],
        spec["metric"]: float(val[spec["metric"]]),
    }
    if cb is not None:
        result.update({k.split("/", 1)[1]: v for k, v in cb.effi_summary().items()})
        result["schedule"] = {
            "min_value": cb.min_value,
            "max_value": cb.max_value,
            "require_steps": cb.require_steps,
            "seq_per_step": cb.seq_per_step,
            "layer_ids": list(cb.layer_ids),
            "num_layers": cb.num_layers,
        }
    return result


def summarise(results: list[dict], task: str, metric: str) -> dict:
    mean = statistics.mean
    base = [r for r in results if r["task"] == task and r["arm"] == "baseline"]
    ltd = [r for r in results if r["task"] == task and r["arm"] == "random_ltd"]
    layer_token_saving = mean(r["layer_token_saving"] for r in ltd)
    wall_saving = 1 - mean(r["train_wall_s"] for r in ltd) / mean(r["train_wall_s"] for r in base)
    out = {
        "layer_token_saving": layer_token_saving,
        "flops_saving": 1 - mean(r["flops"] for r in ltd) / mean(r["flops"] for r in base),
        "train_wall_saving": wall_saving,
        "realised_fraction": wall_saving / layer_token_saving if layer_token_saving else float("nan"),
        f"{metric}_baseline": mean(r[metric] for r in base),
        f"{metric}_random_ltd": mean(r[metric] for r in ltd),
    }
    if metric == "val/loss":
        out["val/loss_relative_change"] = out["val/loss_random_ltd"] / out["val/loss_baseline"] - 1
    else:
        out["val/acc_delta_points"] = 100 * (out["val/acc_random_ltd"] - out["val/acc_baseline"])
    return out


def plot(results: list[dict], tasks: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        metric = "val/loss" if task == "gpt" else "val/acc"
        for r in results:
            if r["task"] != task:
                continue
            ax.bar(
                f"{r['arm']}\nseed {r['seed']}",
                r["train_wall_s"],
                color="tab:blue" if r["arm"] == "baseline" else "tab:orange",
            )
            ax.text(
                f"{r['arm']}\nseed {r['seed']}",
                r["train_wall_s"],
                f"{metric} {r[metric]:.4f}",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_ylabel("training wall time (s)")
        ax.set_title({"gpt": "GPT-2 / Tiny Shakespeare", "vit": "ViT / CIFAR-10"}[task])
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", default=os.environ.get("EFFI_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    p.add_argument("--tasks", nargs="+", default=["gpt", "vit"], choices=["gpt", "vit"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--gpt-steps", type=int, default=400)
    p.add_argument("--gpt-layers", type=int, default=6)
    p.add_argument("--gpt-min", type=int, default=32)
    p.add_argument("--vit-steps", type=int, default=400)
    p.add_argument("--vit-layers", type=int, default=6)
    p.add_argument("--vit-min", type=int, default=17)
    p.add_argument("--vit-subset", type=int, default=20000)
    p.add_argument(
        "--require-steps",
        type=duration,
        default="0.75dur",
        help="how long r grows to the full length (then full-length training): optimizer steps (an int) "
        "or a duration such as 0.75dur (of the run) or 2ep",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "experiments" / "bench" / "results"))
    p.add_argument("--tag", default="")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    results = []
    for task in args.tasks:
        for i, seed in enumerate(args.seeds):
            for with_ltd in (False, True) if i % 2 == 0 else (True, False):
                results.append(run_arm(task, args, seed, with_ltd))
                r = results[-1]
                metric = "val/loss" if task == "gpt" else "val/acc"
                print(
                    f"{task} seed {seed} {r['arm']:10s}: {r['train_wall_s']:.1f} s, {metric} {r[metric]:.4f}",
                    flush=True,
                )
    summary = {task: summarise(results, task, "val/loss" if task == "gpt" else "val/acc") for task in args.tasks}
    report = {"config": vars(args), "summary": summary, "runs": results}
    with open(out / f"random_ltd{args.tag}.json", "w") as f:
        json.dump(report, f, indent=2)
    plot(results, args.tasks, out / f"random_ltd{args.tag}.png")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
