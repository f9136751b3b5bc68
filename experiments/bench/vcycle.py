"""Benchmark: multi-level V-cycle (``VCycleCallback``) vs baseline, in one run (issue #6).

Two tasks, each with both arms built from the same seed (arms alternate order per seed; a throwaway short V-cycle fit
per task first takes the first-use costs):

- ``gpt``: character-level GPT-2 (``--gpt-layers`` 6, ``--gpt-width`` 128, heads of 32, 128-token blocks, batch 32,
  AdamW peak LR ``--gpt-lr`` 2e-3 + warmup-cosine) on Tiny Shakespeare; metric ``val/loss`` (lower is better).
- ``vit``: timm ViT (patch 4 on 32x32: 64 patches + CLS, width 128, depth ``--vit-layers`` 6, 4 heads, batch 128,
  AdamW + warmup-cosine) on a CIFAR-10 training subset (``--vit-subset``, 20,000 images); metric ``val/acc`` (higher
  is better).

The baseline trains ``--gpt-steps`` / ``--vit-steps`` (1,200) optimizer steps. The V-cycle arm trains
``--vcycle-steps-factor`` (1.6) times as many (1,920): the coarse steps are cheap (GPT: 1/6.9 of a full step's
FLOPs), and at equal steps it ends short of the baseline's metric in this short regime (see the tuning runs below).
Its stage fractions and LR schedule follow its own length: ``--levels`` 2; level 1 for ``--e-a-fraction`` (2%: 38
steps), coalesce to half width / half depth (GPT 3 layers x 64, ViT 3 blocks x 64, head size kept), level 2 for
``--e-small-fraction`` (60%: 1,152 steps) with ``--gpt-lr-mult`` / ``--vit-lr-mult`` 2.0 times the peak LR,
de-coalesce + interpolate with the snapshot (``--alpha`` None: the adapter's default 0.25), level 1 for the rest
(730 steps); ``--depth-scheme half`` (the official GPT-2 config's stacking); ``lr_schedule="continue"`` (one
warmup-cosine curve over the arm, fresh optimizer at every switch), GPT with ``--embedding-convention exact``
(function-preserving width maps for the tied pre-LN head). ``--stage-lr`` replaces the module's schedule by the
official GPT-2 example's per-stage schedule (:class:`StageLR`), ``--arms vcycle`` runs the V-cycle arm alone
(tuning; no analysis without a baseline; ``--reanalyse`` recomputes a saved JSON's summary and plot,
``--reanalyse --merge A.json B.json`` builds one report from several files' runs, e.g. a committed baseline and
a V-cycle tuning run of the same seed).

Measured per arm: training FLOPs (EfficiencyMonitor, from the module's ``effi_training_flops``: the small model's
FLOPs while it trains), training wall time (EfficiencyMonitor train + data time; evaluation excluded; the V-cycle's
mapping time at the switches falls between two batches and is counted as data time), and a validation curve: every
``--eval-every`` (40) steps, the metric on the first ``--eval-batches`` (10) validation batches (the same fixed subset
for both arms) with the cumulative FLOPs and train wall time at that step. At the end: the metric on the whole
validation split (GPT: the held-out 10% of the text; ViT: the 5,000 validation images). The switch steps (stage
boundaries) are recorded with their cumulative FLOPs / wall time. Note: a curve point at a switch step is evaluated
after the switch.

"To reach the baseline's final validation metric", per seed: target = the baseline's last curve point (the same eval
subset, at the last step). On the V-cycle arm's curve, the first point at least as good as the target gives the
FLOPs and wall time needed (``first_point``, conservative: quantised to ``--eval-every``) and, linearly interpolated
in metric between that point and the previous one, ``interpolated`` (the headline figure); savings are against the
baseline's totals (``1 - vcycle_at_target / baseline_total``). Never reached: ``reached: false`` with ``gap`` (how
far the V-cycle's last curve point is short of the target, in metric units, positive = worse). The same search with
the baseline's whole-split final metric as the threshold is in ``reach_full_split_target`` (indicative only: it
compares a whole-split number with subset points). Also reported (``whole_run``): the savings of the whole V-cycle
run (FLOPs, the callback's ``vcycle/flops_saved_frac`` = FLOPs saving vs the full model on the same batches, wall
time) and both arms' final metrics. The JSON and plot are rewritten after every arm.

Targets (issue #6): >= 20% fewer training FLOPs and >= 15% less training wall time to the same validation metric
(the paper reports 19-27% for base-size models, after ~100K-step runs; these runs are 1,200 steps, and 2,400 for
the longer ViT run).

    python experiments/bench/vcycle.py --tasks gpt --seeds 0 1 --tag _gpt   # ~60 min on 2 idle CPUs
    python experiments/bench/vcycle.py --tasks vit --seeds 0 1 --tag _vit   # ~90 min
    python experiments/bench/vcycle.py --tasks gpt vit --gpt-steps 20 --vit-steps 20 --eval-every 4 \\
        --eval-batches 2 --vit-subset 512 --tag _smoke --out /tmp/vcycle_smoke          # smoke
    python experiments/bench/vcycle.py --tasks gpt --accelerator gpu --precision bf16-mixed --gpt-steps 20000 \\
        --eval-every 500 --tag _gpt_long     # a long horizon on one GPU (not run: no GPU on the project's machine)

Tuning runs (seed 0; JSON in ``results/vcycle_tuning/``, flags in each file's ``config``; the earlier
defaults were 6 x 256, LR 1e-3, 400 steps, ``adjacent``, a 1.4x arm with 5% / 50% stages): GPT at 400 steps: the 6 x 128
model (small 3 x 64) with the ``official`` / ``exact`` conventions, ``adjacent`` / ``half`` depth pairing,
alpha_original 0.1 / 0.25 / 0.5, LR x1 / x2 / x4 and the per-stage LR all ended 0.13-0.41 above the baseline's final
loss at equal steps; the 6 x 256 model (small 3 x 128) ended 0.19 above it while using 57% of its FLOPs, and short of
it with a 1.4x arm (``adjacent`` 2.1471, ``half`` 2.1376, baseline 2.1186); ``--gpt-lr 2e-3`` there: baseline
1.9597, V-cycle 2.3793. 6 x 128, LR 2e-3, ``half``, 1,200 steps: baseline 1.7249; V-cycle at equal steps 1.8325
(+6.2% at 57% of the FLOPs); 1.4x arm with 5% / 50% stages 1.7315 (+0.4%, -19.9% FLOPs for the whole run: short);
1.45x arm with 2% / 55% 1.7346 (short by 0.009 on the curve); **1.6x arm with 2% / 60% (the defaults) 1.7191, the
baseline's final curve value reached at step ~1,808 with 31% fewer FLOPs** (the two last runs: V-cycle arms run side
by side with one thread each, so only their FLOPs and losses compare with the baseline's). ViT (1,200 steps,
``vit_*.json``): the per-stage LR with coarse LR x2 / x4, coarse LR x1, alpha_original 0.1 and the whole 45k-image
training split (``--vit-subset 45000``, both arms rerun) all end 1.8-6.4 accuracy points below the baseline on the
whole split (curve gaps 3.4-9.1 points): none reaches it.

ViT at twice the horizon (``--vit-steps 2400 --eval-every 80``, defaults otherwise; seeds 0 and 1, each arm in its own
process side by side; ``results/vcycle_vit_2400.json``): the target is reached on both seeds, -29.6% / -63.2% FLOPs
and -17.7% / -64.3% wall (seed 0 on the plateau, at step 3,680 of 3,840; seed 1 early, then 1.3 points above); the
whole V-cycle run: -22.9% FLOPs, -12.0% / -19.7% wall, whole-split accuracy 62.0 -> 62.5% and 61.5 -> 62.8%.

Writes ``<out>/vcycle<tag>.json`` and ``<out>/vcycle<tag>.png`` (top row: metric vs cumulative training FLOPs,
bottom row: vs training wall time; one column per task; stage boundaries as dotted vertical lines, the target as a
grey horizontal line, the interpolated reach point as a star).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_effi import EfficiencyMonitor
from lightning_effi.callbacks import VCycleCallback
from lightning_effi.core.lr_schedules import warmup_cosine, warmup_cosine_multiplier
from lightning_effi.core.progress import Duration
from lightning_effi.data import CausalLMDataModule, CIFAR10DataModule
from lightning_effi.tasks import GPT2CausalLM, ImageClassifier

ROOT = Path(__file__).resolve().parents[2]
METRIC = {"gpt": "val/loss", "vit": "val/acc"}
LOWER_IS_BETTER = {"val/loss": True, "val/acc": False}
TARGETS = {"flops_saving_to_target": 0.20, "train_wall_saving_to_target": 0.15}


def _wall(monitor: EfficiencyMonitor) -> float:
    return float(monitor.totals["time_train"] + monitor.totals["time_data"])


class ValCurve(pl.Callback):
    """Records (optimizer step, cumulative training FLOPs, cumulative train wall time, metric, V-cycle level) at
    every validation run."""

    def __init__(self, monitor: EfficiencyMonitor, metric: str, vcycle: VCycleCallback | None) -> None:
        self.monitor, self.metric, self.vcycle, self.points = monitor, metric, vcycle, []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.points.append(
            {
                "step": trainer.global_step,
                "flops": float(self.monitor.totals["flops"]),
                "train_wall_s": _wall(self.monitor),
                "metric": float(trainer.callback_metrics[self.metric]),
                "level": self.vcycle.level if self.vcycle is not None else 1,
            }
        )
        q = self.points[-1]
        print(
            f"  step {q['step']}: {self.metric} {q['metric']:.4f} (level {q['level']}, {q['flops'] / 1e12:.2f} "
            f"TFLOPs, {q['train_wall_s']:.0f} s train)",
            flush=True,
        )


class SwitchTrace(pl.Callback):
    """Records the V-cycle's level changes (listed after the VCycleCallback, so it sees the new level): step,
    cumulative FLOPs and train wall time at the switch, level after it."""

    def __init__(self, monitor: EfficiencyMonitor, vcycle: VCycleCallback) -> None:
        self.monitor, self.vcycle, self.switches, self._level = monitor, vcycle, [], 1

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        if self.vcycle.level != self._level:
            self.switches.append(
                {
                    "step": trainer.global_step,
                    "flops": float(self.monitor.totals["flops"]),
                    "train_wall_s": _wall(self.monitor),
                    "from_level": self._level,
                    "to_level": self.vcycle.level,
                }
            )
            self._level = self.vcycle.level


class StageLR:
    """The official GPT-2 example's per-stage LR (every stage a fresh schedule, no re-warmup after a switch): stage 1
    warms up linearly over its whole length, every later stage decays from its peak (the level's multiplier applied
    by the callback) to ``min_lr_ratio`` x peak by cosine over its own length. Used with ``lr_schedule="restart"``
    (the rebuilt scheduler's counter starts at 0 at every switch); the n-th call builds the n-th stage's scheduler,
    its length read from the callback's resolved stages (set in its ``setup``, before Lightning first calls
    ``configure_optimizers``)."""

    def __init__(self, vcycle: VCycleCallback, min_lr_ratio: float) -> None:
        self.vcycle, self.min_lr_ratio, self.calls = vcycle, min_lr_ratio, 0

    def __call__(self, opt, total_steps, progress=None):
        lengths = [s for _, s in self.vcycle.stages] + [total_steps - self.vcycle.stage_ends[-1]]
        i = min(self.calls, len(lengths) - 1)
        self.calls += 1
        n, lo = max(1, lengths[i]), self.min_lr_ratio
        if i == 0:
            return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / n))
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: warmup_cosine_multiplier(k / n, 0.0, lo))


def arm_steps(task: str, args: argparse.Namespace, vcycle: bool) -> int:
    """Optimizer steps of an arm: the baseline ``--gpt-steps`` / ``--vit-steps``, the V-cycle that times
    ``--vcycle-steps-factor`` (rounded)."""
    base = args.gpt_steps if task == "gpt" else args.vit_steps
    return round(base * args.vcycle_steps_factor) if vcycle else base


def build(task: str, args: argparse.Namespace, seed: int) -> tuple[pl.LightningModule, pl.LightningDataModule]:
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


def make_vcycle(task: str, args: argparse.Namespace) -> VCycleCallback:
    """The V-cycle arm's callback; the ``--*-fraction`` flags are fractions of the arm's optimizer steps."""
    up_leg = Duration(args.up_leg_fraction, "fraction") if args.levels >= 3 else None
    mult = args.gpt_lr_mult if task == "gpt" else args.vit_lr_mult
    return VCycleCallback(
        levels=args.levels,
        e_a=Duration(args.e_a_fraction, "fraction"),
        e_small=Duration(args.e_small_fraction, "fraction"),
        up_leg=up_leg,
        alpha_original=args.alpha,
        lr_multiplier={k: mult for k in range(2, args.levels + 1)},
        lr_schedule=args.lr_schedule,
        depth_scheme=args.depth_scheme,
        embedding_convention=args.embedding_convention or ("exact" if task == "gpt" else "official"),
    )


def run_arm(task: str, args: argparse.Namespace, seed: int, vcycle: bool, steps: int | None = None) -> dict:
    pl.seed_everything(seed, workers=True)
    torch.set_num_threads(args.threads)
    model, data = build(task, args, seed)
    steps = steps or arm_steps(task, args, vcycle)
    metric = METRIC[task]
    monitor = EfficiencyMonitor(print_summary=False)
    cb = make_vcycle(task, args) if vcycle else None
    if cb is not None and args.stage_lr:
        if args.levels != 2:
            raise SystemExit("--stage-lr supports --levels 2 only")
        model.scheduler_factory = StageLR(cb, 0.1 if task == "gpt" else 0.0)
    curve = ValCurve(monitor, metric, cb)
    callbacks: list[pl.Callback] = [monitor, curve]  # the monitor first: it counts a batch before a switch
    trace = None
    if cb is not None:
        trace = SwitchTrace(monitor, cb)
        callbacks += [cb, trace]
    eval_every = min(args.eval_every, steps)
    trainer = pl.Trainer(
        max_steps=steps,
        max_epochs=-1,
        accelerator=args.accelerator,
        devices=1,
        precision=args.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=args.eval_batches,
        val_check_interval=eval_every,
        check_val_every_n_epoch=None,
        callbacks=callbacks,
    )
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=data)
    fit_s = time.perf_counter() - t0
    validator = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        precision=args.precision,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    val = validator.validate(model, datamodule=data, verbose=False)[0]
    s = monitor.summary
    result = {
        "task": task,
        "arm": "vcycle" if vcycle else "baseline",
        "seed": seed,
        "steps": trainer.global_step,
        "train_wall_s": s["time_train_s"] + s["time_data_s"],
        "eval_wall_s": s["time_eval_s"],
        "fit_wall_s": fit_s,
        "flops": s["flops"],
        "samples": s["samples"],
        "tokens": s["tokens"],
        "metric": metric,
        "final_metric_full_split": float(val[metric]),
        "curve": curve.points,
    }
    if cb is not None:
        result.update({k.split("/", 1)[1]: v for k, v in cb.effi_summary().items()})
        result["schedule"] = {**cb.config(), "stage_ends": list(cb.stage_ends)}
        result["switch_trace"] = trace.switches
    return result


def _better(m: float, target: float, lower: bool) -> bool:
    return m <= target if lower else m >= target


def reach(curve: list[dict], target: float, lower: bool, base_flops: float, base_wall: float) -> dict:
    """First curve point at least as good as ``target`` (``first_point``) and the linear interpolation in metric
    between it and the previous point (``interpolated``); savings vs the baseline's totals."""

    def point(step: float, flops: float, wall: float) -> dict:
        return {
            "step": step,
            "flops": flops,
            "train_wall_s": wall,
            "flops_saving": 1 - flops / base_flops,
            "train_wall_saving": 1 - wall / base_wall,
        }

    for i, p in enumerate(curve):
        if not _better(p["metric"], target, lower):
            continue
        out = {
            "reached": True,
            "target": target,
            "metric_at_point": p["metric"],
            "first_point": point(p["step"], p["flops"], p["train_wall_s"]),
        }
        if i == 0 or p["metric"] == curve[i - 1]["metric"]:
            out["interpolated"] = dict(out["first_point"], note="no previous point: not interpolated")
        else:
            q = curve[i - 1]
            f = (target - q["metric"]) / (p["metric"] - q["metric"])  # in (0, 1]: q is short of the target, p is not
            out["interpolated"] = point(
                q["step"] + f * (p["step"] - q["step"]),
                q["flops"] + f * (p["flops"] - q["flops"]),
                q["train_wall_s"] + f * (p["train_wall_s"] - q["train_wall_s"]),
            )
        return out
    last = curve[-1]["metric"] if curve else math.nan
    return {
        "reached": False,
        "target": target,
        "final_curve_metric": last,
        "gap": (last - target) if lower else (target - last),
    }


