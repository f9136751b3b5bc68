"""Benchmark: stacked techniques against a budget-matched baseline frontier, in one run (issue #17).

Two stacks, each on its task, every arm built from the same seed:

- ``gpt``: ``experiment=gpt_stack``'s techniques (curriculum ``seqlen_truncate`` 16 -> 128 tokens over the first
  ``--cl-fraction`` of the run + random-LTD on the middle layers, r 32 -> 128 + a 2-level V-cycle, 2% / 50% stages, LR
  x2) on a character-level GPT-2 (``--gpt-layers`` 4 x ``--gpt-width`` 128, 128-token blocks, batch ``--gpt-batch``,
  AdamW + warmup-cosine) on Tiny Shakespeare; metric ``val/loss``.
- ``vit``: ``experiment=vit_stack``'s techniques (InfoBatch r = 0.5, delta = 0.875 + random-LTD on the middle blocks,
  r 17 -> 65, class token kept + a 2-level V-cycle, stages measured on InfoBatch's progress) on a timm ViT (4 blocks,
  128 wide, patch 4) on a CIFAR-10 training subset (``--vit-subset``) for ``--vit-epochs`` epochs; metric ``val/acc``.

**The baseline frontier** (per task and seed): the plain model trained for ``--budgets`` (0.5, 0.75, 1.0) times the
full run's optimizer steps (GPT: ``--gpt-steps``; ViT: ``--vit-epochs`` full epochs), each with its own warmup-cosine
schedule decayed to its end. Each budget gives a point (training FLOPs, training wall time, final metric on the whole
validation split). The stack trains ``--stack-factor`` (1.0) times as long as the full baseline, in steps (GPT) or
epochs (ViT); its cheaper steps (coarse V-cycle level, truncated sequences, dropped tokens, pruned samples) are where
it saves, and a longer stack arm can buy back the quality its cheaper steps lose.

Reported per seed (``analysis``):

- ``frontier_match``: the FLOPs and wall time the baseline frontier needs for the stack's final metric (linear in
  metric between the two frontier points around it), divided by the stack's: ``compute_factor`` and ``wall_factor``
  (> 1: the stack is cheaper for the same quality). A stack better than the full baseline is beyond the frontier: the
  factors are then lower bounds (``beyond_frontier: true``); a stack worse than the smallest budget is below it
  (``below_frontier: true``, factors upper bounds).
- ``reach_full_baseline``: the first point of the stack's validation curve (every ``--eval-every`` steps, the first
  ``--eval-batches`` validation batches) at least as good as the full baseline's last curve point (same subset), and
  the FLOPs and wall-time factors there (full baseline total / stack at that point).

A throwaway short stack fit per task runs first (first-use costs). FLOPs are the
EfficiencyMonitor's (the module's analytic ``effi_training_flops`` on what was trained, lowered by random-LTD for the
skipped tokens, the coarse model's while it trains); wall time is its train + data time (evaluation excluded).
Targets: GPT-2 stack >= 1.5x less compute and >= 1.3x less wall time; ViT stack >= 1.3x less compute.

    python experiments/bench/stack.py --tasks gpt vit --seeds 0 1                 # the defaults (see --help)
    python experiments/bench/stack.py --tasks gpt vit --seeds 0 --gpt-steps 12 --vit-epochs 2 --vit-subset 256 \\
        --eval-every 4 --eval-batches 2 --tag _smoke --out /tmp/stack_smoke      # smoke

Writes ``<out>/stack<tag>.json`` and ``<out>/stack<tag>.png`` (metric vs training FLOPs, top, and vs training wall time,
bottom; one column per task; frontier points joined per seed, the stack's curve, its final point as a star). The JSON
and plot are rewritten after every arm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_effi import (
    Curriculum,
    EfficiencyMonitor,
    InfoBatchCallback,
    RandomLTDCallback,
    VCycleCallback,
)
from lightning_effi.core.lr_schedules import warmup_cosine
from lightning_effi.data import CausalLMDataModule, CIFAR10DataModule
from lightning_effi.tasks import GPT2CausalLM, ImageClassifier

ROOT = Path(__file__).resolve().parents[2]
METRIC = {"gpt": "val/loss", "vit": "val/acc"}
LOWER_IS_BETTER = {"val/loss": True, "val/acc": False}
TARGETS = {"gpt": {"compute_factor": 1.5, "wall_factor": 1.3}, "vit": {"compute_factor": 1.3}}


def _wall(monitor: EfficiencyMonitor) -> float:
    return float(monitor.totals["time_train"] + monitor.totals["time_data"])


class ValCurve(pl.Callback):
    """(optimizer step, cumulative training FLOPs, cumulative train wall time, metric) at every validation run."""

    def __init__(self, monitor: EfficiencyMonitor, metric: str) -> None:
        self.monitor, self.metric, self.points = monitor, metric, []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or self.metric not in trainer.callback_metrics:
            return
        self.points.append(
            {
                "step": trainer.global_step,
                "flops": float(self.monitor.totals["flops"]),
                "train_wall_s": _wall(self.monitor),
                "metric": float(trainer.callback_metrics[self.metric]),
            }
        )


def build(task: str, args: argparse.Namespace, seed: int) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    data_root = Path(args.data_root)
    if task == "gpt":
        data = CausalLMDataModule(
            data_root / "tinyshakespeare" / "input.txt",
            corpus="file",
            tokenizer="char",
            block_size=128,
            batch_size=args.gpt_batch,
            seed=seed,
        )
        data.prepare_data()
        model = GPT2CausalLM(
            vocab_size=data.model_hints()["vocab_size"],
            n_positions=128,
            n_layer=args.gpt_layers,
            n_embd=args.gpt_width,
            n_head=args.gpt_width // 32,
            dropout=0.0,
            attn_implementation="sdpa",
            weight_decay=0.1,
            optimizer=lambda p: torch.optim.AdamW(p, lr=args.gpt_lr, betas=(0.9, 0.95)),
            scheduler=lambda opt, total_steps, progress=None: warmup_cosine(opt, total_steps, 0.05, 0.1, progress),
        )
        return model, data
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
    return model, data


def stack_callbacks(task: str, args: argparse.Namespace, steps: int) -> list[pl.Callback]:
    vcycle = VCycleCallback(e_a="0.02dur", e_small=f"{args.e_small}dur", lr_multiplier={2: 2.0})
    if task == "gpt":
        curriculum = Curriculum(
            metrics={
                "seqlen_truncate": dict(
                    difficulty_type="value",
                    clustering_type="single_cluster",
                    min_difficulty=16,
                    max_difficulty=128,
                    schedule_type="fixed_linear",
                    schedule_config=dict(
                        total_curriculum_step=max(1, round(args.cl_fraction * steps)), difficulty_step=8
                    ),
                )
            },
            num_epochs=1000,
        )
        return [curriculum, RandomLTDCallback(min_value=32, seq_per_step=16), vcycle]
    return [
        InfoBatchCallback(prune_ratio=0.5, delta=0.875),
        RandomLTDCallback(min_value=17, seq_per_step=8, keep_prefix_tokens="auto"),
        vcycle,
    ]


def full_steps(task: str, args: argparse.Namespace, data: pl.LightningDataModule) -> int:
    if task == "gpt":
        return args.gpt_steps
    data.prepare_data()
    data.setup("fit")
    per_epoch = -(-len(data.train_dataset) // 128)
    return args.vit_epochs * per_epoch


def run_arm(task: str, args: argparse.Namespace, seed: int, arm: str, budget: float = 1.0) -> dict[str, Any]:
    """``arm``: ``"baseline"`` (``budget`` x the full run's steps, its own schedule) or ``"stack"``."""
    pl.seed_everything(seed, workers=True)
    torch.set_num_threads(args.threads)
    model, data = build(task, args, seed)
    full = full_steps(task, args, data)
    metric = METRIC[task]
    monitor = EfficiencyMonitor(print_summary=False)
    curve = ValCurve(monitor, metric)
    callbacks: list[pl.Callback] = [monitor, curve]
    limits: dict[str, Any] = dict(max_steps=max(1, round(budget * full)), max_epochs=-1)
    techniques: list[pl.Callback] = []
    if arm == "stack":
        budget = args.stack_factor
        limits["max_steps"] = max(1, round(budget * full))
        techniques = stack_callbacks(task, args, limits["max_steps"])
        callbacks += techniques
        for cb in techniques:
            wrap = getattr(cb, "wrap_datamodule", None)
            if callable(wrap):
                data = wrap(data)
        if task == "vit":  # InfoBatch plans by epochs
            limits = dict(max_epochs=max(1, round(args.stack_factor * args.vit_epochs)), max_steps=-1)
    trainer = pl.Trainer(
        **limits,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=args.eval_batches,
        val_check_interval=min(args.eval_every, limits["max_steps"]) if limits["max_steps"] > 0 else args.eval_every,
        check_val_every_n_epoch=None,
        use_distributed_sampler=not (arm == "stack" and task == "gpt"),
        callbacks=callbacks,
    )
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=data)
    fit_s = time.perf_counter() - t0
    validator = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    val = validator.validate(model, datamodule=data, verbose=False)[0]
    s = monitor.summary
    result = {
        "task": task,
        "arm": arm,
        "budget": budget,
        "seed": seed,
        "steps": trainer.global_step,
        "train_wall_s": s["time_train_s"] + s["time_data_s"],
        "eval_wall_s": s["time_eval_s"],
        "fit_wall_s": fit_s,
        "flops": s["flops"],
        "samples": s["samples"],
        "tokens": s["tokens"],
        "layer_tokens": s["layer_tokens"],
        "metric": metric,
        "final_metric_full_split": float(val[metric]),
        "curve": curve.points,
        "summary": {k: v for k, v in s.items() if isinstance(v, (int, float))},
    }
    final = result["final_metric_full_split"]
    print(
        f"[{task} seed {seed} {arm} x{budget}] steps {result['steps']}, {metric} {final:.4f}, "
        f"{result['flops'] / 1e12:.3f} TFLOPs, {result['train_wall_s']:.0f} s train",
        flush=True,
    )
    return result


