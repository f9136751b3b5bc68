"""Benchmark: sequence-length curriculum (``seqlen_truncate``) vs baseline at the same number of optimizer steps.

Character-level GPT-2 (``--layers`` 6, width 128, 4 heads, 128-token blocks, batch 32, AdamW + warmup-cosine over the
steps) on Tiny Shakespeare, both arms built from the same seed and trained for ``--steps`` optimizer steps in one run
(arms alternate order per seed). The curriculum arm truncates every training batch to the difficulty it was drawn at:
``fixed_linear`` from ``--min-difficulty`` (32) to 128 tokens in multiples of 8 over the first ``--curriculum-fraction``
(0.6) of the steps, then full length (DeepSpeed/Megatron ``seqlen_truncate``; the legacy tutorial's recipe). As the
tutorial advises, the curriculum arm's warmup-cosine LR runs over consumed tokens (``Curriculum(total_tokens=...)``
with the exact token budget of the schedule; ``--step-lr`` for steps); the baseline's tokens per step are constant,
so its step-based schedule is the same thing.

Reported per arm: training tokens (EfficiencyMonitor), training wall time (train + data time; evaluation excluded),
validation loss on a fixed validation subset every ``--eval-every`` steps (for the val-loss-vs-tokens plot) and the
final validation loss on the whole validation split (full 128-token blocks for both arms: evaluation is never
truncated).

Targets (issue #4): >= 20% fewer training tokens and >= 15% less training wall time, final validation loss no worse
than baseline + 1%.

    python experiments/bench/curriculum_seqlen.py --seeds 0 1          # ~40 min on 2 CPUs
    python experiments/bench/curriculum_seqlen.py --steps 20 --eval-every 10 --tag _smoke

Writes ``<out>/curriculum_seqlen<tag>.json`` and ``<out>/curriculum_seqlen<tag>.png``.
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
from lightning_effi.callbacks import Curriculum
from lightning_effi.core.lr_schedules import warmup_cosine
from lightning_effi.curriculum import CurriculumConfig
from lightning_effi.curriculum.schedules import difficulties
from lightning_effi.data import CausalLMDataModule, CurriculumDataModule
from lightning_effi.tasks import GPT2CausalLM

ROOT = Path(__file__).resolve().parents[2]


class ValCurve(pl.Callback):
    """Records (optimizer step, training tokens so far, val loss) at every validation run."""

    def __init__(self, monitor: EfficiencyMonitor) -> None:
        self.monitor, self.points = monitor, []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.points.append(
            {
                "step": trainer.global_step,
                "tokens": int(self.monitor.totals["tokens"]),
                "val_loss": float(trainer.callback_metrics["val/loss"]),
            }
        )


def run_arm(args: argparse.Namespace, seed: int, curriculum: bool) -> dict:
    pl.seed_everything(seed, workers=True)
    torch.set_num_threads(args.threads)
    data = CausalLMDataModule(
        Path(args.data_root) / "tinyshakespeare" / "input.txt",
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
        n_layer=args.layers,
        n_embd=128,
        n_head=4,
        dropout=0.0,
        attn_implementation="sdpa",
        weight_decay=0.1,
        optimizer=lambda p: torch.optim.AdamW(p, lr=2e-3, betas=(0.9, 0.95)),
        scheduler=lambda opt, total_steps, progress=None: warmup_cosine(opt, total_steps, 0.05, 0.1, progress),
    )
    monitor = EfficiencyMonitor(print_summary=False)
    curve = ValCurve(monitor)
    callbacks: list[pl.Callback] = [monitor, curve]
    total_curriculum_step = max(1, round(args.curriculum_fraction * args.steps))
    cb = None
    datamodule: pl.LightningDataModule = data
    if curriculum:
        metric = dict(
            difficulty_type="value",
            clustering_type="single_cluster",
            min_difficulty=args.min_difficulty,
            max_difficulty=128,
            schedule_type=args.schedule,
            schedule_config=dict(total_curriculum_step=total_curriculum_step, difficulty_step=8),
        )
        if args.schedule == "fixed_root":
            metric["schedule_config"]["root_degree"] = 2
        total_tokens = None
        if args.token_lr:  # the run's exact token budget: batch x scheduled length, summed over the steps
            schedule = CurriculumConfig(metrics={"seqlen_truncate": metric}).schedules()["seqlen_truncate"]
            total_tokens = 32 * sum(difficulties(schedule, range(1, args.steps + 1)))
        cb = Curriculum(metrics={"seqlen_truncate": metric}, seed=seed, total_tokens=total_tokens)
        callbacks.append(cb)
        datamodule = CurriculumDataModule(data)
    trainer = pl.Trainer(
        max_steps=args.steps,
        max_epochs=-1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=args.eval_batches,
        val_check_interval=args.eval_every,
        check_val_every_n_epoch=None,
        callbacks=callbacks,
    )
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    fit_s = time.perf_counter() - t0
    validator = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    val = validator.validate(model, datamodule=data, verbose=False)[0]
    s = monitor.summary
    result = {
        "arm": "curriculum" if curriculum else "baseline",
        "seed": seed,
        "steps": trainer.global_step,
        "train_wall_s": s["time_train_s"] + s["time_data_s"],
        "eval_wall_s": s["time_eval_s"],
        "fit_wall_s": fit_s,
        "tokens": s["tokens"],
        "samples": s["samples"],
        "flops": s["flops"],
        "val/loss": float(val["val/loss"]),
        "curve": curve.points,
    }
    if cb is not None:
        result["schedule"] = {
            "schedule_type": args.schedule,
            "min_difficulty": args.min_difficulty,
            "max_difficulty": 128,
            "total_curriculum_step": total_curriculum_step,
            "difficulty_step": 8,
            "token_lr": args.token_lr,
            "total_tokens": total_tokens,
        }
        result["consumed_tokens_callback"] = cb.consumed_tokens
    return result


def summarise(results: list[dict]) -> dict:
    mean = statistics.mean
    base = [r for r in results if r["arm"] == "baseline"]
    cl = [r for r in results if r["arm"] == "curriculum"]
    out = {
        "token_saving": 1 - mean(r["tokens"] for r in cl) / mean(r["tokens"] for r in base),
        "flops_saving": 1 - mean(r["flops"] for r in cl) / mean(r["flops"] for r in base),
        "train_wall_saving": 1 - mean(r["train_wall_s"] for r in cl) / mean(r["train_wall_s"] for r in base),
        "val/loss_baseline": mean(r["val/loss"] for r in base),
        "val/loss_curriculum": mean(r["val/loss"] for r in cl),
    }
    out["val/loss_relative_change"] = out["val/loss_curriculum"] / out["val/loss_baseline"] - 1
    out["per_seed"] = {
        str(r["seed"]): {
            "token_saving": 1 - r["tokens"] / b["tokens"],
            "train_wall_saving": 1 - r["train_wall_s"] / b["train_wall_s"],
            "val/loss_relative_change": r["val/loss"] / b["val/loss"] - 1,
        }
        for r in cl
        for b in base
        if b["seed"] == r["seed"]
    }
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        style = dict(
            color="tab:blue" if r["arm"] == "baseline" else "tab:orange",
            linestyle="-" if r["seed"] == results[0]["seed"] else "--",
        )
        xs = [p["tokens"] / 1e6 for p in r["curve"]]
        axes[0].plot(xs, [p["val_loss"] for p in r["curve"]], marker=".", label=f"{r['arm']} seed {r['seed']}", **style)
        axes[1].bar(f"{r['arm']}\nseed {r['seed']}", r["train_wall_s"], color=style["color"])
        axes[1].text(
            f"{r['arm']}\nseed {r['seed']}",
            r["train_wall_s"],
            f"val {r['val/loss']:.4f}\n{r['tokens'] / 1e6:.2f}M tok",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    axes[0].set_xlabel("training tokens (millions)")
    axes[0].set_ylabel("validation loss (subset)")
    axes[0].set_title("GPT-2 / Tiny Shakespeare: val loss vs tokens")
    axes[0].legend(fontsize=8)
    axes[1].set_ylabel("training wall time (s)")
    axes[1].set_title("same optimizer steps")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", default=os.environ.get("EFFI_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--min-difficulty", type=int, default=32)
    p.add_argument(
        "--curriculum-fraction",
        type=float,
        default=0.6,
        help="share of the steps over which the length grows to 128 (then full-length training)",
    )
    p.add_argument("--schedule", default="fixed_linear", choices=["fixed_linear", "fixed_root"])
    p.add_argument(
        "--step-lr",
        dest="token_lr",
        action="store_false",
        help="curriculum arm: warmup-cosine LR over steps instead of consumed tokens (the DeepSpeed "
        "tutorial's advice with seqlen_truncate is to warm up and decay the LR by tokens; the baseline's "
        "tokens per step are constant, so for it both axes are the same)",
    )
    p.add_argument("--arms", nargs="+", default=["baseline", "curriculum"], choices=["baseline", "curriculum"])
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=20, help="validation batches per curve point")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup-steps", type=int, default=5, help="throwaway fit before the arms (0: none)")
    p.add_argument("--out", default=str(ROOT / "experiments" / "bench" / "results"))
    p.add_argument("--tag", default="")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.warmup_steps:  # one throwaway short fit: first-use costs (thread pools, allocator) hit neither arm
        run_arm(
            argparse.Namespace(
                **{**vars(args), "steps": args.warmup_steps, "eval_every": args.warmup_steps, "eval_batches": 1}
            ),
            args.seeds[0],
            True,
        )
    results = []
    for i, seed in enumerate(args.seeds):
        for curriculum in (False, True) if i % 2 == 0 else (True, False):
            if ("curriculum" if curriculum else "baseline") not in args.arms:
                continue
            results.append(run_arm(args, seed, curriculum))
            r = results[-1]
            print(
                f"seed {seed} {r['arm']:10s}: {r['train_wall_s']:.1f} s, {r['tokens']} tokens, "
                f"val/loss {r['val/loss']:.4f}",
                flush=True,
            )
    summary = summarise(results) if len(args.arms) == 2 else {}
    report = {"config": vars(args), "summary": summary, "runs": results}
    with open(out / f"curriculum_seqlen{args.tag}.json", "w") as f:
        json.dump(report, f, indent=2)
    plot(results, out / f"curriculum_seqlen{args.tag}.png")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