def at_vcycle_final(b: dict, v: dict, lower: bool) -> dict:
    """The other iso-quality comparison, for a V-cycle that ends short of the baseline: the FLOPs and wall time the
    baseline needs to reach the V-cycle's final curve metric (interpolated on the baseline's curve) vs the whole
    V-cycle run's (``saving = 1 - vcycle_total / baseline_at_that_metric``)."""
    r = reach(b["curve"], v["curve"][-1]["metric"], lower, b["flops"], b["train_wall_s"])
    if not r["reached"]:
        return {"reached": False, "note": "the V-cycle ended better than the baseline's final metric"}
    p = r["interpolated"]
    return {
        "reached": True,
        "metric": v["curve"][-1]["metric"],
        "baseline_step": p["step"],
        "baseline_flops": p["flops"],
        "baseline_train_wall_s": p["train_wall_s"],
        "flops_saving": 1 - v["flops"] / p["flops"],
        "train_wall_saving": 1 - v["train_wall_s"] / p["train_wall_s"],
    }


def analyse(results: list[dict], task: str) -> dict:
    mean = statistics.mean
    metric = METRIC[task]
    lower = LOWER_IS_BETTER[metric]
    base = {r["seed"]: r for r in results if r["task"] == task and r["arm"] == "baseline"}
    vc = {r["seed"]: r for r in results if r["task"] == task and r["arm"] == "vcycle"}
    seeds = sorted(set(base) & set(vc))
    per_seed = {}
    for seed in seeds:
        b, v = base[seed], vc[seed]
        target = b["curve"][-1]["metric"]
        per_seed[str(seed)] = {
            "whole_run": {
                "steps_baseline": b["steps"],
                "steps_vcycle": v["steps"],
                "flops_saving": 1 - v["flops"] / b["flops"],
                "flops_saved_frac_callback": v["flops_saved_frac"],
                "train_wall_saving": 1 - v["train_wall_s"] / b["train_wall_s"],
                f"{metric}_full_split_baseline": b["final_metric_full_split"],
                f"{metric}_full_split_vcycle": v["final_metric_full_split"],
                f"{metric}_curve_final_baseline": target,
                f"{metric}_curve_final_vcycle": v["curve"][-1]["metric"],
            },
            "reach": reach(v["curve"], target, lower, b["flops"], b["train_wall_s"]),
            "reach_full_split_target": reach(
                v["curve"], b["final_metric_full_split"], lower, b["flops"], b["train_wall_s"]
            ),
            "baseline_self_reach": reach(b["curve"], target, lower, b["flops"], b["train_wall_s"]),
            "at_vcycle_final_metric": at_vcycle_final(b, v, lower),
            "map_seconds": v["map_seconds"],
            "switch_steps": [s["step"] for s in v["switch_trace"]],
        }
    if not seeds:
        return {}
    whole = [per_seed[str(s)]["whole_run"] for s in seeds]
    out: dict = {"seeds": seeds, "whole_run": {k: mean(d[k] for d in whole) for k in whole[0]}}
    w = out["whole_run"]
    if metric == "val/loss":
        w["val/loss_full_split_relative_change"] = (
            w["val/loss_full_split_vcycle"] / w["val/loss_full_split_baseline"] - 1
        )
    else:
        w["val/acc_full_split_delta_points"] = 100 * (w["val/acc_full_split_vcycle"] - w["val/acc_full_split_baseline"])
    reached = [per_seed[str(s)]["reach"] for s in seeds if per_seed[str(s)]["reach"]["reached"]]
    to_target: dict = {"reached_seeds": len(reached), "of_seeds": len(seeds)}
    for kind in ("interpolated", "first_point"):
        if reached:
            to_target[kind] = {k: mean(r[kind][k] for r in reached) for k in ("flops_saving", "train_wall_saving")}
    for kind in ("interpolated", "first_point"):  # met only if every seed reached the target
        ok = len(reached) == len(seeds)
        to_target[f"meets_targets_{kind}"] = {
            "flops": ok and to_target[kind]["flops_saving"] >= TARGETS["flops_saving_to_target"],
            "train_wall": ok and to_target[kind]["train_wall_saving"] >= TARGETS["train_wall_saving_to_target"],
        }
    if len(reached) < len(seeds):
        gaps = [per_seed[str(s)]["reach"]["gap"] for s in seeds if not per_seed[str(s)]["reach"]["reached"]]
        to_target["mean_gap_not_reached"] = mean(gaps)
    out["to_baseline_final_metric"] = to_target
    iso = [per_seed[str(s)]["at_vcycle_final_metric"] for s in seeds]
    if all(d["reached"] for d in iso):
        out["at_vcycle_final_metric"] = {k: mean(d[k] for d in iso) for k in ("flops_saving", "train_wall_saving")}
    out["per_seed"] = per_seed
    return out


