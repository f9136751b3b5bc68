"""The catalogue of the bad-input campaign (issue #21): every case :mod:`experiments.robustness.campaign` runs.

Each case gives one input to one public API as a careful user would: a wrong type (a string, a bool where a number is
expected, a float for an int, a list for a scalar, None, a string where a flag is expected), a value out of range
(negative, zero, above 1 for a fraction, NaN, inf, huge), schedule lists in the wrong order or of mismatched sizes,
files made for another dataset, settings that make a technique a no-op, a checkpoint with corrupted technique state,
a loss that becomes NaN at step 2, and overrides of the Hydra app; plus valid edge inputs (numpy numbers, OmegaConf
containers) that must be accepted. When construction passes, the case fits a tiny seeded run with the setting (the
tiny GPT-2 of ``tests/compat/setups.py``: 4 layers of width 32, 24 samples of 16 tokens, batches of 4).

Building the catalogue imports neither torch nor Lightning (the campaign's parent process only reads the case list);
each case imports what it uses when it runs.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
from omegaconf import OmegaConf

from experiments.robustness.campaign import Case, Ctx, Word

NAN, INF = math.nan, math.inf
HUGE = 10**30

#: the tiny run (tests/compat/setups.py): 24 samples of 16 tokens, batch 4 (6 batches per epoch), 4-layer GPT-2
N, SEQ, BATCH, LAYERS = 24, 16, 4, 4

Bad = tuple[str, Any, str]  # (tag, value, kind)


# ------------------------------------------------------------------------------------------------ value sets
def wt(tag: str, value: Any) -> Bad:
    return (tag, value, "wrong_type")


def oor(tag: str, value: Any) -> Bad:
    return (tag, value, "out_of_range")


def int_types(base: int, whole: bool = False) -> list[Bad]:
    """A string, a float, a bool, a list where an int is expected (``whole``: also ``float(base)``)."""
    out = [wt("str", str(base)), wt("float", base + 0.5), wt("bool", True), wt("list", [base])]
    return out + ([wt("float_whole", float(base))] if whole else [])


def real_types(base: float) -> list[Bad]:
    return [wt("str", str(base)), wt("bool", True), wt("list", [base])]


def nonfinite() -> list[Bad]:
    return [oor("nan", NAN), oor("inf", INF)]


def flag_types() -> list[Bad]:
    """What a YAML or CLI user writes for a flag by mistake."""
    return [wt("str_false", "false"), wt("str_true", "true"), wt("int_1", 1), wt("none", None)]


def choice_bad(good: str) -> list[Bad]:
    return [oor("unknown", "bogus"), wt("upper", good.upper()), wt("none", None)]


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


# ---------------------------------------------------------------------------------------------------- builders
CASES: list[Case] = []


def add(
    id: str,
    api: str,
    argument: str,
    value: Any,
    kind: str,
    run: Callable[[Ctx], Any],
    words: Sequence[Word] | None = None,
    shown: str | None = None,
    **kw: Any,
) -> None:
    CASES.append(
        Case(
            id=id,
            api=api,
            argument=argument,
            value=shown if shown is not None else short(value),
            kind=kind,
            run=run,
            words=tuple(words if words is not None else (argument,)),
            valid=kind == "valid",
            **kw,
        )
    )


def _runner(make: Callable[[Any], Any], after: Callable[[Ctx, Any], Any] | None, value: Any) -> Callable[[Ctx], Any]:
    def run(ctx: Ctx) -> None:
        obj = make(value)
        if after is not None:
            after(ctx, obj)

    return run


def sweep(
    api: str,
    prefix: str,
    argument: str,
    make: Callable[[Any], Any],
    after: Callable[[Ctx, Any], Any] | None,
    bad: Iterable[Bad] = (),
    valid: Iterable[tuple[str, Any]] = (),
    words: Sequence[Word] | None = None,
    **kw: Any,
) -> None:
    """One case per bad value (``make(value)`` constructs, ``after(ctx, obj)`` fits a tiny run) and per valid one."""
    for tag, value, kind in bad:
        add(f"{prefix}.{argument}.{tag}", api, argument, value, kind, _runner(make, after, value), words, **kw)
    for tag, value in valid:
        add(f"{prefix}.{argument}.valid_{tag}", api, argument, value, "valid", _runner(make, after, value), words)


# ------------------------------------------------------------------------------------------------- tiny runs
def tiny_model(**kw: Any) -> Any:
    from tests.harness.settings import seeded
    from tests.helpers.tiny import tiny_gpt2

    return seeded(tiny_gpt2, **{"n_layer": LAYERS, **kw})()


def tiny_dm(dataset: Any = None, batch_size: int = BATCH, **kw: Any) -> Any:
    from tests.helpers.tiny import TinyDataModule, TokenBlocks

    return TinyDataModule(
        dataset if dataset is not None else TokenBlocks(n=N, seq_len=SEQ), batch_size=batch_size, **kw
    )


def wrap(dm: Any, callbacks: Sequence[Any]) -> Any:
    """The DataModule wrapped as the Hydra app wraps it (each callback's ``wrap_datamodule``, in order)."""
    for cb in callbacks:
        fn = getattr(cb, "wrap_datamodule", None)
        if callable(fn):
            dm = fn(dm)
    return dm


_POISON: type | None = None


def poison(step: int) -> Any:
    """A callback that fills the module's first parameter (the token embedding) with NaN before the batch of
    ``global_step == step``: from then on the loss is NaN (a diverged run)."""
    global _POISON
    if _POISON is None:
        import torch
        from lightning.pytorch import Callback

        class Poison(Callback):
            def __init__(self, at: int) -> None:
                self.at = at

            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
                if trainer.global_step == self.at:
                    with torch.no_grad():
                        next(pl_module.parameters()).fill_(math.nan)

        _POISON = Poison
    return _POISON(step)


def fit(
    ctx: Ctx,
    callbacks: Sequence[Any],
    *,
    model: Any = None,
    dm: Any = None,
    wrap_dm: bool = True,
    limits: dict[str, Any] | None = None,
    ckpt_path: str | Path | None = None,
    extra: Sequence[Any] = (),
    **trainer_kwargs: Any,
) -> Any:
    """Fit the tiny run with ``callbacks`` (the marker first, then ``extra``): InfoBatch alone plans by epochs (3
    epochs), anything else is bounded by 6 optimizer steps. Returns the Trainer."""
    import lightning.pytorch as pl

    from tests.helpers.harness import make_trainer

    pl.seed_everything(0, workers=True, verbose=False)
    model = model if model is not None else tiny_model()
    dm = dm if dm is not None else tiny_dm()
    if wrap_dm:
        dm = wrap(dm, callbacks)
    names = {type(c).__name__ for c in callbacks}
    if limits is None:
        epochs = "InfoBatchCallback" in names and "Curriculum" not in names
        limits = dict(max_epochs=3, max_steps=-1) if epochs else dict(max_steps=6, max_epochs=-1)
    limits = dict(limits)
    if "Curriculum" in names:
        limits.setdefault("use_distributed_sampler", False)
    ctx.fitting()
    trainer = make_trainer(ctx.folder(), [ctx.marker(), *extra, *callbacks], **{**limits, **trainer_kwargs})
    trainer.fit(model, datamodule=dm, ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return trainer


def fit_one(ctx: Ctx, callback: Any) -> Any:
    return fit(ctx, [callback])


def fit_user(ctx: Ctx, callback: Any) -> Any:
    """Fit a user's own module (``tests/user_modules``: a hand-written ``nn.TransformerEncoder`` classifier on
    ``(tokens, label)`` batches that returns a plain loss) with ``callback``."""
    import torch

    from tests.user_modules.modules import EncoderClassifier, TokenLabels, UserData

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = EncoderClassifier(depth=4)
    return fit(ctx, [callback], model=model, dm=UserData(TokenLabels(n=N)))


# ============================================================================================== InfoBatchCallback
def infobatch(**kw: Any) -> Any:
    from lightning_effi import InfoBatchCallback

    return InfoBatchCallback(**{"seed": 7, **kw})


def _ib(arg: str) -> Callable[[Any], Any]:
    return lambda v: infobatch(**{arg: v})


def infobatch_cases() -> None:
    api, p = "InfoBatchCallback", "infobatch"
    sweep(
        api,
        p,
        "prune_ratio",
        _ib("prune_ratio"),
        fit_one,
        [*real_types(0.5), wt("none", None), oor("neg", -0.1), oor("one", 1.0), oor("above1", 1.5), *nonfinite()],
        [("np_float32", np.float32(0.5)), ("np_float64", np.float64(0.3)), ("int_zero", 0)],
    )
    sweep(
        api,
        p,
        "delta",
        _ib("delta"),
        fit_one,
        [*real_types(0.875), wt("none", None), oor("zero", 0), oor("neg", -0.5), oor("above1", 1.5), *nonfinite()],
        [("np_float64", np.float64(0.875)), ("int_one", 1)],
    )
    sweep(
        api,
        p,
        "num_epochs",
        _ib("num_epochs"),
        fit_one,
        [*int_types(3, whole=True), oor("zero", 0), oor("neg", -1), oor("nan", NAN), oor("above_max_epochs", 5)],
        [("np_int64", np.int64(3))],
    )
    sweep(
        api,
        p,
        "seed",
        _ib("seed"),
        fit_one,
        [*int_types(7), wt("none", None)],
        [("np_int64", np.int64(7))],
    )
    sweep(
        api,
        p,
        "momentum",
        _ib("momentum"),
        fit_one,
        [*real_types(0.9), wt("none", None), oor("zero", 0), oor("neg", -0.1), oor("above1", 1.5), *nonfinite()],
        [("np_float32", np.float32(0.9))],
    )
    sweep(api, p, "strict", _ib("strict"), fit_one, flag_types(), [("np_bool", np.bool_(False))])

    def scalar_loss(outputs: Any, batch: Any) -> Any:  # the batch's mean, not one loss per sample
        import torch.nn.functional as F

        return F.cross_entropy(outputs, batch[1])

    def detached_loss(outputs: Any, batch: Any) -> Any:
        import torch.nn.functional as F

        return F.cross_entropy(outputs, batch[1], reduction="none").detach()

    def short_loss(outputs: Any, batch: Any) -> Any:  # one sample missing
        import torch.nn.functional as F

        return F.cross_entropy(outputs, batch[1], reduction="none")[:-1]

    def nan_loss(outputs: Any, batch: Any) -> Any:
        import torch.nn.functional as F

        return F.cross_entropy(outputs, batch[1], reduction="none") * math.nan

    sweep(
        api,
        p,
        "per_sample_loss",
        _ib("per_sample_loss"),
        fit_user,
        [wt("str", "cross_entropy"), wt("int", 3), wt("list", [scalar_loss])],
    )
    for tag, fn, shown in (
        ("returns_scalar", scalar_loss, "fn -> the batch's mean loss (a scalar)"),
        ("returns_detached", detached_loss, "fn -> float[B] without grad"),
        ("returns_short", short_loss, "fn -> float[B - 1]"),
        ("returns_nan", nan_loss, "fn -> NaN losses"),
    ):
        add(
            f"{p}.per_sample_loss.{tag}",
            api,
            "per_sample_loss",
            None,
            "other",
            _runner(_ib("per_sample_loss"), fit_user, fn),
            words=(("per_sample_loss", "nan", "finite") if tag == "returns_nan" else "per_sample_loss",),
            shown=shown,
            note="a user module (tests/user_modules: EncoderClassifier); what fn returns exists at the first batch "
            "only, so it is checked there, before that batch's backward pass",
            runtime=True,
        )
    # a run the callback cannot plan (Trainer settings, checked at setup)
    add(
        f"{p}.trainer.max_steps",
        api,
        "Trainer(max_steps)",
        "max_steps=4 with max_epochs=3",
        "other",
        lambda ctx: fit(ctx, [infobatch()], limits=dict(max_epochs=3, max_steps=4)),
        words=("max_steps",),
    )
    add(
        f"{p}.trainer.reload_dataloaders",
        api,
        "Trainer(reload_dataloaders_every_n_epochs)",
        "reload_dataloaders_every_n_epochs=2",
        "other",
        lambda ctx: fit(ctx, [infobatch()], reload_dataloaders_every_n_epochs=2),
        words=("reload_dataloaders_every_n_epochs",),
    )
    add(
        f"{p}.trainer.val_check_interval",
        api,
        "Trainer(val_check_interval)",
        "val_check_interval=6 (an int above a pruned epoch's batches)",
        "other",
        lambda ctx: fit(ctx, [infobatch(prune_ratio=0.7, delta=0.9)], val_check_interval=6, limit_val_batches=1),
        words=("val_check_interval",),
    )
    add(
        f"{p}.datamodule.unwrapped",
        api,
        "datamodule",
        "the user's DataModule, not wrapped",
        "other",
        lambda ctx: fit(ctx, [infobatch()], wrap_dm=False),
        words=("InfoBatchDataModule",),
    )


# ============================================================================================ InfoBatchDataModule
def infobatch_dm_cases() -> None:
    api, p = "InfoBatchDataModule", "infobatch_dm"

    def make(dm: Any) -> Any:
        from lightning_effi import InfoBatchDataModule

        return InfoBatchDataModule(dm)

    def after(ctx: Ctx, dm: Any) -> Any:
        return fit(ctx, [infobatch()], dm=dm, wrap_dm=False)

    for tag, value, kind in (wt("none", None), wt("str", "tiny_lm"), wt("dict", {"batch_size": 4})):
        add(f"{p}.datamodule.{tag}", api, "datamodule", value, kind, _runner(make, after, value), ("datamodule",))

    def loader(ctx: Ctx) -> None:
        from torch.utils.data import DataLoader

        from tests.helpers.tiny import TokenBlocks

        after(ctx, make(DataLoader(TokenBlocks(n=N, seq_len=SEQ), batch_size=4)))

    add(f"{p}.datamodule.dataloader", api, "datamodule", "a DataLoader", "wrong_type", loader, ("LightningDataModule",))

    def custom_sampler(ctx: Ctx) -> None:
        import torch
        from torch.utils.data import DataLoader

        from tests.helpers.tiny import TinyDataModule, TokenBlocks

        class Weighted(TinyDataModule):
            def train_dataloader(self) -> Any:
                sampler = torch.utils.data.WeightedRandomSampler([1.0] * N, N)
                return DataLoader(self.train_dataset, batch_size=4, sampler=sampler)

        after(ctx, make(Weighted(TokenBlocks(n=N, seq_len=SEQ), batch_size=4)))

    add(
        f"{p}.datamodule.custom_sampler",
        api,
        "datamodule",
        "a loader with a WeightedRandomSampler",
        "other",
        custom_sampler,
        ("sampler",),
    )

    def iterable(ctx: Ctx) -> None:
        from torch.utils.data import IterableDataset

        from tests.helpers.tiny import TokenBlocks

        class Stream(IterableDataset[dict[str, Any]]):
            def __iter__(self) -> Any:
                yield from (TokenBlocks(n=N, seq_len=SEQ)[i] for i in range(N))

        after(ctx, make(tiny_dm(Stream())))

    add(
        f"{p}.datamodule.iterable_dataset",
        api,
        "datamodule",
        "an IterableDataset",
        "other",
        iterable,
        (("iterable", "map-style"),),
    )

    def without_callback(ctx: Ctx) -> None:
        fit(ctx, [], dm=make(tiny_dm()), wrap_dm=False)

    add(
        f"{p}.callback.missing",
        api,
        "callbacks",
        "no InfoBatchCallback in the Trainer",
        "other",
        without_callback,
        ("InfoBatchCallback",),
    )


# ====================================================================================================== Curriculum
TRUNC: dict[str, Any] = dict(
    difficulty_type="value",
    clustering_type="single_cluster",
    min_difficulty=8,
    max_difficulty=SEQ,
    schedule_type="fixed_linear",
    schedule_config=dict(total_curriculum_step=6, difficulty_step=4),
)


def curriculum(metrics: Any = None, **kw: Any) -> Any:
    from lightning_effi import Curriculum

    return Curriculum(metrics={"seqlen_truncate": TRUNC} if metrics is None else metrics, **{"seed": 3, **kw})


def _trunc(**changes: Any) -> dict[str, Any]:
    m = {**TRUNC, **changes}
    return {k: v for k, v in m.items() if v is not _DROP}


_DROP = object()


def curriculum_cases() -> None:
    api, p = "Curriculum", "curriculum"

    def opt(arg: str) -> Callable[[Any], Any]:
        return lambda v: curriculum(**{arg: v})

    sweep(
        api,
        p,
        "seed",
        opt("seed"),
        fit_one,
        [*int_types(3), oor("neg", -1), oor("huge", 2**40)],
        [("np_int64", np.int64(3))],
    )
    sweep(
        api,
        p,
        "num_epochs",
        opt("num_epochs"),
        fit_one,
        [*int_types(10), oor("zero", 0), oor("neg", -1)],
        [("np_int64", np.int64(10))],
    )
    sweep(api, p, "rounding", opt("rounding"), fit_one, choice_bad("clamped"))
    sweep(api, p, "percentile_rounding", opt("percentile_rounding"), fit_one, choice_bad("deepspeed")[:2])
    sweep(api, p, "dp_split", opt("dp_split"), fit_one, choice_bad("balanced")[:2])
    sweep(api, p, "drop_last", opt("drop_last"), fit_one, flag_types()[:3])
    sweep(api, p, "causal_label_shift", opt("causal_label_shift"), fit_one, flag_types()[:2])
    sweep(api, p, "keep_last_token", opt("keep_last_token"), fit_one, flag_types()[:2])
    sweep(api, p, "strict", opt("strict"), fit_one, flag_types()[:3])
    sweep(
        api,
        p,
        "truncate_keys",
        opt("truncate_keys"),
        fit_one,
        [wt("str", "input_ids"), oor("empty", []), wt("ints", [0]), oor("unknown_key", ["token_ids"])],
        [("listconfig", OmegaConf.create(["input_ids"]))],
    )
    sweep(
        api,
        p,
        "analysis_batch_size",
        opt("analysis_batch_size"),
        fit_one,
        [*int_types(8), oor("zero", 0), oor("neg", -4)],
        [("np_int64", np.int64(8))],
    )
    sweep(
        api,
        p,
        "total_tokens",
        opt("total_tokens"),
        fit_one,
        [*int_types(1000), oor("zero", 0), oor("neg", -5), oor("nan", NAN), oor("inf", INF)],
        [("np_int64", np.int64(1000))],
    )
    # the metrics argument itself
    sweep(
        api,
        p,
        "metrics",
        lambda v: curriculum(metrics=v),
        fit_one,
        [
            wt("str", "seqlen_truncate"),
            wt("list", [TRUNC]),
            wt("metric_str", {"seqlen_truncate": "fixed_linear"}),
            oor("all_null", {"seqlen_truncate": None}),
        ],
        [("dictconfig", OmegaConf.create({"seqlen_truncate": TRUNC}))],
    )
    add(
        f"{p}.metrics.none",
        api,
        "metrics",
        None,
        "other",
        lambda ctx: fit(ctx, [curriculum(metrics={})]),
        words=("metrics",),
    )
    add(
        f"{p}.metrics.options_without_metrics",
        api,
        "metrics",
        "Curriculum(metrics=None, seed=5)",
        "other",
        lambda ctx: fit(ctx, [curriculum(metrics={}, seed=5)]),
        words=("metrics",),
    )

    # one metric's keys (DeepSpeed curriculum_metrics)
    def metric(changes: dict[str, Any]) -> Any:
        return curriculum(metrics={"seqlen_truncate": _trunc(**changes)})

    def key(
        name: str,
        bad: Iterable[Bad],
        valid: Iterable[tuple[str, Any]] = (),
        words: Sequence[Word] | None = None,
        **kw: Any,
    ) -> None:
        sweep(
            api,
            f"{p}.metric",
            name,
            functools.partial(lambda n, v: metric({n: v}), name),
            fit_one,
            bad,
            valid,
            words=words if words is not None else (name,),
            **kw,
        )

    key("difficulty_type", [oor("unknown", "bogus"), oor("percentile_for_seqlen", "percentile"), wt("none", None)])
    key("clustering_type", [oor("unknown", "bogus"), oor("schedule_based_for_seqlen", "schedule_based")])
    key(
        "min_difficulty",
        [*int_types(8), wt("none", None), oor("zero", 0), oor("neg", -1), oor("above_max", 32)],
        [("np_int64", np.int64(8))],
    )
    key(
        "max_difficulty",
        [*int_types(16), wt("none", None), oor("below_min", 4), oor("inf", INF)],
        [("np_int64", np.int64(16))],
    )
    key("schedule_type", [oor("unknown", "linear"), wt("none", None)])
    key("schedule_config", [wt("list", [6, 4]), oor("empty", {}), wt("none", None)])
    sc = "schedule_config"
    for name, base in (("total_curriculum_step", 6), ("difficulty_step", 4)):
        sweep(
            api,
            f"{p}.metric.{sc}",
            name,
            functools.partial(lambda n, v: metric({sc: {**TRUNC[sc], n: v}}), name),
            fit_one,
            [*int_types(base), oor("zero", 0), oor("neg", -base)],
            [("np_int64", np.int64(base))],
        )
    add(
        f"{p}.metric.{sc}.unknown_key",
        api,
        sc,
        "{total_step: 6, difficulty_step: 4}",
        "other",
        _runner(lambda v: metric({sc: v}), fit_one, {"total_step": 6, "difficulty_step": 4}),
        words=("total_step",),
    )
    add(
        f"{p}.metric.{sc}.difficulty_step_above_max",
        api,
        "difficulty_step",
        64,
        "out_of_range",
        _runner(lambda v: metric({sc: {"total_curriculum_step": 6, "difficulty_step": v}}), fit_one, 64),
        words=("difficulty_step",),
        warn_ok=True,
        note="every difficulty rounds down to a multiple of 64",
    )
    add(
        f"{p}.metric.unknown_key",
        api,
        "min_dificulty",
        "min_dificulty=8 (a typo)",
        "other",
        _runner(
            lambda v: curriculum(
                metrics={
                    "seqlen_truncate": {**{k: x for k, x in TRUNC.items() if k != "min_difficulty"}, "min_dificulty": v}
                }
            ),
            fit_one,
            8,
        ),
        words=("min_dificulty",),
    )
    add(
        f"{p}.metric.custom_schedule.not_callable",
        api,
        "custom_schedule",
        "'linear'",
        "wrong_type",
        _runner(lambda v: metric({"schedule_type": "custom", sc: {}, "custom_schedule": v}), fit_one, "linear"),
        words=("custom",),
    )
    add(
        f"{p}.metric.custom_schedule.out_of_range",
        api,
        "custom_schedule",
        "lambda step: 1000",
        "out_of_range",
        _runner(
            lambda v: metric({"schedule_type": "custom", sc: {}, "custom_schedule": v}), fit_one, lambda step: 1000
        ),
        words=("custom",),
    )
    add(
        f"{p}.metric.custom_schedule.with_fixed_linear",
        api,
        "custom_schedule",
        "fn with schedule_type fixed_linear",
        "other",
        _runner(lambda v: metric({"custom_schedule": v}), fit_one, lambda step: 8),
        words=("custom_schedule",),
    )
    # fixed_discrete lists: wrong order, mismatched sizes
    for tag, diff, steps, kind in (
        ("max_step_descending", [8, 12, 16], [4, 2], "order"),
        ("max_step_repeated", [8, 12, 16], [2, 2], "order"),
        ("difficulty_descending", [16, 12, 8], [2, 4], "order"),
        ("sizes_equal", [8, 16], [2, 4], "size"),
        ("sizes_short", [8, 12, 16], [2], "size"),
        ("difficulty_above_max", [8, 32], [2], "out_of_range"),
        ("max_step_negative", [8, 16], [-1], "out_of_range"),
        ("difficulty_str", ["8", "16"], [2], "wrong_type"),
    ):
        add(
            f"{p}.metric.fixed_discrete.{tag}",
            api,
            "schedule_config",
            f"difficulty={diff}, max_step={steps}",
            kind,
            _runner(
                lambda v: metric({"schedule_type": "fixed_discrete", sc: v}),
                fit_one,
                {"difficulty": diff, "max_step": steps},
            ),
            words=(("difficulty", "max_step"),),
        )
    # no-op settings
    add(
        f"{p}.metric.max_difficulty.far_above_data",
        api,
        "max_difficulty",
        "1024 (the data has 16 tokens)",
        "noop",
        _runner(
            lambda v: metric({"max_difficulty": v, sc: {"total_curriculum_step": 6, "difficulty_step": 4}}),
            fit_one,
            1024,
        ),
        words=("max_difficulty",),
        warn_ok=True,
        note="the schedule spends its steps between 16 and 1024 tokens: no batch is ever truncated after step 0",
    )
    add(
        f"{p}.metric.min_difficulty.at_data_length",
        api,
        "min_difficulty",
        "16 (= the data's length)",
        "noop",
        _runner(lambda v: metric({"min_difficulty": v, "max_difficulty": v}), fit_one, SEQ),
        words=("min_difficulty",),
        warn_ok=True,
        note="nothing is ever truncated",
    )

    def value_below_longest(ctx: Ctx) -> None:
        from lightning_effi.reference.data.base import PaddingCollate
        from tests.helpers.tiny import Sentences, TinyDataModule, tiny_bert_cls

        m = dict(
            difficulty_type="value",
            clustering_type="schedule_based",
            analysis="seqlen",
            min_difficulty=4,
            max_difficulty=8,
            schedule_type="fixed_linear",
            schedule_config=dict(total_curriculum_step=3, difficulty_step=1),
        )
        cb = curriculum(metrics={"seqlen": m})
        dm = TinyDataModule(Sentences(n=N), collate_fn=PaddingCollate(pad_token_id=0), batch_size=4)
        fit(ctx, [cb], model=tiny_bert_cls(), dm=dm)

    add(
        f"{p}.metric.value.max_below_longest",
        api,
        "max_difficulty",
        "8 (samples hold up to 16 tokens)",
        "noop",
        value_below_longest,
        words=("max_difficulty",),
        warn_ok=True,
        note="samples longer than max_difficulty are never eligible: the run silently trains on a subset",
    )

    def percentile_deepspeed_rounding(ctx: Ctx) -> None:
        m = dict(
            difficulty_type="percentile",
            clustering_type="schedule_based",
            analysis="seqlen",
            min_difficulty=10,
            max_difficulty=100,
            schedule_type="fixed_linear",
            schedule_config=dict(total_curriculum_step=6, difficulty_step=10),
        )
        fit(ctx, [curriculum(metrics={"len": m})])

    add(
        f"{p}.metric.percentile.small_dataset",
        api,
        "percentile_rounding",
        "deepspeed rounding, 24 samples, min_difficulty=10",
        "noop",
        percentile_deepspeed_rounding,
        words=("percentile",),
        warn_ok=True,
    )
    add(
        f"{p}.datamodule.unwrapped",
        api,
        "datamodule",
        "the user's DataModule, not wrapped",
        "other",
        lambda ctx: fit(ctx, [curriculum()], wrap_dm=False),
        words=("CurriculumDataModule",),
    )


# =========================================================================================== CurriculumDataModule
def curriculum_dm_cases() -> None:
    api, p = "CurriculumDataModule", "curriculum_dm"

    def make(**kw: Any) -> Any:
        from lightning_effi import CurriculumDataModule

        return CurriculumDataModule(tiny_dm(), **kw)

    def after(ctx: Ctx, dm: Any) -> Any:
        from lightning_effi import Curriculum

        return fit(ctx, [Curriculum()], dm=dm, wrap_dm=False)

    def with_metrics(arg: str) -> Callable[[Any], Any]:
        return lambda v: make(metrics={"seqlen_truncate": TRUNC}, **{arg: v})

    sweep(
        api,
        p,
        "datamodule",
        lambda v: __import__("lightning_effi").CurriculumDataModule(v),
        after,
        [wt("none", None), wt("str", "tiny_lm")],
        words=("datamodule",),
    )
    sweep(
        api,
        p,
        "seed",
        with_metrics("seed"),
        after,
        [wt("str", "3"), wt("float", 3.5), oor("neg", -1)],
        [("np_int64", np.int64(3))],
    )
    sweep(api, p, "drop_last", with_metrics("drop_last"), after, flag_types()[:2])
    sweep(api, p, "rounding", with_metrics("rounding"), after, [oor("unknown", "bogus")])
    sweep(api, p, "num_epochs", with_metrics("num_epochs"), after, [oor("zero", 0), wt("str", "10")])
    add(
        f"{p}.options_without_metrics",
        api,
        "seed",
        "CurriculumDataModule(dm, seed=3)",
        "other",
        _runner(lambda v: make(seed=v), after, 3),
        words=("metrics",),
    )

    def twice(ctx: Ctx) -> None:
        dm = make(metrics={"seqlen_truncate": TRUNC})
        fit(ctx, [curriculum()], dm=dm, wrap_dm=False)

    add(
        f"{p}.metrics.given_twice",
        api,
        "metrics",
        "metrics given to the DataModule and to Curriculum",
        "other",
        twice,
        words=("twice",),
    )
    add(
        f"{p}.metrics.dictconfig",
        api,
        "metrics",
        "DictConfig",
        "valid",
        _runner(lambda v: make(metrics=v), after, OmegaConf.create({"seqlen_truncate": TRUNC})),
    )


# ========================================================================= DeepSpeed config (parse_deepspeed_config)
def ds_config(enabled: Any = True, de: Any = True, dsamp: Any = True, metrics: Any = None, **cl: Any) -> dict[str, Any]:
    return {
        "train_batch_size": 4,
        "data_efficiency": {
            "enabled": de,
            "seed": 1234,
            "data_sampling": {
                "enabled": dsamp,
                "num_epochs": 1000,
                "curriculum_learning": {
                    "enabled": enabled,
                    "data_cluster_path": "/tmp/data_clusters",
                    "curriculum_metrics": {"seqlen_truncate": TRUNC} if metrics is None else metrics,
                    **cl,
                },
            },
        },
    }


def deepspeed_cases() -> None:
    api, p = "parse_deepspeed_config", "deepspeed"

    def parse(cfg: Any, **overrides: Any) -> Any:
        from lightning_effi import parse_deepspeed_config

        return parse_deepspeed_config(cfg, **overrides)

    def parse_and_fit(ctx: Ctx, cfg: Any) -> None:
        """A config that parses is given to the Curriculum, as a user of a DeepSpeed config would."""
        if cfg is None:
            return
        from lightning_effi import Curriculum

        fit(ctx, [Curriculum(metrics=dict(cfg.metrics), seed=cfg.seed, num_epochs=cfg.num_epochs)])

    def case(tag: str, cfg: Any, kind: str, words: Sequence[Word], shown: str, **kw: Any) -> None:
        add(f"{p}.{tag}", api, shown.split("=")[0], cfg, kind, _runner(parse, parse_and_fit, cfg), words, shown, **kw)

    for where, flag in (
        ("curriculum_learning.enabled", "enabled"),
        ("data_efficiency.enabled", "de"),
        ("data_sampling.enabled", "dsamp"),
    ):
        for tag, v in (("str_false", "false"), ("str_true", "true"), ("none", None)):
            case(f"{where}.{tag}", ds_config(**{flag: v}), "wrong_type", ("enabled",), f"{where}={v!r}")
    case(
        "num_epochs.str",
        {
            **ds_config(),
            "data_efficiency": {
                **ds_config()["data_efficiency"],
                "data_sampling": {**ds_config()["data_efficiency"]["data_sampling"], "num_epochs": "1000"},
            },
        },
        "wrong_type",
        ("num_epochs",),
        "data_sampling.num_epochs='1000'",
    )
    case(
        "seed.str",
        {"data_efficiency": {**ds_config()["data_efficiency"], "seed": "1234"}},
        "wrong_type",
        ("seed",),
        "data_efficiency.seed='1234'",
    )
    case(
        "seed.float",
        {"data_efficiency": {**ds_config()["data_efficiency"], "seed": 12.5}},
        "wrong_type",
        ("seed",),
        "data_efficiency.seed=12.5",
    )
    case(
        "legacy_block",
        {
            "curriculum_learning": {
                "enabled": True,
                "curriculum_type": "seqlen",
                "min_difficulty": 8,
                "max_difficulty": 16,
                "schedule_type": "fixed_linear",
            }
        },
        "other",
        ("curriculum_learning",),
        "curriculum_learning={...} (top level, legacy)",
    )
    case(
        "misplaced_data_sampling",
        {**ds_config(), "data_sampling": {"enabled": True}},
        "other",
        ("data_sampling",),
        "data_sampling={...} (top level)",
    )
    case(
        "unknown_key",
        ds_config(curriculum_metric={"x": 1}),
        "other",
        ("curriculum_metric",),
        "curriculum_learning.curriculum_metric (a typo)",
    )
    case(
        "metrics.list",
        ds_config(metrics=[TRUNC]),
        "wrong_type",
        ("curriculum_metrics",),
        "curriculum_metrics=[...] (a list)",
    )
    cfg = ds_config()
    del cfg["data_efficiency"]["data_sampling"]["curriculum_learning"]["data_cluster_path"]
    case("missing_data_cluster_path", cfg, "other", ("data_cluster_path",), "no data_cluster_path")
    case(
        "metric.min_difficulty.str",
        ds_config(metrics={"seqlen_truncate": _trunc(min_difficulty="8")}),
        "wrong_type",
        ("min_difficulty",),
        "curriculum_metrics.seqlen_truncate.min_difficulty='8'",
    )
    case(
        "metric.lightning_key",
        ds_config(metrics={"seqlen_truncate": {**TRUNC, "analysis": "seqlen"}}),
        "other",
        ("analysis",),
        "curriculum_metrics.seqlen_truncate.analysis (not a DeepSpeed key)",
    )
    routing = ds_config()
    routing["data_efficiency"]["data_routing"] = {"enabled": True, "random_ltd": {"enabled": True}}
    case(
        "data_routing.random_ltd",
        routing,
        "noop",
        (("random_ltd", "data_routing"),),
        "data_routing.random_ltd.enabled=true",
        warn_ok=True,
        note="the config asks for random-LTD too; parsing the curriculum alone drops it",
    )
    case("not_a_dict", "ds_config.json", "wrong_type", ("dict",), "'ds_config.json' (a path)")
    case("dictconfig", OmegaConf.create(ds_config()), "valid", (), "DictConfig")
    add(
        f"{p}.overrides.clash",
        api,
        "overrides",
        "seed=1",
        "other",
        lambda ctx: parse(ds_config(), seed=1),
        words=("seed",),
    )
    add(
        f"{p}.overrides.unknown",
        api,
        "overrides",
        "roundng='clamped' (a typo)",
        "other",
        lambda ctx: parse(ds_config(), roundng="clamped"),
        words=("roundng",),
    )
    add(
        f"{p}.overrides.rounding_bad",
        api,
        "overrides",
        "rounding='bogus'",
        "out_of_range",
        lambda ctx: parse(ds_config(), rounding="bogus"),
        words=("rounding",),
    )


# ==================================================================================================== RandomLTDCallback
def random_ltd(**kw: Any) -> Any:
    from lightning_effi import RandomLTDCallback

    return RandomLTDCallback(**{"min_value": 4, "max_value": SEQ, "seq_per_step": 4, "seed": 7, **kw})


def random_ltd_cases() -> None:
    api, p = "RandomLTDCallback", "random_ltd"

    def arg(name: str, **base: Any) -> Callable[[Any], Any]:
        return lambda v: random_ltd(**{**base, name: v})

    sweep(
        api,
        p,
        "min_value",
        arg("min_value"),
        fit_one,
        [*int_types(4), wt("none", None), oor("zero", 0), oor("neg", -4), oor("huge", HUGE)],
        [("np_int64", np.int64(4))],
    )
    sweep(
        api,
        p,
        "max_value",
        arg("max_value"),
        fit_one,
        [*int_types(16), oor("zero", 0), oor("below_min", 2), oor("above_model", 1024)],
        [("np_int64", np.int64(16)), ("none", None)],
    )
    sweep(
        api,
        p,
        "require_steps",
        arg("require_steps"),
        fit_one,
        [
            oor("zero", 0),
            oor("neg", -5),
            wt("float", 2.5),
            wt("bool", True),
            oor("text", "abc"),
            oor("fraction_above1", "1.5dur"),
            oor("tokens", "100tok"),
            oor("neg_str", "-1st"),
            wt("list", [4]),
        ],
        [("np_int64", np.int64(4)), ("fraction", "0.5dur"), ("epochs", "1ep")],
    )
    sweep(
        api,
        p,
        "require_fraction",
        arg("require_fraction"),
        fit_one,
        [oor("zero", 0), oor("above1", 1.5), wt("str", "0.5"), oor("nan", NAN)],
    )
    add(
        f"{p}.require_fraction.with_require_steps",
        api,
        "require_fraction",
        "require_steps=4, require_fraction=0.5",
        "other",
        lambda ctx: fit_one(ctx, random_ltd(require_steps=4, require_fraction=0.5)),
        words=("require_steps", "require_fraction"),
    )
    sweep(
        api,
        p,
        "seq_per_step",
        arg("seq_per_step"),
        fit_one,
        [*int_types(4), oor("zero", 0), oor("neg", -4)],
        [("np_int64", np.int64(4))],
    )
    add(
        f"{p}.seq_per_step.above_max_value",
        api,
        "seq_per_step",
        "64 (max_value=16)",
        "noop",
        _runner(arg("seq_per_step"), fit_one, 64),
        words=("seq_per_step",),
        warn_ok=True,
        note="every reserved length rounds down to a multiple of 64",
    )
    sweep(
        api,
        p,
        "layer_ids",
        arg("layer_ids"),
        fit_one,
        [
            wt("str", "1,2"),
            wt("int", 1),
            oor("empty", []),
            ("descending", [2, 1], "order"),
            ("repeated", [1, 1], "order"),
            oor("negative", [-1]),
            oor("beyond_model", [1, 9]),
            wt("floats", [1.0, 2.0]),
            wt("strs", ["1", "2"]),
        ],
        [("listconfig", OmegaConf.create([1, 2])), ("np_ints", [np.int64(1), np.int64(2)]), ("tuple", (1, 2))],
    )
    sweep(
        api,
        p,
        "adapter",
        arg("adapter"),
        fit_one,
        [oor("unknown", "bogus"), wt("int", 3), oor("other_family", "hf_bert"), oor("vit", "timm_vit")],
    )
    sweep(api, p, "rounding", arg("rounding"), fit_one, choice_bad("clamped"))
    sweep(
        api,
        p,
        "keep_prefix_tokens",
        arg("keep_prefix_tokens"),
        fit_one,
        [oor("neg", -1), wt("str", "1"), wt("float", 1.5), oor("above_min_value", 8), oor("unknown_word", "all")],
        [("np_int64", np.int64(1))],
    )
    sweep(api, p, "accounting", arg("accounting"), fit_one, choice_bad("actual")[:2])
    sweep(api, p, "seed", arg("seed"), fit_one, [*int_types(7), wt("none", None)], [("np_int64", np.int64(7))])
    sweep(api, p, "strict", arg("strict"), fit_one, flag_types())
    sweep(
        api,
        p,
        "model_attr",
        arg("model_attr"),
        fit_one,
        [oor("empty", ""), wt("int", 3), oor("missing", "student"), oor("not_a_transformer", "model.lm_head")],
        [("path", "model")],
    )
    # no-op settings: min_value at or above the sequence the layers see
    add(
        f"{p}.min_value.equals_seq_len",
        api,
        "min_value",
        "16 (= the sequence length), max_value=None",
        "noop",
        _runner(lambda v: random_ltd(min_value=v, max_value=None), fit_one, SEQ),
        words=("min_value",),
        warn_ok=True,
        note="r >= S from step 0: no token is ever dropped",
    )
    add(
        f"{p}.min_value.above_seq_len",
        api,
        "min_value",
        "32 (the data has 16 tokens), max_value=None",
        "noop",
        _runner(lambda v: random_ltd(min_value=v, max_value=None), fit_one, 32),
        words=("min_value",),
        warn_ok=True,
    )
    add(
        f"{p}.max_value.above_seq_len",
        api,
        "max_value",
        "64 (the data has 16 tokens)",
        "noop",
        _runner(lambda v: random_ltd(min_value=16, max_value=v), fit_one, 64),
        words=(("max_value", "min_value"),),
        warn_ok=True,
    )
    add(
        f"{p}.model.two_layers",
        api,
        "layer_ids",
        "default on a 2-layer model",
        "other",
        lambda ctx: fit(ctx, [random_ltd()], model=tiny_model(n_layer=2)),
        words=("layer",),
    )


# ====================================================================================================== VCycleCallback
VC_BASE: dict[str, Any] = dict(e_a="0.2dur", e_small="0.4dur", alpha_original=0.3, lr_multiplier={2: 2.0})


def vcycle(**kw: Any) -> Any:
    from lightning_effi import VCycleCallback

    return VCycleCallback(**{**VC_BASE, **kw})


def fit_vc(ctx: Ctx, cb: Any) -> Any:
    return fit(ctx, [cb], limits=dict(max_steps=10, max_epochs=-1))


def fit_vc3(ctx: Ctx, cb: Any) -> Any:
    """A model that three levels can halve: 4 heads of width 8 (levels: 32 / 16 / 8 wide, 4 / 2 / 1 layers)."""
    return fit(ctx, [cb], model=tiny_model(n_head=4), limits=dict(max_steps=10, max_epochs=-1))


def vcycle_cases() -> None:
    api, p = "VCycleCallback", "vcycle"

    def arg(name: str) -> Callable[[Any], Any]:
        return lambda v: vcycle(**{name: v})

    sweep(
        api,
        p,
        "levels",
        arg("levels"),
        fit_vc,
        [*int_types(2), oor("one", 1), oor("zero", 0), oor("three_without_up_leg", 3)],
        [("np_int64", np.int64(2))],
    )
    add(
        f"{p}.levels.too_deep_for_model",
        api,
        "levels",
        "4 (a 4-layer, 32-wide model)",
        "other",
        lambda ctx: fit_vc(ctx, vcycle(levels=4, e_a=1, e_small=1, up_leg=1)),
        words=(("levels", "level"),),
    )
    for name in ("e_a", "e_small"):
        sweep(
            api,
            p,
            name,
            arg(name),
            fit_vc,
            [
                oor("zero", 0),
                oor("neg", -1),
                wt("float", 2.5),
                wt("bool", True),
                oor("text", "abc"),
                oor("half_epoch", "2.5ep"),
                oor("fraction_above1", "1.5dur"),
                oor("tokens", "1000tok"),
                wt("none", None),
                oor("beyond_run", 100),
            ],
            [("np_int64", np.int64(2)), ("steps_str", "2st")],
        )
    sweep(
        api,
        p,
        "up_leg",
        lambda v: vcycle(levels=3, e_a=1, e_small=1, up_leg=v),
        fit_vc3,
        [oor("wrong_length", [1, 1]), wt("str_list", ["a"]), oor("zero", 0)],
        [("listconfig", OmegaConf.create([1]))],
    )
    add(
        f"{p}.up_leg.levels2",
        api,
        "up_leg",
        "1 with levels=2",
        "other",
        lambda ctx: fit_vc(ctx, vcycle(up_leg=1)),
        words=("up_leg",),
    )
    sweep(
        api,
        p,
        "alpha_original",
        arg("alpha_original"),
        fit_vc,
        [*real_types(0.5), oor("neg", -0.1), oor("above1", 1.5), *nonfinite()],
        [("np_float32", np.float32(0.25))],
    )
    sweep(
        api,
        p,
        "lr_multiplier",
        arg("lr_multiplier"),
        fit_vc,
        [
            wt("scalar", 2.0),
            oor("level_absent", {3: 2.0}),
            oor("negative", {2: -1.0}),
            oor("nan", {2: NAN}),
            wt("str_factor", {2: "2"}),
            oor("zero", {2: 0.0}),
            wt("list", [2.0]),
        ],
        [("dictconfig", OmegaConf.create({2: 2.0})), ("str_key", {"2": 2.0}), ("np_factor", {2: np.float32(2.0)})],
    )
    sweep(
        api,
        p,
        "width_scheme",
        arg("width_scheme"),
        fit_vc,
        [oor("unknown", "quarter"), oor("not_partition", [[0], [0]]), wt("int", 2)],
        [("none", None)],
    )
    sweep(
        api,
        p,
        "depth_scheme",
        arg("depth_scheme"),
        fit_vc,
        [oor("unknown", "pairs"), oor("overlapping", [[0, 1], [1, 2]]), oor("missing_layer", [[0, 1], [2]])],
        [("half", "half"), ("explicit", [[0, 1], [2, 3]])],
    )
    sweep(api, p, "embedding_convention", arg("embedding_convention"), fit_vc, choice_bad("official")[:2])
    sweep(api, p, "lr_schedule", arg("lr_schedule"), fit_vc, choice_bad("continue")[:2])
    sweep(
        api,
        p,
        "model_attr",
        arg("model_attr"),
        fit_vc,
        [oor("empty", ""), wt("int", 3), oor("missing", "student"), oor("dotted", "model.transformer")],
        [("model", "model")],
    )
    sweep(api, p, "adapter", arg("adapter"), fit_vc, [oor("unknown", "bogus"), wt("int", 3), oor("other", "timm_vit")])
    sweep(api, p, "strict", arg("strict"), fit_vc, flag_types()[:3])
    sweep(
        api,
        p,
        "baseline_steps",
        arg("baseline_steps"),
        fit_vc,
        [*int_types(10), oor("zero", 0), oor("neg", -1)],
        [("np_int64", np.int64(10))],
    )
    add(
        f"{p}.kwargs.unknown",
        api,
        "**deprecated",
        "e_a_step=2 (a typo)",
        "other",
        lambda ctx: fit_vc(ctx, vcycle(e_a_step=2)),
        words=("e_a_step",),
    )
    add(
        f"{p}.kwargs.two_spellings",
        api,
        "e_a",
        "e_a=2 and e_a_steps=2",
        "other",
        lambda ctx: fit_vc(ctx, vcycle(e_a=2, e_a_steps=2)),
        words=("e_a",),
    )

    # no-op settings
    def resumed_after_switches(ctx: Ctx) -> None:
        with ctx.preparing():
            trainer = fit(ctx, [], limits=dict(max_steps=8, max_epochs=-1))
            path = ctx.tmp / "baseline.ckpt"
            trainer.save_checkpoint(path)
            ctx.stage = "construct"
        cb = vcycle(e_a=2, e_small=3)
        fit(ctx, [cb], limits=dict(max_steps=12, max_epochs=-1), ckpt_path=path)

    add(
        f"{p}.resume.after_switches",
        api,
        "e_a / e_small",
        "added on resume at step 8; its switches end at step 5",
        "noop",
        resumed_after_switches,
        words=("VCycle", ("stage", "switch", "e_a")),
        warn_ok=True,
        note="the V-cycle never runs: its stages ended before the checkpoint's step",
    )

    def cached_optimizer(ctx: Ctx) -> None:
        fit(ctx, [vcycle(e_a=2, e_small=3)], model=cached_optimizer_model(), limits=dict(max_steps=8, max_epochs=-1))

    add(
        f"{p}.configure_optimizers.cached",
        api,
        "configure_optimizers",
        "returns the optimizer built at the first call",
        "noop",
        cached_optimizer,
        words=("configure_optimizers",),
        note="after a level change the optimizer holds the replaced network's parameters: nothing trains; the "
        "optimizer the V-cycle gets back exists at its first level change only, so it is checked there",
        runtime=True,
    )


def cached_optimizer_model() -> Any:
    from lightning_effi.tasks import GPT2CausalLM
    from tests.helpers.tiny import TINY_GPT2, sgd

    class CachedOptimizer(GPT2CausalLM):
        def configure_optimizers(self) -> Any:
            if getattr(self, "_cached_optimizer", None) is None:
                self._cached_optimizer = super().configure_optimizers()
            return self._cached_optimizer

    import torch

    kwargs: dict[str, Any] = {**TINY_GPT2, "n_layer": LAYERS, "optimizer": sgd}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return CachedOptimizer(**kwargs)


# ================================================================================================ EfficiencyMonitor
def monitor_cases() -> None:
    api, p = "EfficiencyMonitor", "monitor"

    def arg(name: str) -> Callable[[Any], Any]:
        def make(v: Any) -> Any:
            from lightning_effi import EfficiencyMonitor

            return EfficiencyMonitor(**{name: v})

        return make

    sweep(
        api,
        p,
        "log_every_n_steps",
        arg("log_every_n_steps"),
        fit_one,
        [*int_types(5), oor("zero", 0), oor("neg", -1)],
        [("np_int64", np.int64(5))],
    )
    sweep(api, p, "print_summary", arg("print_summary"), fit_one, flag_types()[:3], [("np_bool", np.bool_(False))])


# ====================================================================================================== GenericAdapter
def generic(**kw: Any) -> Any:
    from lightning_effi import GenericAdapter

    return GenericAdapter(**{"layers": "net.encoder.layers", **kw})


def fit_adapter(ctx: Ctx, adapter: Any) -> Any:
    """Random-LTD through ``adapter`` on the user's ``nn.TransformerEncoder`` classifier (4 layers of width 32,
    16-token sequences)."""
    return fit_user(ctx, random_ltd(adapter=adapter))


def adapter_cases() -> None:
    api, p = "GenericAdapter", "generic_adapter"

    def arg(name: str) -> Callable[[Any], Any]:
        return lambda v: generic(**{name: v})

    sweep(
        api,
        p,
        "layers",
        arg("layers"),
        fit_adapter,
        [
            wt("none", None),
            oor("empty", ""),
            wt("int", 3),
            oor("missing", "net.encoder.blocks"),
            oor("not_a_list", "net.encoder"),
        ],
    )
    # the user module (tests/user_modules) is 32 wide with a 64-wide feed-forward, 16-token sequences: the valid
    # values are the model's own sizes (a declared size the layers contradict is refused)
    for name, size in (("max_sequence_length", 32), ("hidden_size", 32), ("intermediate_size", 64)):
        sweep(
            api,
            p,
            name,
            arg(name),
            fit_adapter,
            [oor("zero", 0), oor("neg", -1), wt("str", str(size)), wt("float", size + 0.5)],
            [("np_int64", np.int64(size))],
        )
    add(
        f"{p}.max_sequence_length.below_data",
        api,
        "max_sequence_length",
        "8 (the data has 16 tokens)",
        "other",
        _runner(arg("max_sequence_length"), fit_adapter, 8),
        words=("max_sequence_length",),
    )
    add(
        f"{p}.hidden_size.wrong",
        api,
        "hidden_size",
        "64 (the model is 32 wide)",
        "other",
        _runner(arg("hidden_size"), fit_adapter, 64),
        words=("hidden_size",),
        warn_ok=True,
    )
    sweep(
        api,
        p,
        "seq_args",
        arg("seq_args"),
        fit_adapter,
        [
            wt("axis_str", {"attention_mask": ["x"]}),
            oor("empty_axes", {"attention_mask": []}),
            wt("list", ["attention_mask"]),
            wt("str", "attention_mask"),
        ],
        [("dictconfig", OmegaConf.create({"src_mask": [-2, -1]}))],
    )
    sweep(
        api,
        p,
        "passthrough",
        arg("passthrough"),
        fit_adapter,
        [wt("str", "is_causal"), wt("int", 3)],
        [("listconfig", OmegaConf.create(["is_causal"]))],
    )
    sweep(api, p, "must_be_none", arg("must_be_none"), fit_adapter, [wt("str", "memory"), wt("int", 3)])
    sweep(
        api,
        p,
        "hidden_state_order",
        arg("hidden_state_order"),
        fit_adapter,
        [oor("unknown", "bsh"), oor("wrong_for_layers", "seq_batch")],
    )
    sweep(
        api,
        p,
        "num_prefix_tokens",
        arg("num_prefix_tokens"),
        fit_adapter,
        [oor("neg", -1), wt("str", "1"), wt("float", 1.5), oor("above_min_value", 8)],
        [("np_int64", np.int64(1))],
    )
    sweep(
        api,
        p,
        "masks",
        arg("masks"),
        fit_adapter,
        [oor("unknown_kind", {"src_mask": "causal"}), wt("list", ["self"])],
        [("dictconfig", OmegaConf.create({"src_key_padding_mask": "key_padding"}))],
    )
    sweep(api, p, "root", arg("root"), None, [wt("str", "model")])

    # the registered adapters given a model of another family
    def registered(cls_name: str) -> Callable[[Ctx], Any]:
        def run(ctx: Ctx) -> None:
            import lightning_effi.adapters as adapters

            adapter = getattr(adapters, cls_name)(tiny_model().model)
            fit_one(ctx, random_ltd(adapter=adapter))

        return run

    for cls_name, registered_name in (
        ("HFBertAdapter", "hf_bert"),
        ("TimmViTAdapter", "timm_vit"),
        ("TorchTransformerAdapter", "torch_transformer"),
    ):
        add(
            f"adapters.{cls_name}.gpt2_model",
            cls_name,
            "root",
            "a GPT-2 model",
            "other",
            registered(cls_name),
            words=((cls_name, registered_name),),  # the message names the adapter that cannot take the model
        )


# ======================================================================================================= DataAnalyzer
def first_token(batch: Any) -> Any:
    return batch["input_ids"][:, 0].long()


def analyzer(**kw: Any) -> Any:
    from lightning_effi import DataAnalyzer
    from tests.helpers.tiny import TokenBlocks

    base = dict(
        metric_names=["first"],
        metric_functions=[first_token],
        metric_types=["single_value_per_sample"],
        metric_dtypes=[np.int64],
        batch_size=8,
        progress=False,
    )
    dataset = kw.pop("dataset", _DROP)
    return DataAnalyzer(TokenBlocks(n=N, seq_len=SEQ) if dataset is _DROP else dataset, **{**base, **kw})


def analyzer_cases() -> None:
    api, p = "DataAnalyzer", "analyzer"

    def arg(name: str) -> Callable[[Any], Any]:
        return lambda v: analyzer(**{name: v})

    def run_it(ctx: Ctx, a: Any) -> None:
        a.save_path = str(ctx.folder())
        a.run_map_reduce()

    sweep(api, p, "dataset", lambda v: analyzer(dataset=v), run_it, [wt("none", None), oor("empty", []), wt("int", 5)])
    sweep(
        api,
        p,
        "num_workers",
        arg("num_workers"),
        run_it,
        [oor("zero", 0), wt("str", "1"), wt("float", 1.5)],
        [("np_int64", np.int64(1))],
    )
    sweep(api, p, "worker_id", arg("worker_id"), run_it, [oor("neg", -1), oor("equals_num_workers", 1), wt("str", "0")])
    sweep(api, p, "num_threads", arg("num_threads"), run_it, [oor("zero", 0), wt("str", "2")])
    sweep(api, p, "num_threads_reduce", arg("num_threads_reduce"), run_it, [oor("zero", 0)])
    sweep(
        api,
        p,
        "specific_threads",
        arg("specific_threads"),
        run_it,
        [oor("out_of_range", [5]), oor("repeated", [0, 0]), wt("str", "0"), wt("float", [0.5])],
    )
    sweep(api, p, "batch_size", arg("batch_size"), run_it, [oor("zero", 0), wt("str", "8")])
    sweep(
        api,
        p,
        "metric_names",
        arg("metric_names"),
        run_it,
        [wt("str", "first"), oor("separator", ["a/b"]), oor("empty", []), oor("dotdot", [".."])],
        [("listconfig", OmegaConf.create(["first"]))],
    )
    sweep(
        api,
        p,
        "metric_functions",
        arg("metric_functions"),
        run_it,
        [oor("unknown_name", ["bogus"]), wt("int", [3]), wt("fn_not_list", first_token)],
    )
    sweep(
        api,
        p,
        "metric_types",
        arg("metric_types"),
        run_it,
        [oor("unknown", ["bogus"]), wt("str", "single_value_per_sample")],
    )
    sweep(
        api,
        p,
        "metric_dtypes",
        arg("metric_dtypes"),
        run_it,
        [wt("float", [np.float32]), wt("str_float", ["float64"]), oor("bogus", ["int65"])],
        [("str_int", ["int64"])],
    )
    sweep(api, p, "save_path", arg("save_path"), lambda ctx, a: a.run_map_reduce(), [wt("none", None), wt("int", 3)])
    sweep(
        api,
        p,
        "sample_indices",
        arg("sample_indices"),
        run_it,
        [
            ("short", list(range(N - 1)), "size"),
            oor("repeated", [0] * N),
            wt("floats", [float(i) for i in range(N)]),
            oor("out_of_range", list(range(1, N + 1))),
        ],
        [("np_array", np.arange(N)[::-1].copy())],
    )
    sweep(api, p, "keep_temp", arg("keep_temp"), run_it, flag_types()[:2])
    sweep(api, p, "progress", arg("progress"), run_it, flag_types()[:1])
    sweep(api, p, "index_key", arg("index_key"), run_it, [wt("int", 3)])
    sweep(api, p, "start_method", arg("start_method"), run_it, [oor("unknown", "thread")])
    sweep(api, p, "run_tag", arg("run_tag"), run_it, [wt("int", 3)])

    def metric_wrong_shape(ctx: Ctx) -> None:
        run_it(ctx, analyzer(metric_functions=[lambda b: b["input_ids"][:, :2].long()]))

    add(
        f"{p}.metric_functions.wrong_shape",
        api,
        "metric_functions",
        "fn -> int[B, 2]",
        "size",
        metric_wrong_shape,
        words=("first",),
    )

    def metric_float(ctx: Ctx) -> None:
        run_it(ctx, analyzer(metric_functions=[lambda b: b["input_ids"][:, 0].float() / 3]))

    add(
        f"{p}.metric_functions.float_values",
        api,
        "metric_functions",
        "fn -> float[B]",
        "wrong_type",
        metric_float,
        words=("first",),
    )


# ========================================================================================================= index files
def _analysis(ctx: Ctx, n: int = N) -> Path:
    """Index files of the ``first`` metric over ``n`` TokenBlocks (made while preparing the case)."""
    from tests.helpers.tiny import TokenBlocks

    with ctx.preparing():
        folder = ctx.folder()
        analyzer(dataset=TokenBlocks(n=n, seq_len=SEQ), save_path=str(folder)).run_map_reduce()
    return folder / "first"


def _pct_metric(folder: Path, merged: bool = False, **kw: Any) -> dict[str, Any]:
    m = dict(
        difficulty_type="percentile",
        clustering_type="schedule_based",
        min_difficulty=50,
        max_difficulty=100,
        schedule_type="fixed_linear",
        schedule_config=dict(total_curriculum_step=4, difficulty_step=10),
        index_to_sample_path=str(folder / ("first_index_to_sample" + ("_percentile_merged" if merged else ""))),
    )
    return {**m, **kw}


def index_cases() -> None:
    api, p = "index files", "index"

    def fit_files(ctx: Ctx, metric: dict[str, Any]) -> None:
        ctx.stage = "construct"
        fit(ctx, [curriculum(metrics={"first": metric}, percentile_rounding="proportional")])

    def another_dataset(ctx: Ctx) -> None:
        fit_files(ctx, _pct_metric(_analysis(ctx, n=30)))

    add(
        f"{p}.another_dataset.longer",
        api,
        "index_to_sample_path",
        "files of a 30-sample dataset (training: 24)",
        "files",
        another_dataset,
        words=("index_to_sample",),
    )

    def another_dataset_shorter(ctx: Ctx) -> None:
        fit_files(ctx, _pct_metric(_analysis(ctx, n=20)))

    add(
        f"{p}.another_dataset.shorter",
        api,
        "index_to_sample_path",
        "files of a 20-sample dataset (training: 24)",
        "files",
        another_dataset_shorter,
        words=("index_to_sample",),
    )

    def missing(ctx: Ctx) -> None:
        fit_files(ctx, _pct_metric(ctx.tmp / "nowhere"))

    add(
        f"{p}.missing",
        api,
        "index_to_sample_path",
        "a prefix with no files",
        "files",
        missing,
        words=("index_to_sample",),
    )

    def truncated_bin(ctx: Ctx) -> None:
        folder = _analysis(ctx)
        with ctx.preparing():
            bin_file = folder / "first_index_to_sample.bin"
            bin_file.write_bytes(bin_file.read_bytes()[:-8])
        fit_files(ctx, _pct_metric(folder))

    add(
        f"{p}.truncated_bin",
        api,
        "index_to_sample_path",
        "the .bin file cut short by 8 bytes",
        "files",
        truncated_bin,
        words=("index_to_sample",),
    )

    def corrupted_idx(ctx: Ctx) -> None:
        folder = _analysis(ctx)
        with ctx.preparing():
            idx = folder / "first_index_to_sample.idx"
            data = bytearray(idx.read_bytes())
            data[:9] = b"NOTANIDX!"
            idx.write_bytes(bytes(data))
        fit_files(ctx, _pct_metric(folder))

    add(
        f"{p}.corrupted_idx_header",
        api,
        "index_to_sample_path",
        "the .idx header overwritten",
        "files",
        corrupted_idx,
        words=("index_to_sample",),
    )

    def metric_of_other_metric(ctx: Ctx) -> None:
        folder = _analysis(ctx)
        m = _pct_metric(folder, difficulty_type="value", min_difficulty=10, max_difficulty=63)
        m["index_to_metric_path"] = str(folder / "first_sample_to_metric")  # N rows, not one per distinct value
        fit_files(ctx, m)

    add(
        f"{p}.index_to_metric.wrong_file",
        api,
        "index_to_metric_path",
        "first_sample_to_metric (N rows)",
        "files",
        metric_of_other_metric,
        words=("index_to_metric",),
    )

    def mmap_dir(ctx: Ctx) -> None:
        from lightning_effi.curriculum.analysis import MMapIndexedDataset

        MMapIndexedDataset(str(ctx.folder()))

    add(
        f"{p}.mmap.directory",
        "MMapIndexedDataset",
        "path_prefix",
        "a directory",
        "files",
        mmap_dir,
        words=(("idx", "index"),),
    )

    def mmap_dtype_table(ctx: Ctx) -> None:
        from lightning_effi.curriculum.analysis import MMapIndexedDataset

        MMapIndexedDataset(str(_analysis(ctx) / "first_index_to_sample"), dtype_table="bogus")

    add(
        f"{p}.mmap.dtype_table",
        "MMapIndexedDataset",
        "dtype_table",
        "'bogus'",
        "out_of_range",
        mmap_dtype_table,
        words=("dtype_table",),
    )

    def metric_index_mismatch(ctx: Ctx) -> None:
        from lightning_effi.curriculum.analysis import MetricIndex

        folder = _analysis(ctx)
        MetricIndex.load(str(folder / "first_index_to_sample"), str(folder / "first_index_to_metric"), num_samples=30)

    add(
        f"{p}.metric_index.num_samples",
        "MetricIndex.load",
        "num_samples",
        "30 (the files hold 24)",
        "files",
        metric_index_mismatch,
        words=(("num_samples", "24", "30"),),
    )


# =================================================================================================== functional core
def functional_cases() -> None:
    def call(
        api: str,
        tag: str,
        argument: str,
        fn: Callable[[], Any],
        kind: str,
        shown: str,
        words: Sequence[Word] | None = None,
        **kw: Any,
    ) -> None:
        add(
            f"functional.{api}.{tag}",
            f"functional.{api.split('.')[0]}",
            argument,
            None,
            kind,
            lambda ctx: fn(),
            words,
            shown=shown,
            **kw,
        )

    def F(module: str) -> Any:
        import lightning_effi.functional as functional

        return getattr(functional, module)

    def tables(n: int = 8, nan: bool = False) -> tuple[Any, Any]:
        import torch

        score = torch.linspace(0.1, 1.0, n)
        if nan:
            score[2] = math.nan
        return score, torch.ones(n, dtype=torch.bool)

    # InfoBatch
    call(
        "infobatch.plan_epoch",
        "epoch_neg",
        "epoch",
        lambda: F("infobatch").plan_epoch(*tables(), -1, 4),
        "out_of_range",
        "epoch=-1",
    )
    call(
        "infobatch.plan_epoch",
        "epoch_float",
        "epoch",
        lambda: F("infobatch").plan_epoch(*tables(), 1.5, 4),
        "wrong_type",
        "epoch=1.5",
    )
    call(
        "infobatch.plan_epoch",
        "epoch_beyond",
        "epoch",
        lambda: F("infobatch").plan_epoch(*tables(), 9, 4),
        "out_of_range",
        "epoch=9, num_epochs=4",
        words=(("epoch", "num_epochs"),),
    )
    call(
        "infobatch.plan_epoch",
        "prune_ratio_str",
        "prune_ratio",
        lambda: F("infobatch").plan_epoch(*tables(), 1, 4, prune_ratio="0.5"),
        "wrong_type",
        "prune_ratio='0.5'",
    )
    call(
        "infobatch.plan_epoch",
        "score_nan",
        "score",
        lambda: F("infobatch").plan_epoch(*tables(nan=True), 1, 4),
        "out_of_range",
        "a NaN score of a seen sample",
        words=(("score", "finite", "nan"),),
    )
    call(
        "infobatch.plan_epoch",
        "sizes",
        "seen",
        lambda: F("infobatch").plan_epoch(tables(8)[0], tables(6)[1], 1, 4),
        "size",
        "score[8], seen[6]",
        words=(("seen", "score", "shape"),),
    )
    call(
        "infobatch.keep_count",
        "neg",
        "n_well_learned",
        lambda: F("infobatch").keep_count(-1, 0.5),
        "out_of_range",
        "n_well_learned=-1",
    )
    call(
        "infobatch.epoch_stop",
        "zero_epochs",
        "num_epochs",
        lambda: F("infobatch").epoch_stop(0, 0.5),
        "out_of_range",
        "num_epochs=0",
    )
    call(
        "infobatch.validate_hparams",
        "prune_ratio_nan",
        "prune_ratio",
        lambda: F("infobatch").validate_hparams(NAN, 0.875),
        "out_of_range",
        "prune_ratio=nan",
    )

    def rescale_sizes() -> Any:
        import torch

        return F("infobatch").rescale(torch.ones(4, requires_grad=True), torch.arange(3), torch.ones(8))

    call(
        "infobatch.rescale",
        "sizes",
        "index",
        rescale_sizes,
        "size",
        "per_sample_loss[4], index[3]",
        words=(("index", "per_sample_loss", "shape"),),
    )

    def update_nan() -> Any:
        import torch

        score, seen = tables()
        return F("infobatch").update_scores(score, seen, torch.arange(2), torch.tensor([1.0, NAN]))

    call(
        "infobatch.update_scores",
        "loss_nan",
        "per_sample_loss",
        update_nan,
        "out_of_range",
        "a NaN per-sample loss",
        words=(("finite", "nan"),),
        warn_ok=True,
    )

    def thin_full() -> Any:
        import torch

        return F("infobatch").thin_micro_batch(
            torch.arange(4), torch.ones(4, dtype=torch.bool), 1.0, torch.Generator().manual_seed(0)
        )

    call("infobatch.thin_micro_batch", "ratio_one", "prune_ratio", thin_full, "out_of_range", "prune_ratio=1.0")
    # curriculum schedules
    S = "schedules"
    call(
        f"{S}.root_difficulty",
        "total_zero",
        "total_curriculum_step",
        lambda: F(S).root_difficulty(3, 8, 16, 0, 4),
        "out_of_range",
        "total_curriculum_step=0",
    )
    call(
        f"{S}.root_difficulty",
        "step_neg",
        "step",
        lambda: F(S).root_difficulty(-2, 8, 16, 6, 4),
        "out_of_range",
        "step=-2",
    )
    call(
        f"{S}.root_difficulty",
        "difficulty_step_zero",
        "difficulty_step",
        lambda: F(S).root_difficulty(3, 8, 16, 6, 0),
        "out_of_range",
        "difficulty_step=0",
    )
    call(
        f"{S}.root_difficulty",
        "root_degree_zero",
        "root_degree",
        lambda: F(S).root_difficulty(3, 8, 16, 6, 4, root_degree=0),
        "out_of_range",
        "root_degree=0",
    )
    call(
        f"{S}.root_difficulty",
        "min_above_max",
        "min_difficulty",
        lambda: F(S).root_difficulty(3, 16, 8, 6, 4),
        "order",
        "min_difficulty=16, max_difficulty=8",
        words=(("min_difficulty", "max_difficulty"),),
    )
    call(
        f"{S}.root_difficulty",
        "rounding",
        "rounding",
        lambda: F(S).root_difficulty(3, 8, 16, 6, 4, rounding="x"),
        "out_of_range",
        "rounding='x'",
    )
    call(
        f"{S}.discrete_difficulty",
        "empty",
        "max_step",
        lambda: F(S).discrete_difficulty(3, [], []),
        "size",
        "difficulty=[], max_step=[]",
        words=(("max_step", "difficulty"),),
    )
    call(
        f"{S}.discrete_difficulty",
        "sizes",
        "max_step",
        lambda: F(S).discrete_difficulty(9, [8], [5]),
        "size",
        "difficulty=[8], max_step=[5]",
        words=(("max_step", "difficulty"),),
    )
    call(
        f"{S}.discrete_difficulty",
        "descending",
        "max_step",
        lambda: F(S).discrete_difficulty(3, [8, 12, 16], [6, 2]),
        "order",
        "max_step=[6, 2]",
    )
    call(
        f"{S}.CurriculumSchedule",
        "discrete_descending",
        "max_step",
        lambda: F(S).CurriculumSchedule("fixed_discrete", 8, 16, {"difficulty": [8, 12, 16], "max_step": [6, 2]}),
        "order",
        "max_step=[6, 2]",
    )
    call(
        f"{S}.CurriculumSchedule",
        "linear_total_str",
        "total_curriculum_step",
        lambda: F(S).CurriculumSchedule("fixed_linear", 8, 16, {"total_curriculum_step": "6", "difficulty_step": 4}),
        "wrong_type",
        "total_curriculum_step='6'",
    )
    call(
        f"{S}.CurriculumSchedule",
        "valid_numpy",
        "max_difficulty",
        lambda: F(S).CurriculumSchedule(
            "fixed_linear",
            np.int64(8),
            np.int64(16),
            {"total_curriculum_step": np.int64(6), "difficulty_step": np.int32(4)},
        ),
        "valid",
        "numpy ints",
    )
    # curriculum functional
    C = "curriculum"
    call(f"{C}.dp_slice", "rank_beyond", "rank", lambda: F(C).dp_slice(8, 2, 5), "out_of_range", "rank=5, dp_size=2")
    call(
        f"{C}.dp_slice",
        "mode",
        "mode",
        lambda: F(C).dp_slice(8, 2, 0, mode="bogus"),
        "out_of_range",
        "mode='bogus'",
        words=(("mode", "dp_split"),),
    )
    call(f"{C}.dp_slice", "dp_size_zero", "dp_size", lambda: F(C).dp_slice(8, 0, 0), "out_of_range", "dp_size=0")
    call(
        f"{C}.eligible_end",
        "percentile_above_max",
        "difficulty",
        lambda: F(C).eligible_end(150, difficulty_type="percentile", num_samples=4, max_difficulty=100),
        "out_of_range",
        "difficulty=150 of 100 (percentile)",
        words=(("difficulty", "percentile"),),
    )

    def truncate_zero() -> Any:
        import torch

        return F(C).truncate_batch({"input_ids": torch.ones(2, 8, dtype=torch.long)}, 0)

    call(f"{C}.truncate_batch", "zero", "difficulty", truncate_zero, "out_of_range", "difficulty=0")

    def reshape_not_divisor() -> Any:
        import torch

        return F(C).reshape_batch({"input_ids": torch.ones(2, 8, dtype=torch.long)}, 2)

    # seqlen_reshape re-chunks any d (Megatron-DeepSpeed pretrain_gpt.py; specs/curriculum.md: the last d + 1
    # tokens of each sample come back as an extra row), so a d + 1 that does not divide S is a valid input
    call(
        f"{C}.reshape_batch",
        "valid_not_divisor",
        "difficulty",
        reshape_not_divisor,
        "valid",
        "difficulty=2 for 8 tokens (rows of 3)",
    )
    # random-LTD
    R = "random_ltd"
    call(f"{R}.ltd_value", "step_neg", "step", lambda: F(R).ltd_value(-1, 4, 16, 10, 4), "out_of_range", "step=-1")
    call(
        f"{R}.ltd_value",
        "min_above_max",
        "min_value",
        lambda: F(R).ltd_value(1, 32, 16, 10, 4),
        "order",
        "min_value=32, max_value=16",
    )
    call(
        f"{R}.ltd_value",
        "require_steps_float",
        "require_steps",
        lambda: F(R).ltd_value(1, 4, 16, 2.5, 4),
        "wrong_type",
        "require_steps=2.5",
    )
    call(
        f"{R}.ltd_value",
        "rounding",
        "rounding",
        lambda: F(R).ltd_value(1, 4, 16, 10, 4, rounding="x"),
        "out_of_range",
        "rounding='x'",
    )
    call(
        f"{R}.ltd_value",
        "valid_numpy",
        "step",
        lambda: F(R).ltd_value(np.int64(3), np.int64(4), np.int64(16), np.int64(10), np.int64(4)),
        "valid",
        "numpy ints",
    )
    call(
        f"{R}.sample_token_indices",
        "reserved_above_seq",
        "reserved_length",
        lambda: F(R).sample_token_indices(2, 2, 8, 12),
        "out_of_range",
        "reserved_length=12, seq_len=8",
    )
    call(
        f"{R}.sample_token_indices",
        "prefix_above_reserved",
        "keep_prefix_tokens",
        lambda: F(R).sample_token_indices(2, 2, 8, 4, keep_prefix_tokens=6),
        "out_of_range",
        "keep_prefix_tokens=6, reserved_length=4",
    )
    call(
        f"{R}.sample_token_indices",
        "float",
        "seq_len",
        lambda: F(R).sample_token_indices(2, 2, 8.0, 4),
        "wrong_type",
        "seq_len=8.0",
    )

    def gather_bad() -> Any:
        import torch

        return F(R).gather_tokens(torch.zeros(2, 8, 4), torch.tensor([[0, 9], [1, 2]]))

    call(
        f"{R}.gather_tokens",
        "index_beyond",
        "idx",
        gather_bad,
        "out_of_range",
        "idx holds 9 for 8 tokens",
        words=(("idx", "index"),),
    )
    call(
        f"{R}.layer_tokens",
        "ltd_above_layers",
        "num_ltd_layers",
        lambda: F(R).layer_tokens(4, 16, 8, 2, 3),
        "out_of_range",
        "num_ltd_layers=3, num_layers=2",
    )
    call(
        f"{R}.layer_tokens",
        "neg_batch",
        "batch_size",
        lambda: F(R).layer_tokens(-4, 16, 8, 4, 2),
        "out_of_range",
        "batch_size=-4",
    )
    # V-cycle operators and stages
    V = "vcycle"
    call(
        f"{V}.width_groups",
        "odd_half",
        "size",
        lambda: F(V).width_groups(7),
        "out_of_range",
        "size=7, 'half'",
        words=(("size", "even"),),
    )
    call(f"{V}.width_groups", "np_size", "size", lambda: F(V).width_groups(np.int64(8)), "valid", "size=np.int64(8)")
    call(
        f"{V}.width_groups",
        "not_partition",
        "scheme",
        lambda: F(V).width_groups(4, [[0, 1], [1, 2]]),
        "out_of_range",
        "[[0, 1], [1, 2]]",
        words=(("partition", "duplicate", "scheme"),),
    )
    call(f"{V}.depth_groups", "odd", "num_layers", lambda: F(V).depth_groups(3), "out_of_range", "num_layers=3")
    call(
        f"{V}.depth_groups",
        "overlap",
        "scheme",
        lambda: F(V).depth_groups(4, [[0, 1], [1, 2, 3]]),
        "out_of_range",
        "[[0, 1], [1, 2, 3]]",
        words=(("depth_scheme", "partition"),),
    )
    call(
        f"{V}.depth_groups",
        "np_layers",
        "num_layers",
        lambda: F(V).depth_groups(np.int64(4)),
        "valid",
        "num_layers=np.int64(4)",
    )

    def interp(alpha: Any) -> Any:
        import torch

        return F(V).interpolate({"w": torch.ones(2)}, {"w": torch.zeros(2)}, alpha)

    call(f"{V}.interpolate", "alpha_above1", "alpha_original", lambda: interp(1.5), "out_of_range", "alpha=1.5")
    call(f"{V}.interpolate", "alpha_nan", "alpha_original", lambda: interp(NAN), "out_of_range", "alpha=nan")
    call(
        f"{V}.interpolate",
        "alpha_np",
        "alpha_original",
        lambda: interp(np.float32(0.25)),
        "valid",
        "alpha=np.float32(0.25)",
    )

    def interp_keys() -> Any:
        import torch

        return F(V).interpolate({"w": torch.ones(2)}, {"v": torch.zeros(2)}, 0.5)

    call(f"{V}.interpolate", "keys", "saved_original", interp_keys, "size", "other keys", words=(("key",),))

    def stage_plan(*args: Any) -> Any:
        from lightning_effi.vcycle.stages import stage_plan as sp

        return sp(*args)

    call("vcycle.stage_plan", "up_leg_short", "up_leg", lambda: stage_plan(3, 2, 4, []), "size", "levels=3, up_leg=[]")
    call("vcycle.stage_plan", "levels_one", "levels", lambda: stage_plan(1, 2, 4), "out_of_range", "levels=1")
    call("vcycle.stage_plan", "neg_steps", "e_a", lambda: stage_plan(2, -2, 4), "out_of_range", "e_a=-2")

    # Duration (the lengths every technique reads)
    def duration(value: Any) -> Any:
        from lightning_effi import Duration

        return Duration.parse(value)

    for tag, value, kind in (
        ("half_epoch", "1.5ep", "out_of_range"),
        ("float", 2.5, "wrong_type"),
        ("bool", True, "wrong_type"),
        ("neg", -3, "out_of_range"),
        ("fraction_above1", "2dur", "out_of_range"),
        ("unit", "3days", "out_of_range"),
        ("nan", "nandur", "out_of_range"),
    ):
        call(
            "core.Duration.parse",
            tag,
            "value",
            functools.partial(duration, value),
            kind,
            repr(value),
            words=(("duration", "dur", "ep", "step"),),
        )
    call("core.Duration.parse", "np_int", "value", lambda: duration(np.int64(3)), "valid", "np.int64(3)")


# ============================================================================================================ report
class CliError(Exception):
    """A command line that exited with an error: its status and what it printed on stderr."""


def report_cases() -> None:

    def record_case(
        tag: str, argument: str, shown: str, kind: str, change: Callable[[dict[str, Any]], None], words: Sequence[Word]
    ) -> None:
        def run(ctx: Ctx) -> None:
            import json

            from lightning_effi.report import load_runs
            from tests.report import write_record

            with ctx.preparing():
                folder = write_record(ctx.folder())
                record = json.loads((folder / "result.json").read_text())
                change(record)
                (folder / "result.json").write_text(json.dumps(record))
            load_runs([folder])

        add(f"report.result_json.{tag}", "report: result.json", argument, None, kind, run, words, shown=shown)

    def set_(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
        return lambda r: r.__setitem__(key, value)

    def del_(key: str) -> Callable[[dict[str, Any]], None]:
        return lambda r: r.pop(key)

    record_case("schema_1", "schema", "schema=1", "out_of_range", set_("schema", 1), ("schema",))
    record_case("schema_str", "schema", "schema='2'", "wrong_type", set_("schema", "2"), ("schema",))
    record_case("no_arm", "arm", "arm missing", "other", del_("arm"), ("arm",))
    record_case("budget_neg", "budget", "budget=-1", "out_of_range", set_("budget", -1), ("budget",))
    record_case("budget_str", "budget", "budget='1.0'", "wrong_type", set_("budget", "1.0"), ("budget",))
    record_case("budget_bool", "budget", "budget=true", "wrong_type", set_("budget", True), ("budget",))
    record_case("seed_str", "seed", "seed='0'", "wrong_type", set_("seed", "0"), ("seed",))
    record_case("seed_float", "seed", "seed=0.5", "wrong_type", set_("seed", 0.5), ("seed",))
    record_case(
        "mode",
        "optimized_mode",
        "optimized_mode='minimize'",
        "out_of_range",
        set_("optimized_mode", "minimize"),
        ("optimized_mode",),
    )
    record_case("metric_str", "metric", "metric='2.0'", "wrong_type", set_("metric", "2.0"), ("metric",))
    record_case(
        "efficiency_no_flops",
        "efficiency",
        "efficiency without flops",
        "other",
        lambda r: r["efficiency"].pop("flops"),
        ("flops",),
    )
    record_case(
        "efficiency_flops_str",
        "efficiency",
        "efficiency.flops='1e12'",
        "wrong_type",
        lambda r: r["efficiency"].__setitem__("flops", "1e12"),
        ("flops",),
    )
    record_case(
        "efficiency_flops_neg",
        "efficiency",
        "efficiency.flops=-1",
        "out_of_range",
        lambda r: r["efficiency"].__setitem__("flops", -1.0),
        ("flops",),
    )
    record_case("curve_dict", "curve", "curve={}", "wrong_type", set_("curve", {}), ("curve",))
    record_case("curve_point_str", "curve", "curve=['x']", "wrong_type", set_("curve", ["x"]), ("curve",))
    record_case("techniques_list", "techniques", "techniques=[]", "wrong_type", set_("techniques", []), ("techniques",))

    def not_json(ctx: Ctx) -> None:
        from lightning_effi.report import load_runs

        folder = ctx.folder()
        (folder / "result.json").write_text("{not json")
        load_runs([folder])

    add(
        "report.result_json.not_json",
        "report: result.json",
        "result.json",
        None,
        "files",
        not_json,
        ("result.json",),
        shown="'{not json'",
    )

    def cli(
        args: Callable[[Path], list[str]], words: Sequence[Word], tag: str, shown: str, kind: str, **kw: Any
    ) -> None:
        def run(ctx: Ctx) -> None:
            from lightning_effi.report.__main__ import main
            from tests.report import write_sweep

            with ctx.preparing():
                sweep_dir = write_sweep(ctx.folder() / "sweep")
            err = io.StringIO()
            code: Any = 0
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    code = main(args(sweep_dir))
                except SystemExit as exc:  # argparse
                    code = exc.code
            if code != 0:
                raise CliError(f"exit status {code}: {err.getvalue().strip()}")

        add(f"report.cli.{tag}", "report: CLI", tag.split("_")[0], None, kind, run, words, shown=shown, **kw)

    cli(lambda d: [str(d.parent / "nowhere")], ("nowhere",), "path_missing", "a path that does not exist", "files")
    cli(
        lambda d: [str(d), "--metric", "val/acc"],
        ("val/acc",),
        "metric_absent",
        "--metric val/acc (not logged)",
        "other",
    )
    cli(lambda d: [str(d), "--compute", "bogus"], ("compute",), "compute_unknown", "--compute bogus", "out_of_range")
    cli(
        lambda d: [str(d), "--mode", "max"],
        ("mode",),
        "mode_contradicts",
        "--mode max for val/loss (min)",
        "other",
        warn_ok=True,
    )

    def frontier(fn_name: str, *args: Any) -> Callable[[Ctx], Any]:
        def run(ctx: Ctx) -> Any:
            from lightning_effi.report import frontier as fr

            return getattr(fr, fn_name)(*args)

        return run

    for tag, fn_name, args, argument, kind, words in (
        ("pareto_nan", "pareto_front", ([(1.0, NAN), (2.0, 1.0)], "min"), "points", "out_of_range", ("finite",)),
        ("pareto_mode", "pareto_front", ([(1.0, 2.0)], "minimize"), "mode", "out_of_range", ("mode",)),
        ("pareto_triple", "pareto_front", ([(1.0, 2.0, 3.0)], "min"), "points", "size", ("pair",)),
        ("reach_mode", "compute_to_reach", ([(1.0, 2.0), (2.0, 1.0)], 1.5, "best"), "mode", "out_of_range", ("mode",)),
        ("reach_empty", "compute_to_reach", ([], 1.5, "min"), "frontier", "size", ("frontier",)),
        (
            "reach_quality_nan",
            "compute_to_reach",
            ([(1.0, 2.0), (2.0, 1.0)], NAN, "min"),
            "quality",
            "out_of_range",
            ("quality",),
        ),
        ("saving_zero", "saving", (0.0, 1.0), "arm_compute", "out_of_range", ("arm_compute",)),
        ("saving_nan", "saving", (1.0, NAN), "frontier_compute", "out_of_range", ("frontier_compute",)),
    ):
        add(
            f"report.frontier.{tag}",
            "report: frontier",
            argument,
            None,
            kind,
            frontier(fn_name, *args),
            words,
            shown=f"{fn_name}{short(args)}",
        )


# =============================================================================================== checkpoints (resume)
def _corrupt(path: Path, cls_name: str, change: Callable[[dict[str, Any]], None]) -> None:
    import torch

    ck = torch.load(path, map_location="cpu", weights_only=False)
    keys = [k for k in ck.get("callbacks", {}) if k.startswith(cls_name)]
    if not keys:
        raise KeyError(f"no {cls_name} state in the checkpoint: {list(ck.get('callbacks', {}))}")
    change(ck["callbacks"][keys[0]])
    torch.save(ck, path)


def checkpoint_cases() -> None:
    def case(
        tag: str,
        api: str,
        make: Callable[[], Any],
        limits: dict[str, Any],
        every: dict[str, Any],
        change: Callable[[dict[str, Any]], None],
        shown: str,
        words: Sequence[Word],
    ) -> None:
        """Fit with ``make()`` and a ModelCheckpoint (``every``), corrupt the technique's state in the first
        checkpoint with ``change``, resume the same run from it."""

        def run(ctx: Ctx) -> None:
            from lightning.pytorch.callbacks import ModelCheckpoint

            with ctx.preparing():
                folder = ctx.folder() / "ckpt"
                saver = ModelCheckpoint(dirpath=folder, save_top_k=-1, save_last=False, **every)
                fit(ctx, [make()], limits=limits, extra=[saver])
                path = min(folder.glob("*.ckpt"), key=lambda f: f.stat().st_mtime)
                _corrupt(path, api, change)
            ctx.stage = "construct"
            fit(ctx, [make()], limits=limits, ckpt_path=path)

        add(f"checkpoint.{tag}", f"checkpoint: {api}", "ckpt_path", None, "checkpoint", run, words, shown=shown)

    ib_limits, epoch = dict(max_epochs=3, max_steps=-1), dict(every_n_epochs=1)
    steps, at3 = dict(max_steps=6, max_epochs=-1), dict(every_n_train_steps=3)

    def set_tensor(key: str, value: float) -> Callable[[dict[str, Any]], None]:
        return lambda state: state.__setitem__(key, state[key].clone().fill_(value))

    def set_(key: str, value: Any, within: str | None = None) -> Callable[[dict[str, Any]], None]:
        return lambda state: (state[within] if within else state).__setitem__(key, value)

    ib = "InfoBatchCallback"
    case(
        "infobatch.score_nan",
        ib,
        infobatch,
        ib_limits,
        epoch,
        set_tensor("score", NAN),
        "score table all NaN",
        (("score", "finite", "nan"),),
    )
    case(
        "infobatch.steps_neg",
        ib,
        infobatch,
        ib_limits,
        epoch,
        set_("steps_in_epoch", -3),
        "steps_in_epoch=-3",
        ("steps_in_epoch",),
    )
    case(
        "infobatch.table_size",
        ib,
        infobatch,
        ib_limits,
        epoch,
        lambda s: s.__setitem__("score", s["score"][:-2].clone()),
        "score table 2 entries short",
        ("score",),
    )
    case(
        "infobatch.table_epoch_future",
        ib,
        infobatch,
        ib_limits,
        epoch,
        set_("table_epoch", 99),
        "table_epoch=99",
        ("table_epoch",),
    )
    case(
        "infobatch.nonfinite_neg",
        ib,
        infobatch,
        ib_limits,
        epoch,
        set_("nonfinite", -4),
        "nonfinite=-4",
        ("nonfinite",),
    )
    cl = "Curriculum"
    case(
        "curriculum.step_neg",
        cl,
        curriculum,
        steps,
        at3,
        set_("curriculum_step", -2, "stream"),
        "stream.curriculum_step=-2",
        ("curriculum_step",),
    )
    case(
        "curriculum.micro_neg",
        cl,
        curriculum,
        steps,
        at3,
        set_("committed_micro", -3, "stream"),
        "stream.committed_micro=-3",
        ("committed_micro",),
    )
    case(
        "curriculum.consumed_above_budget",
        cl,
        curriculum,
        steps,
        at3,
        set_("consumed_samples", 10**9, "stream"),
        "stream.consumed_samples=10**9",
        ("consumed_samples",),
    )
    case(
        "curriculum.tokens_neg",
        cl,
        curriculum,
        steps,
        at3,
        set_("consumed_tokens", -100),
        "consumed_tokens=-100",
        ("consumed_tokens",),
    )
    case(
        "curriculum.difficulty_nan",
        cl,
        curriculum,
        steps,
        at3,
        set_("current_difficulties", {"seqlen_truncate": NAN}, "stream"),
        "stream.current_difficulties NaN",
        (("difficult", "nan"),),
    )
    rl = "RandomLTDCallback"
    case(
        "random_ltd.step_neg",
        rl,
        random_ltd,
        steps,
        at3,
        set_("current_step", -5),
        "current_step=-5",
        ("current_step",),
    )
    case(
        "random_ltd.value_zero",
        rl,
        random_ltd,
        steps,
        at3,
        set_("current_value", 0),
        "current_value=0",
        ("current_value",),
    )
    case(
        "random_ltd.flops_nan",
        rl,
        random_ltd,
        steps,
        at3,
        set_("saved_flops", NAN),
        "saved_flops=NaN",
        ("saved_flops",),
    )
    case(
        "random_ltd.layer_tokens_neg",
        rl,
        random_ltd,
        steps,
        at3,
        set_("consumed_layer_tokens", -64),
        "consumed_layer_tokens=-64",
        ("consumed_layer_tokens",),
    )
    vc, vc_limits = "VCycleCallback", dict(max_steps=10, max_epochs=-1)

    def vc_make() -> Any:
        return vcycle(e_a=2, e_small=3)

    case("vcycle.level_beyond", vc, vc_make, vc_limits, at3, set_("level", 7), "level=7", ("level",))
    case("vcycle.stage_neg", vc, vc_make, vc_limits, at3, set_("stage_index", -1), "stage_index=-1", ("stage_index",))
    case("vcycle.switches_neg", vc, vc_make, vc_limits, at3, set_("switches", -2), "switches=-2", ("switches",))

    def monitor() -> Any:
        from lightning_effi import EfficiencyMonitor

        return EfficiencyMonitor(print_summary=False)

    em = "EfficiencyMonitor"
    case(
        "monitor.totals_nan",
        em,
        monitor,
        steps,
        at3,
        lambda s: s["totals"].__setitem__("flops", NAN),
        "totals.flops=NaN",
        ("flops",),
    )
    case(
        "monitor.totals_neg",
        em,
        monitor,
        steps,
        at3,
        lambda s: s["totals"].__setitem__("samples", -10.0),
        "totals.samples=-10",
        ("samples",),
    )


# ================================================================================================ non-finite losses
def nonfinite_cases() -> None:
    words: tuple[Word, ...] = (("nan", "non-finite", "not finite", "nonfinite", "infinite"),)
    for tag, make in (
        ("infobatch", lambda: [infobatch()]),
        ("curriculum", lambda: [curriculum()]),
        ("random_ltd", lambda: [random_ltd()]),
        ("vcycle", lambda: [vcycle(e_a=1, e_small=3)]),
        ("monitor", lambda: [__import__("lightning_effi").EfficiencyMonitor(print_summary=False)]),
    ):

        def run(ctx: Ctx, make: Callable[[], list[Any]] = make, tag: str = tag) -> None:
            callbacks = make()
            limits = None if tag != "vcycle" else dict(max_steps=8, max_epochs=-1)
            fit(ctx, callbacks, extra=[poison(2)], limits=limits)

        api = {
            "infobatch": "InfoBatchCallback",
            "curriculum": "Curriculum",
            "random_ltd": "RandomLTDCallback",
            "vcycle": "VCycleCallback",
            "monitor": "EfficiencyMonitor",
        }[tag]
        add(
            f"nonfinite.{tag}.loss_nan_at_step2",
            f"non-finite loss: {api}",
            "loss",
            None,
            "nonfinite",
            run,
            words,
            shown="the loss becomes NaN at step 2",
            runtime=True,
        )


# ============================================================================================================ Hydra app
#: a tiny app run: 4-layer GPT-2 of width 32 on 32-token blocks of the stdlib corpus, 3 training batches
APP_TINY = [
    "model.n_layer=4",
    "model.n_embd=32",
    "model.n_head=4",
    "data.batch_size=4",
    "data.block_size=32",
    "data.max_chars=20000",
    "trainer.num_sanity_val_steps=1",  # as a user's run (the tests' fast defaults skip it): the app checks there
]
APP_NO_CKPT = ["~callbacks.model_checkpoint", "~callbacks.lr_monitor"]


def app(ctx: Ctx, overrides: Sequence[str], tiny: bool = True, drop_default: bool = True) -> Any:
    """Compose ``conf/train.yaml`` with ``overrides`` (as ``experiments/train.py`` would) and run the app in this
    process; the marker callback is put first in the Trainer's callbacks."""
    import lightning_effi.train as train
    from tests.helpers.hydra import compose_train

    cfg = compose_train([*overrides, *(APP_TINY if tiny else []), *(APP_NO_CKPT if drop_default else [])], ctx.folder())
    ctx.fitting()
    original = train.build

    def build(cfg: Any) -> Any:
        dm, model, trainer = original(cfg)
        cast(Any, trainer).callbacks.insert(0, ctx.marker())
        return dm, model, trainer

    train.build = build
    try:
        return train.run(cfg)
    finally:
        train.build = original


def _run_app(ctx: Ctx, overrides: list[str], tiny: bool, drop: bool) -> Any:
    return app(ctx, overrides, tiny, drop)


def app_cases() -> None:
    def case(tag: str, overrides: Sequence[str], words: Sequence[Word], kind: str = "other", **kw: Any) -> None:
        group = next((o.split("=")[1] for o in overrides if o.startswith("callbacks=")), "")
        shown = (f"callbacks={group} " if group and overrides[-1] != f"callbacks={group}" else "") + overrides[-1]
        argument = overrides[-1].split("=")[0].lstrip("+~")
        tiny, drop = kw.pop("tiny", True), kw.pop("drop_default", True)
        add(
            f"app.{tag}",
            "Hydra app",
            argument,
            None,
            kind,
            functools.partial(_run_app, overrides=list(overrides), tiny=tiny, drop=drop),
            words,
            shown=shown,
            **kw,
        )

    ib = ["callbacks=infobatch", "trainer.max_epochs=2"]
    for tag, value, kind in (
        ("str", "abc", "wrong_type"),
        ("above1", "1.5", "out_of_range"),
        ("neg", "-0.5", "out_of_range"),
        ("null", "null", "wrong_type"),
        ("quoted", "'0.5'", "wrong_type"),
    ):
        case(f"infobatch.prune_ratio.{tag}", [*ib, f"callbacks.infobatch.prune_ratio={value}"], ("prune_ratio",), kind)
    case("infobatch.delta.zero", [*ib, "callbacks.infobatch.delta=0"], ("delta",), "out_of_range")
    case("infobatch.strict.quoted_false", [*ib, "callbacks.infobatch.strict='false'"], ("strict",), "wrong_type")
    case("infobatch.num_epochs.above_max", [*ib, "callbacks.infobatch.num_epochs=5"], ("num_epochs",), "out_of_range")
    case("infobatch.momentum.above1", [*ib, "callbacks.infobatch.momentum=2"], ("momentum",), "out_of_range")
    case(
        "infobatch.per_sample_loss.str",
        [*ib, "callbacks.infobatch.per_sample_loss=mean"],
        ("per_sample_loss",),
        "wrong_type",
    )
    case("infobatch.max_steps", ["callbacks=infobatch", "trainer.max_steps=2"], ("max_steps",))
    case(
        "random_ltd.min_value.str",
        ["callbacks=random_ltd", "callbacks.random_ltd.min_value='8'"],
        ("min_value",),
        "wrong_type",
    )
    case(
        "random_ltd.min_value.float",
        ["callbacks=random_ltd", "callbacks.random_ltd.min_value=8.5"],
        ("min_value",),
        "wrong_type",
    )
    case(
        "random_ltd.min_value.above_seq",
        ["callbacks=random_ltd", "callbacks.random_ltd.min_value=64"],
        ("min_value",),
        "noop",
        warn_ok=True,
        note="the default min_value (64) on 32-token blocks",
    )
    rl = ["callbacks=random_ltd", "callbacks.random_ltd.min_value=8"]
    case(
        "random_ltd.require_steps.float",
        [*rl, "callbacks.random_ltd.require_steps=0.8"],
        ("require_steps",),
        "wrong_type",
    )
    case(
        "random_ltd.require_steps.beyond_run",
        [*rl, "callbacks.random_ltd.require_steps=1000"],
        ("require_steps",),
        "noop",
        warn_ok=True,
        note="the run ends (3 steps) long before the schedule reaches max_value",
    )
    case("random_ltd.layer_ids.str", [*rl, "callbacks.random_ltd.layer_ids='1,2'"], ("layer_ids",), "wrong_type")
    case("random_ltd.layer_ids.beyond", [*rl, "callbacks.random_ltd.layer_ids=[1,7]"], ("layer_ids",), "out_of_range")
    case("random_ltd.adapter.unknown", [*rl, "callbacks.random_ltd.adapter=gpt2"], ("adapter",), "out_of_range")
    case(
        "random_ltd.seq_per_step.zero", [*rl, "callbacks.random_ltd.seq_per_step=0"], ("seq_per_step",), "out_of_range"
    )
    case("random_ltd.strict.str", [*rl, "callbacks.random_ltd.strict=no"], ("strict",), "wrong_type")
    vc = ["callbacks=vcycle"]
    case("vcycle.e_a.float", [*vc, "callbacks.vcycle.e_a=0.05"], ("e_a",), "wrong_type")
    case("vcycle.e_a.beyond_run", [*vc, "callbacks.vcycle.e_a=1000"], ("e_a",), "out_of_range")
    case("vcycle.e_small.text", [*vc, "callbacks.vcycle.e_small=half"], ("e_small",), "out_of_range")
    case("vcycle.levels.three", [*vc, "callbacks.vcycle.levels=3"], ("up_leg",))
    case("vcycle.alpha.above1", [*vc, "callbacks.vcycle.alpha_original=1.5"], ("alpha_original",), "out_of_range")
    case(
        "vcycle.lr_multiplier.level3",
        [*vc, "++callbacks.vcycle.lr_multiplier.3=2.0"],
        ("lr_multiplier",),
        "out_of_range",
    )
    case("vcycle.lr_multiplier.scalar", [*vc, "callbacks.vcycle.lr_multiplier=4.0"], ("lr_multiplier",), "wrong_type")
    case(
        "vcycle.width_scheme.unknown", [*vc, "callbacks.vcycle.width_scheme=quarter"], ("width_scheme",), "out_of_range"
    )
    case("vcycle.depth_scheme.unknown", [*vc, "callbacks.vcycle.depth_scheme=pairs"], ("depth_scheme",), "out_of_range")
    cl = [
        "callbacks=curriculum",
        "callbacks.curriculum.metrics.seqlen_truncate.min_difficulty=8",
        "callbacks.curriculum.metrics.seqlen_truncate.max_difficulty=32",
        "callbacks.curriculum.metrics.seqlen_truncate.schedule_config.total_curriculum_step=3",
    ]
    case(
        "curriculum.max_difficulty.above_data",
        [*cl[:2], *cl[3:], "callbacks.curriculum.metrics.seqlen_truncate.max_difficulty=4096"],
        ("max_difficulty",),
        "noop",
        warn_ok=True,
        note="the data's blocks are 32 tokens",
    )
    case(
        "curriculum.min_difficulty.str",
        [*cl, "callbacks.curriculum.metrics.seqlen_truncate.min_difficulty='8'"],
        ("min_difficulty",),
        "wrong_type",
    )
    case(
        "curriculum.schedule_type.unknown",
        [*cl, "callbacks.curriculum.metrics.seqlen_truncate.schedule_type=linear"],
        ("schedule_type",),
        "out_of_range",
    )
    case(
        "curriculum.total_step.zero",
        [*cl, "callbacks.curriculum.metrics.seqlen_truncate.schedule_config.total_curriculum_step=0"],
        ("total_curriculum_step",),
        "out_of_range",
    )
    case("curriculum.drop_last.str", [*cl, "callbacks.curriculum.drop_last='false'"], ("drop_last",), "wrong_type")
    case(
        "curriculum.metric_typo",
        [*cl, "+callbacks.curriculum.metrics.seqlen_truncate.min_dificulty=8"],
        ("min_dificulty",),
    )
    case(
        "curriculum.total_tokens.neg", [*cl, "callbacks.curriculum.total_tokens=-5"], ("total_tokens",), "out_of_range"
    )
    case(
        "efficiency.log_every.zero",
        ["callbacks.efficiency.log_every_n_steps=0"],
        ("log_every_n_steps",),
        "out_of_range",
    )
    case("efficiency.print_summary.str", ["callbacks.efficiency.print_summary='no'"], ("print_summary",), "wrong_type")
    # budgets, arms, the run's own keys
    case("budget.zero", ["budget=0"], ("budget",), "out_of_range")
    case("budget.neg", ["budget=-1"], ("budget",), "out_of_range")
    case("budget.str", ["budget=half"], ("budget",), "wrong_type")
    case(
        "budget.unused",
        ["budget=0.5"],
        ("budget",),
        warn_ok=False,
        note="no trainer length uses the budget: the run would train the full length under a budget's label",
    )
    case("budget.nan", ["budget=nan"], ("budget",), "out_of_range")
    case("arm.unknown", ["arm=baseline_10"], ("arm",), "out_of_range")
    case("arm.technique_without_bench", ["arm=technique"], (("bench", "arm"),))
    case("bench.unknown", ["bench=gpt_nope"], ("bench",), "out_of_range")
    case(
        "callbacks.unknown_group",
        ["callbacks=infobach"],
        (("callbacks", "infobach"),),
        "out_of_range",
        drop_default=False,
    )
    case("seed.float", ["seed=1.5"], ("seed",), "wrong_type")
    case("seed.str", ["seed=abc"], ("seed",), "wrong_type")
    case("optimized_mode.unknown", ["optimized_mode=maximize"], ("optimized_mode",), "out_of_range")
    case("optimized_metric.absent", ["optimized_metric=val/acc"], ("optimized_metric",))
    case("objective.floor.str", ["+objective.kind=saving_at_floor", "+objective.floor=low"], ("floor",), "wrong_type")
    case("objective.kind.unknown", ["+objective.kind=best"], ("objective",), "out_of_range")
    case("trainer.max_steps.str", ["trainer.max_steps=ten"], ("max_steps",), "wrong_type")
    case("data.batch_size.zero", ["data.batch_size=0"], ("batch_size",), "out_of_range", tiny=False)
    case("train.str", ["train='no'"], ("train",), "wrong_type", note="train: 'no' is a non-empty string: truthy")
    case("test.str", ["test='false'"], ("test",), "wrong_type")
    case("valid.numeric_seed", ["seed=7"], (), "valid")
    case("valid.prune_ratio_int", [*ib, "callbacks.infobatch.prune_ratio=0"], (), "valid")


def selftest_cases() -> list[Case]:
    """Cases that exercise the harness itself (``EFFI_CAMPAIGN_SELFTEST=1``): a hang, a dying worker, a clear error."""

    def hang(ctx: Ctx) -> None:
        import time

        time.sleep(600)

    def crash(ctx: Ctx) -> None:
        import os

        os._exit(3)

    def clear(ctx: Ctx) -> None:
        raise ValueError("selftest.arg must be an int, got 'x'")

    return [
        Case("selftest.hang", "selftest", "arg", "sleeps 600 s", "other", hang, ("arg",), timeout=3.0),
        Case("selftest.crash", "selftest", "arg", "os._exit(3)", "other", crash, ("arg",)),
        Case("selftest.clear", "selftest", "arg", "'x'", "wrong_type", clear, ("arg",)),
    ]


def catalogue() -> list[Case]:
    """Every case of the campaign, in a fixed order (ids are unique); with ``EFFI_CAMPAIGN_SELFTEST=1`` also the
    harness's own :func:`selftest_cases`."""
    if not CASES:
        for section in (
            infobatch_cases,
            infobatch_dm_cases,
            curriculum_cases,
            curriculum_dm_cases,
            deepspeed_cases,
            random_ltd_cases,
            vcycle_cases,
            monitor_cases,
            adapter_cases,
            analyzer_cases,
            index_cases,
            functional_cases,
            report_cases,
            checkpoint_cases,
            nonfinite_cases,
            app_cases,
        ):
            section()
        ids = [c.id for c in CASES]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"duplicate case ids: {dupes}")
    return list(CASES) + (selftest_cases() if os.environ.get("EFFI_CAMPAIGN_SELFTEST") == "1" else [])


__all__ = ["CASES", "catalogue", "fit"]


def warm_up() -> None:
    """Fit the tiny run once with the four techniques (imports, first-call costs), outside any case."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ctx = Ctx(Path(tmp))
        fit(ctx, [infobatch()], limits=dict(max_epochs=1, max_steps=-1))
        fit(ctx, [curriculum(), random_ltd(), vcycle(e_a=1, e_small=1)])