def _better(m: float, target: float, lower: bool) -> bool:
    return m <= target if lower else m >= target


def frontier_match(frontier: list[dict], stack: dict, lower: bool) -> dict[str, Any]:
    """The baseline frontier's FLOPs and wall time at the stack's final metric (linear in metric between the two
    frontier points around it) over the stack's own."""
    pts = sorted(frontier, key=lambda r: r["flops"])
    m = stack["final_metric_full_split"]
    out: dict[str, Any] = {"stack_metric": m, "beyond_frontier": False, "below_frontier": False}
    if _better(m, pts[-1]["final_metric_full_split"], lower) and m != pts[-1]["final_metric_full_split"]:
        f, w = pts[-1]["flops"], pts[-1]["train_wall_s"]
        out["beyond_frontier"] = True
    elif not _better(m, pts[0]["final_metric_full_split"], lower):
        f, w = pts[0]["flops"], pts[0]["train_wall_s"]
        out["below_frontier"] = True
    else:
        f = w = None
        for a, b in zip(pts, pts[1:]):
            ma, mb = a["final_metric_full_split"], b["final_metric_full_split"]
            if _better(m, ma, lower) and _better(mb, m, lower):
                t = 0.0 if mb == ma else (m - ma) / (mb - ma)
                f = a["flops"] + t * (b["flops"] - a["flops"])
                w = a["train_wall_s"] + t * (b["train_wall_s"] - a["train_wall_s"])
                break
        if f is None:  # the frontier is not monotone here: the cheapest point at least as good
            good = [p for p in pts if _better(p["final_metric_full_split"], m, lower)]
            f, w = good[0]["flops"], good[0]["train_wall_s"]
            out["non_monotone_frontier"] = True
    out.update(
        frontier_flops=f,
        frontier_train_wall_s=w,
        compute_factor=f / stack["flops"],
        wall_factor=w / stack["train_wall_s"],
    )
    return out