def plot(results: list[dict], summary: dict, tasks: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(tasks), figsize=(6.5 * len(tasks), 8), squeeze=False)
    seeds = sorted({r["seed"] for r in results})
    styles = ["-", "--", ":", "-."]
    for col, task in enumerate(tasks):
        metric = METRIC[task]
        for row, (key, scale, label) in enumerate(
            [
                ("flops", 1e12, "cumulative training FLOPs (TFLOPs)"),
                ("train_wall_s", 1.0, "cumulative training wall time (s)"),
            ]
        ):
            ax = axes[row][col]
            for r in results:
                if r["task"] != task:
                    continue
                color = "tab:blue" if r["arm"] == "baseline" else "tab:orange"
                ls = styles[seeds.index(r["seed"]) % len(styles)]
                ax.plot(
                    [p[key] / scale for p in r["curve"]],
                    [p["metric"] for p in r["curve"]],
                    marker=".",
                    color=color,
                    linestyle=ls,
                    label=f"{r['arm']} seed {r['seed']}",
                )
                for sw in r.get("switch_trace", []):
                    x = sw[key] / scale
                    ax.axvline(x, color=color, linestyle=":", linewidth=1)
                    if r["seed"] == seeds[0]:  # the switch steps (and FLOPs) are the same for every seed
                        ax.annotate(
                            f"L{sw['from_level']}→L{sw['to_level']}\n@{sw['step']}",
                            (x, 1.0),
                            xycoords=("data", "axes fraction"),
                            fontsize=7,
                            ha="left",
                            va="top",
                            color=color,
                        )
                if r["arm"] == "baseline":
                    ax.axhline(r["curve"][-1]["metric"], color="grey", linestyle=ls, linewidth=0.8)
            for seed_key, d in summary.get(task, {}).get("per_seed", {}).items():
                rc = d["reach"]
                if rc["reached"]:
                    pt = rc["interpolated"]
                    ax.plot(
                        pt[key] / scale,
                        rc["target"],
                        marker="*",
                        markersize=12,
                        color="tab:red",
                        label=f"reach seed {seed_key}: -{100 * pt['flops_saving']:.0f}% FLOPs, "
                        f"-{100 * pt['train_wall_saving']:.0f}% wall",
                    )
            ax.set_xlabel(label)
            ax.set_ylabel(f"{metric} (first eval batches)")
            ax.set_title(
                {"gpt": "GPT-2 / Tiny Shakespeare", "vit": "ViT / CIFAR-10"}[task]
                + (": metric vs FLOPs" if row == 0 else ": metric vs wall time")
            )
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_report(results: list[dict], args: argparse.Namespace, out: Path) -> dict:
    summary = {task: analyse(results, task) for task in args.tasks}
    report = {"config": vars(args), "targets": TARGETS, "summary": summary, "runs": results}
    with open(out / f"vcycle{args.tag}.json", "w") as f:
        json.dump(report, f, indent=2)
    plot(results, summary, args.tasks, out / f"vcycle{args.tag}.png")
    return summary


# config keys that define a task's baseline and its metric subset: the runs merged into one report must agree on them
# (eval_every may differ: it sets the curve's resolution only)
_RUN_KEYS = {
    "gpt": ("gpt_steps", "gpt_layers", "gpt_width", "gpt_lr", "eval_batches"),
    "vit": ("vit_steps", "vit_layers", "vit_subset", "eval_batches"),
}


def merge_reports(paths: list[Path], seeds: list[int] | None) -> tuple[dict, list[dict]]:
    """Runs of several benchmark JSONs as one report: a later file's run replaces an earlier one of the same
    (task, arm, seed); ``seeds`` (None: all) filters. Returns (the last file's config with ``tasks``, ``seeds``,
    ``arms`` set from the merged runs and ``merged_from``, the runs). Raises ``SystemExit`` when the files disagree
    on a key of ``_RUN_KEYS`` for a task they share (their baselines would not be comparable)."""
    runs: dict[tuple, dict] = {}
    configs = []
    for path in paths:
        if not path.is_file():
            raise SystemExit(f"--merge: {path} is not a file")
        saved = json.loads(path.read_text())
        if not isinstance(saved, dict) or not {"config", "runs"} <= saved.keys():
            raise SystemExit(f"--merge: {path} is not a vcycle benchmark JSON (needs 'config' and 'runs')")
        configs.append(saved["config"])
        for r in saved["runs"]:
            if seeds is None or r["seed"] in seeds:
                runs[(r["task"], r["arm"], r["seed"])] = r
    merged = list(runs.values())
    if not merged:
        raise SystemExit(f"--merge: no runs (seeds {seeds}) in {[str(p) for p in paths]}")
    tasks = [t for t in METRIC if any(r["task"] == t for r in merged)]
    for task in tasks:
        for key in _RUN_KEYS[task]:
            values = {(c.get(key) if task in c["tasks"] else None) for c in configs} - {None}
            if len(values) > 1:
                raise SystemExit(f"--merge: the files disagree on {key} for {task}: {sorted(values)}")
    config = {
        **configs[-1],
        "tasks": tasks,
        "seeds": sorted({r["seed"] for r in merged}),
        "arms": sorted({r["arm"] for r in merged}),
        "merged_from": [str(p) for p in paths],
    }
    return config, merged


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", default=os.environ.get("EFFI_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    p.add_argument("--tasks", nargs="+", default=["gpt", "vit"], choices=["gpt", "vit"])
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0 (--merge: every seed)")
    p.add_argument("--gpt-steps", type=int, default=1200)
    p.add_argument("--gpt-layers", type=int, default=6)
    p.add_argument("--gpt-width", type=int, default=128, help="GPT width (heads of 32: width / 32 heads)")
    p.add_argument("--gpt-lr", type=float, default=2e-3, help="GPT peak LR (AdamW)")
    p.add_argument("--vit-steps", type=int, default=1200)
    p.add_argument("--vit-layers", type=int, default=6)
    p.add_argument("--vit-subset", type=int, default=20000)
    p.add_argument("--levels", type=int, default=2)
    p.add_argument("--e-a-fraction", type=float, default=0.02, help="steps of every down-leg stage (share of the run)")
    p.add_argument("--e-small-fraction", type=float, default=0.6, help="steps of the coarsest level (share of the run)")
    p.add_argument("--up-leg-fraction", type=float, default=0.1, help="levels >= 3: each up-leg stage's share")
    p.add_argument("--alpha", type=float, default=None, help="alpha_original (None: the adapter's default, 0.25)")
    p.add_argument("--gpt-lr-mult", type=float, default=2.0, help="peak-LR multiplier of the coarse levels (GPT)")
    p.add_argument("--vit-lr-mult", type=float, default=2.0, help="peak-LR multiplier of the coarse levels (ViT)")
    p.add_argument(
        "--vcycle-steps-factor",
        type=float,
        default=1.6,
        help="the V-cycle arm trains for this times the baseline's steps (stage fractions and its LR "
        "schedule follow its own length): > 1 lets its curve reach a target it misses at equal steps",
    )
    p.add_argument("--lr-schedule", default="continue", choices=["continue", "restart"])
    p.add_argument(
        "--depth-scheme",
        default="half",
        choices=["adjacent", "half"],
        help="VCycleCallback.depth_scheme (half: the official GPT-2 config's stacking)",
    )
    p.add_argument(
        "--stage-lr",
        action="store_true",
        help="V-cycle arm: the official recipe's per-stage LR (StageLR; implies --lr-schedule restart)",
    )
    p.add_argument(
        "--embedding-convention",
        default=None,
        choices=["official", "exact"],
        help="VCycleCallback.embedding_convention (default: exact for GPT, official for ViT)",
    )
    p.add_argument(
        "--arms",
        nargs="+",
        default=["baseline", "vcycle"],
        choices=["baseline", "vcycle"],
        help="arms to run (tuning: vcycle only; the analysis needs both)",
    )
    p.add_argument("--eval-every", type=int, default=40)
    p.add_argument("--eval-batches", type=int, default=10, help="validation batches per curve point")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--accelerator",
        default="cpu",
        choices=["cpu", "gpu"],
        help="Lightning accelerator (one device); gpu is meant for long-horizon runs (--gpt-steps 5000+)",
    )
    p.add_argument("--precision", default="32-true", help="Lightning precision, e.g. bf16-mixed on a GPU")
    p.add_argument("--warmup-steps", type=int, default=5, help="throwaway V-cycle fit per task first (0: none)")
    p.add_argument("--out", default=str(ROOT / "experiments" / "bench" / "results"))
    p.add_argument("--tag", default="")
    p.add_argument(
        "--reanalyse",
        action="store_true",
        help="recompute the summary and plot of <out>/vcycle<tag>.json from its runs (no training)",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="with --reanalyse: build <out>/vcycle<tag>.json from the runs of these benchmark JSONs "
        "(a later file's run replaces an earlier one of the same task, arm and seed; --seeds keeps "
        "only those seeds) with the last file's config; e.g. a committed baseline + a tuning run of "
        "the V-cycle arm alone",
    )
    args = p.parse_args()
    if args.merge and not args.reanalyse:
        p.error("--merge needs --reanalyse")
    if args.reanalyse:
        if args.merge:
            config, runs = merge_reports([Path(f) for f in args.merge], args.seeds)
            Path(args.out).mkdir(parents=True, exist_ok=True)
        else:
            saved = json.loads((Path(args.out) / f"vcycle{args.tag}.json").read_text())
            config, runs = saved["config"], saved["runs"]
        config = argparse.Namespace(**{**config, "out": args.out, "tag": args.tag})
        summary = write_report(runs, config, Path(args.out))
        print(json.dumps({t: {k: v for k, v in s.items() if k != "per_seed"} for t, s in summary.items()}, indent=2))
        return
    for task in args.tasks:  # every curve must end at its arm's last step (the reach search reads the last point)
        lengths = (arm_steps(task, args, False), arm_steps(task, args, True))
        if any(n % args.eval_every for n in lengths):
            p.error(
                f"--eval-every ({args.eval_every}) must divide both arms' step counts for {task} {lengths}, so "
                "that each validation curve ends at its arm's last step"
            )
    args.seeds = args.seeds or [0]
    if args.stage_lr:
        args.lr_schedule = "restart"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    results: list[dict] = []
    summary: dict = {}
    t_start = time.perf_counter()
    for task in args.tasks:
        if args.warmup_steps:  # first-use costs (thread pools, allocator, FLOP measurement) hit neither arm
            run_arm(
                task,
                argparse.Namespace(**{**vars(args), "eval_every": args.warmup_steps, "eval_batches": 1}),
                args.seeds[0],
                True,
                steps=args.warmup_steps,
            )
        for i, seed in enumerate(args.seeds):
            for vcycle in (False, True) if i % 2 == 0 else (True, False):
                if ("vcycle" if vcycle else "baseline") not in args.arms:
                    continue
                results.append(run_arm(task, args, seed, vcycle))
                r = results[-1]
                print(
                    f"{task} seed {seed} {r['arm']:8s}: {r['train_wall_s']:.1f} s train, {r['flops'] / 1e12:.2f} "
                    f"TFLOPs, {r['metric']} {r['final_metric_full_split']:.4f} (full split), curve final "
                    f"{r['curve'][-1]['metric']:.4f} [{time.perf_counter() - t_start:.0f} s elapsed]",
                    flush=True,
                )
                summary = write_report(results, args, out)  # after every arm: a crash keeps the arms done
    print(json.dumps({t: {k: v for k, v in s.items() if k != "per_seed"} for t, s in summary.items()}, indent=2))
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