def reach_full_baseline(full: dict, stack: dict, lower: bool) -> dict[str, Any]:
    if not full["curve"] or not stack["curve"]:
        return {"reached": False, "why": "no curve"}
    target = full["curve"][-1]["metric"]
    for p in stack["curve"]:
        if _better(p["metric"], target, lower):
            return {
                "reached": True,
                "target": target,
                "step": p["step"],
                "compute_factor": full["flops"] / p["flops"],
                "wall_factor": full["train_wall_s"] / p["train_wall_s"],
            }
    last = stack["curve"][-1]["metric"]
    return {"reached": False, "target": target, "gap": (last - target) if lower else (target - last)}


def analyse(runs: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for task in sorted({r["task"] for r in runs}):
        lower = LOWER_IS_BETTER[METRIC[task]]
        per_seed = {}
        for seed in sorted({r["seed"] for r in runs if r["task"] == task}):
            mine = [r for r in runs if r["task"] == task and r["seed"] == seed]
            frontier = [r for r in mine if r["arm"] == "baseline"]
            stacks = [r for r in mine if r["arm"] == "stack"]
            if not frontier or not stacks:
                continue
            full = max(frontier, key=lambda r: r["budget"])
            per_seed[seed] = {
                "frontier_match": frontier_match(frontier, stacks[0], lower),
                "reach_full_baseline": reach_full_baseline(full, stacks[0], lower),
                "stack_flops_over_full_baseline": stacks[0]["flops"] / full["flops"],
                "stack_wall_over_full_baseline": stacks[0]["train_wall_s"] / full["train_wall_s"],
                "final_metric": {
                    "full_baseline": full["final_metric_full_split"],
                    "stack": stacks[0]["final_metric_full_split"],
                },
            }
        factors = [v["frontier_match"] for v in per_seed.values()]
        out[task] = {
            "per_seed": per_seed,
            "mean_compute_factor": statistics.mean(f["compute_factor"] for f in factors) if factors else None,
            "mean_wall_factor": statistics.mean(f["wall_factor"] for f in factors) if factors else None,
            "targets": TARGETS[task],
        }
    return out


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in runs})
    fig, axes = plt.subplots(2, len(tasks), figsize=(6 * len(tasks), 8), squeeze=False)
    for j, task in enumerate(tasks):
        for i, (key, label) in enumerate((("flops", "training FLOPs"), ("train_wall_s", "training wall time (s)"))):
            ax = axes[i][j]
            for seed in sorted({r["seed"] for r in runs if r["task"] == task}):
                mine = [r for r in runs if r["task"] == task and r["seed"] == seed]
                frontier = sorted((r for r in mine if r["arm"] == "baseline"), key=lambda r: r[key])
                if frontier:
                    ax.plot(
                        [r[key] for r in frontier],
                        [r["final_metric_full_split"] for r in frontier],
                        "o-",
                        color=f"C{seed}",
                        label=f"baseline frontier, seed {seed}",
                    )
                for r in (r for r in mine if r["arm"] == "stack"):
                    ax.plot(
                        [p[key] for p in r["curve"]],
                        [p["metric"] for p in r["curve"]],
                        ":",
                        color=f"C{seed}",
                        alpha=0.6,
                        label=f"stack curve (eval subset), seed {seed}",
                    )
                    ax.plot(
                        [r[key]],
                        [r["final_metric_full_split"]],
                        "*",
                        ms=14,
                        color=f"C{seed}",
                        label=f"stack final, seed {seed}",
                    )
            ax.set_xlabel(label)
            ax.set_ylabel(METRIC[task])
            ax.set_title(f"{task} stack vs baseline frontier")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tasks", nargs="+", default=["gpt", "vit"], choices=["gpt", "vit"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--budgets", nargs="+", type=float, default=[0.5, 0.75, 1.0])
    p.add_argument("--gpt-steps", type=int, default=600)
    p.add_argument("--gpt-batch", type=int, default=16)
    p.add_argument("--gpt-layers", type=int, default=4)
    p.add_argument("--gpt-width", type=int, default=128)
    p.add_argument("--gpt-lr", type=float, default=2e-3)
    p.add_argument(
        "--stack-factor",
        type=float,
        default=1.0,
        help="the stack arm's length, times the full baseline's (steps/epochs)",
    )
    p.add_argument("--cl-fraction", type=float, default=0.4, help="curriculum growth, fraction of the GPT run")
    p.add_argument("--e-small", type=float, default=0.5, help="the V-cycle's coarse stage, fraction of the run")
    p.add_argument("--vit-epochs", type=int, default=6)
    p.add_argument("--vit-subset", type=int, default=10000)
    p.add_argument("--vit-layers", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data-root", default=os.environ.get("EFFI_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    p.add_argument("--out", default=str(ROOT / "experiments" / "bench" / "results"))
    p.add_argument("--tag", default="")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / f"stack{args.tag}.json", out / f"stack{args.tag}.png"
    runs: list[dict] = []
    for task in args.tasks:
        # a throwaway short stack fit first takes the first-use costs (imports, tokenizer and image caches, kernels)
        warm = argparse.Namespace(**{**vars(args), "gpt_steps": 4, "vit_epochs": 1, "vit_subset": 256})
        run_arm(task, warm, args.seeds[0], "stack")
        for seed in args.seeds:
            arms = [("stack", args.stack_factor)] + [("baseline", b) for b in args.budgets]
            if seed % 2:  # alternate the order per seed
                arms.reverse()
            for arm, budget in arms:
                runs.append(run_arm(task, args, seed, arm, budget))
                report = {"config": vars(args), "runs": runs, "analysis": analyse(runs)}
                json_path.write_text(json.dumps(report, indent=2))
                plot(runs, png_path)
    print(json.dumps(analyse(runs), indent=2))
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
