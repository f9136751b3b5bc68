"""``Curriculum``: the Lightning callback of DeepSpeed-style curriculum learning (Li et al. 2022): hook wiring,
checkpoint state and logging. The method lives in :mod:`~lightning_effi.curriculum.schedules`,
:mod:`~lightning_effi.curriculum.functional` and :class:`~lightning_effi.curriculum.CurriculumController`; the
in-memory analysis in :func:`~lightning_effi.curriculum.analysis.analyze_in_memory`. The method card is
``lightning_effi/curriculum/README.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.utils.data import default_collate
from typing_extensions import override

from lightning_effi.core.accounting import Baseline, batch_size_of, tokens_of
from lightning_effi.core.batch import batch_meta
from lightning_effi.core.checks import check_bool, check_int, is_int
from lightning_effi.core.compat import uses_distributed_sampler
from lightning_effi.core.measure import tensor_leaves, token_source
from lightning_effi.core.nonfinite import NonFiniteLossGuard
from lightning_effi.core.progress import BatchesPerStep, accumulate_grad_batches_at, run_length
from lightning_effi.core.requirements import BATCH_STRUCTURES, Requirements, check_started, check_trainer
from lightning_effi.core.settings import KeepsSettings, apply_changed_settings, given_settings, keep_settings
from lightning_effi.core.state import (
    check_coarse_vcycle_resume,
    config_mismatch,
    open_batch_skipped,
    saving_in_train_batch_end,
)
from lightning_effi.core.wrapping import find_wrapper
from lightning_effi.curriculum import functional as F
from lightning_effi.curriculum.analysis.in_memory import analyze_in_memory
from lightning_effi.curriculum.config import TRANSFORM_METRICS, CurriculumConfig, CurriculumConfigError, MetricConfig
from lightning_effi.curriculum.data import (
    BATCH_KEYS,
    CurriculumDataModule,
    data_longest_sequence,
    data_sequence_length,
)
from lightning_effi.curriculum.stream import CurriculumController, indexes_fingerprint

__all__ = ["Curriculum", "CurriculumCallback"]

#: the defaults of the options that go with the metrics (DeepSpeed's seed and num_epochs)
_OPTION_DEFAULTS: dict[str, Any] = dict(
    seed=1234,
    num_epochs=1000,
    rounding="clamped",
    percentile_rounding="deepspeed",
    dp_split="balanced",
    drop_last=False,
    truncate_keys=None,
    causal_label_shift=False,
    keep_last_token=False,
    truncation_side="right",
)


def _metric_arguments(metric: MetricConfig) -> dict[str, Any]:
    """A parsed metric as the ``curriculum_metrics`` dict that builds it again (unset optional keys left out)."""
    out = {}
    for f in dataclasses.fields(metric):
        value = getattr(metric, f.name)
        if f.name != "name" and value is not None:
            out[f.name] = value
    return out


class Curriculum(KeepsSettings, Callback):
    """Curriculum learning: each optimizer step trains on a global batch drawn from the samples whose difficulty the
    schedule allows, and ``seqlen_truncate``/``seqlen_reshape`` shorten the batches early in training.

    Li et al., "DeepSpeed Data Efficiency" (arXiv 2212.03597) and "The Stability-Efficiency Dilemma" (arXiv
    2108.06084); reference ``deepspeed/runtime/data_pipeline/``. The hooks:

    - ``setup("fit")``: resolves the configuration (given here or to the
      :class:`~lightning_effi.data.CurriculumDataModule`), loads or computes the analysis indexes of the
      ``schedule_based`` metrics (validated against the training set), compares their hash across ranks, checks that
      the first step selects data, and attaches the controller (batch geometry from the loader's batch size,
      ``trainer.world_size`` and the accumulation factor: ``accumulate_grad_batches``, or the one factor of a
      ``GradientAccumulationScheduler``). Under DDP it requires
      ``Trainer(use_distributed_sampler=False)``: the sampler shards by rank itself.
    - ``on_train_start``: refuses a fit that starts at ``global_step > 0`` without curriculum state (a second
      ``trainer.fit()`` on the same Trainer would train the stream's first batches again; a checkpoint written
      without the curriculum resumes with a warning, the curriculum starting at its step 1), and warns (rank zero)
      about a schedule that does nothing (at ``max_difficulty`` from the first step) or does not reach
      ``max_difficulty`` within the run, with the figures
      (:meth:`~lightning_effi.curriculum.CurriculumConfig.reach_warnings`).
    - ``on_train_batch_start``: reads the batch's curriculum metadata (``cl_step``, ``cl_micro``, ``cl_difficulty``,
      ``cl_full_length``, ``cl_cut_mask``, ``cl_cut_left``, ``cl_cut_axes``;
      :func:`~lightning_effi.core.batch.batch_meta`, never in the user's batch: ``training_step`` receives its own
      batch structure, only truncated) and counts the batch's
      tokens (summed over ranks) so a token-based LR schedule (:meth:`token_progress`) already includes the current
      batch when the scheduler steps.
    - ``on_train_batch_end``: commits the batch (the resume position) and logs ``effi/curriculum/{metric}_difficulty``,
      ``effi/curriculum/eligible_samples``, ``effi/curriculum/num_clusters``, ``effi/curriculum/consumed_tokens``.
    - ``effi_baseline``: the batch before ``seqlen_truncate``, for the
      :class:`~lightning_effi.core.accounting.EfficiencyMonitor`'s baseline and the saving ``saved/curriculum/...``.
    - ``state_dict``: the committed stream position (safe-loadable ints, lists and dicts) and a configuration
      fingerprint; resuming continues the exact same sample stream.
    - ``on_before_backward``: the non-finite loss policy (``nonfinite_loss``,
      :class:`~lightning_effi.core.nonfinite.NonFiniteLossGuard`), before the backward pass.
    - ``on_train_end``: (rank zero) reports the non-finite losses counted under ``nonfinite_loss="warn"``.
    - ``teardown`` and ``on_exception`` (the fit raised; Lightning skips ``teardown`` then): the CurriculumDataModule
      forgets the controller, so a later fit of it without this callback is refused as a new one is; after an
      exception the batch in flight is also dropped (never committed nor counted). The curriculum changes neither the
      module nor the Trainer (it truncates batches in its DataModule's collate function), so nothing else is left to
      undo; a later fit, with or without it, trains the module as a fresh one (with it: a new Trainer, or the same
      one resumed from a checkpoint with ``ckpt_path``).

    With an :class:`~lightning_effi.callbacks.InfoBatchCallback` in the same Trainer the two form one data pipeline:
    the curriculum decides which samples are eligible and draws every batch (stream, steps, difficulty schedule and
    truncation unchanged); InfoBatch thins each drawn micro-batch and reweights what it keeps ("Composition" in the
    method card). The DataModule is wrapped once, in either order (or only in a ``CurriculumDataModule``); this
    callback finds its ``CurriculumDataModule`` along the ``.datamodule`` chain, and the callbacks' order does not
    matter.

    Args:
        metrics: ``{name: {difficulty_type, clustering_type, min_difficulty, max_difficulty, schedule_type,
            schedule_config, index_to_sample_path, index_to_metric_path, analysis, custom_schedule}}`` (DeepSpeed
            ``curriculum_metrics`` keys; see :class:`~lightning_effi.curriculum.MetricConfig`). ``None``: take the
            configuration given to the ``CurriculumDataModule``.
        seed, num_epochs, rounding, percentile_rounding, dp_split, drop_last, truncate_keys, causal_label_shift,
            keep_last_token, truncation_side: see :class:`~lightning_effi.curriculum.CurriculumConfig` (DeepSpeed
            defaults: seed 1234, num_epochs 1000). Given without ``metrics`` (the configuration on the
            ``CurriculumDataModule``) they must keep their defaults.
        analysis_batch_size: batch size of the in-memory analysis (metrics with ``analysis: <name>``).
        analysis_collate_fn: the collate function of the in-memory analysis (a list of samples -> a batch the metric
            reads); None: the training loader's. The metric must read the same values from two collates of the same
            samples: a collate that draws at random where the metric reads (a masked LM's
            ``DataCollatorForLanguageModeling`` under ``vocab_rarity``) is refused at setup, as it would give each
            sample a random difficulty; pass e.g. ``DataCollatorWithPadding(tokenizer)`` here.
        total_tokens: the run's token budget. When set, the callback exposes ``effi_progress()`` = consumed tokens
            (including the batch being trained) / ``total_tokens``, which the reference tasks' LR schedules follow
            (token-based LR decay, recommended with ``seqlen_truncate`` by the DeepSpeed tutorial).
        strict: a checkpoint written with another configuration raises on resume (``False``: warn and continue);
            one written on a training set of another size raises either way.
        nonfinite_loss: ``"raise"`` (default) stops the fit at the first NaN / infinite training loss, before its
            backward pass (the module's parameters unchanged by that step), with a
            :class:`~lightning_effi.core.nonfinite.NonFiniteLossError` naming the step; ``"warn"`` warns once, counts
            them (logged as ``effi/nonfinite_losses``, checkpointed, reported at the end of fit) and lets the run go
            on (your own handling, e.g. a loss scaler). The curriculum's stream is unaffected either way. With
            several techniques in the Trainer one check runs, with the strictest policy
            (:mod:`lightning_effi.core.nonfinite`).

    Warns (``on_train_start``, rank zero; UserWarning, with the figures): a schedule at ``max_difficulty`` from the
    first curriculum step (the curriculum does nothing for that metric); a schedule that reaches ``max_difficulty``
    only after the run's last step (e.g. ``total_curriculum_step`` longer than the run: the difficulty at the last
    step and the step that reaches the maximum); a ``percentile`` metric's ``fixed_discrete`` list that ends below
    ``max_difficulty``; a resume from a checkpoint written without the curriculum (it starts at its step 1).

    ``repr()`` lists every argument; ``eval`` of it builds an equal callback when the metrics hold no callables
    (``custom_schedule``, a callable ``analysis``) or arrays.

    Raises:
        CurriculumConfigError: at construction, a bad configuration (e.g. a ``value`` metric's ``fixed_discrete``
            list that ends below ``max_difficulty``); at ``on_train_start``, a fit that starts at ``global_step > 0``
            with no curriculum state restored and no ``ckpt_path`` (a second ``trainer.fit()`` on the same Trainer:
            resume with ``ckpt_path``, or use a fresh Trainer and callback); at ``setup``, a configuration given
            twice or not at all, index files that do not match the training set, an empty first eligible set, DDP with
            ``use_distributed_sampler=True``, index files that differ between ranks, a ``seqlen_truncate`` /
            ``seqlen_reshape`` range that does not fit the training data's sequence length (``max_difficulty`` above
            it, or ``min_difficulty`` at or above it: :meth:`~lightning_effi.curriculum.CurriculumConfig
            .check_data_length`: against the data's one length, or its longest batch when batches are padded to
            their longest sample); at a checkpoint's load, an invalid
            state (a ``consumed_tokens`` that is not an int >= 0, ``last_difficulties`` that are not an int per metric
            name, an invalid stream position), naming the entry.
        ValueError: at construction, ``nonfinite_loss`` not ``"raise"`` or ``"warn"``; at a checkpoint's load, a
            non-finite loss count that is not an int >= 0.
        NonFiniteLossError: during the fit, a non-finite training loss under ``nonfinite_loss="raise"``.
        DataConfigError: (the ``CurriculumDataModule``'s loader: when it is built, on a batch of the training set's
            first samples, else at the first batch) a batch the sequence-length transforms cannot work with
            (:class:`~lightning_effi.curriculum.data.CurriculumCollate`), e.g. a key of ``truncate_keys`` that names
            no tensor of the batch (the message names ``truncate_keys``, the missing keys and the batch's tensors).
        IncompatibleTechniques: at ``setup``, another technique that owns the training sampler and cannot act
            inside this one's (InfoBatch can); see :data:`lightning_effi.core.requirements.CONFLICTS`; a
            ``GradientAccumulationScheduler`` whose factor changes during the run (``requirements.refused_features``:
            the stream's steps are laid out with one factor; a scheduler with one factor is read at ``setup``).
    """

    #: rebuilds the training loader (its own batch sampler) and edits each batch, of any structure (truncation)
    requirements = Requirements(
        owns_train_sampler=True,
        hosts_thinning=True,
        edits_batch=True,
        batch_structures=BATCH_STRUCTURES,
        refused_strategies=("DeepSpeedStrategy",),
        strategy_note=(
            "DeepSpeed's engine is not validated with the curriculum's batch sampler (it reads one micro-batch size "
            "from the training loader and owns the gradient accumulation); use strategy='ddp' or 'fsdp', or "
            "DeepSpeed's own curriculum learning (the data_efficiency section of its config)."
        ),
        refused_features=(
            (
                "gradient_accumulation_scheduler",
                "the curriculum draws each optimizer step's global batch (micro-batch x ranks x accumulation "
                "micro-batches, one difficulty) from a stream laid out once, at setup; when the factor changes, "
                "Lightning's accumulation windows no longer match the stream's steps and one optimizer step mixes "
                "micro-batches of different difficulties. Use one factor for the whole run "
                "(Trainer(accumulate_grad_batches=k) or a scheduler with a single factor)",
            ),
            (
                "overfit_batches",
                "overfit_batches repeats the same first batches every epoch, while the curriculum draws every "
                "step's batch from its stream (new samples, at a difficulty that grows with the steps): its loader "
                "would go on drawing new batches and the run would not overfit. Check that the model overfits "
                "without the curriculum, then train with it",
            ),
            (
                "batch_size_finder",
                "the curriculum lays out its stream once, at setup, for the DataModule's batch size (micro-batch x "
                "ranks x accumulation = one curriculum step), so the finder's trial sizes never reach its sampler "
                "(every trial would run the setup's size), and its first batches are the run's shortest "
                "(seqlen_truncate) or easiest, so a size that fits them can run out of memory later. Find the batch "
                "size without the curriculum (on the unwrapped DataModule: full-length batches), then fit with it",
            ),
        ),
    )

    def __init__(
        self,
        metrics: Mapping[str, Any] | None = None,
        seed: int = 1234,
        num_epochs: int = 1000,
        rounding: str = "clamped",
        percentile_rounding: str = "deepspeed",
        dp_split: str = "balanced",
        drop_last: bool = False,
        truncate_keys: Sequence[str] | None = None,
        causal_label_shift: bool = False,
        keep_last_token: bool = False,
        truncation_side: str = "right",
        analysis_batch_size: int = 256,
        total_tokens: int | None = None,
        strict: bool = True,
        nonfinite_loss: str = "raise",
        analysis_collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        given = given_settings(locals())  # first: the arguments as given (lightning_effi.core.settings)
        super().__init__()
        self.nonfinite_guard = NonFiniteLossGuard(type(self).__name__, nonfinite_loss)
        self.config: CurriculumConfig | None = None
        opts: dict[str, Any] = dict(
            seed=seed,
            num_epochs=num_epochs,
            rounding=rounding,
            percentile_rounding=percentile_rounding,
            dp_split=dp_split,
            drop_last=drop_last,
            causal_label_shift=causal_label_shift,
            keep_last_token=keep_last_token,
            truncation_side=truncation_side,
        )
        if truncate_keys is not None:
            opts["truncate_keys"] = truncate_keys
        if metrics:
            self.config = CurriculumConfig(metrics=metrics, **opts)
        else:
            changed = sorted(k for k, v in opts.items() if k == "truncate_keys" or v != _OPTION_DEFAULTS[k])
            if changed:
                raise CurriculumConfigError(
                    f"Curriculum: options {changed} given without metrics; pass them with "
                    "the metrics (to Curriculum or to CurriculumDataModule)"
                )
        strict = check_bool("Curriculum", "strict", strict, error=CurriculumConfigError)
        self.analysis_batch_size = check_int(
            "Curriculum", "analysis_batch_size", analysis_batch_size, 1, error=CurriculumConfigError
        )
        self.strict = strict
        if analysis_collate_fn is not None and not callable(analysis_collate_fn):
            raise CurriculumConfigError(
                f"Curriculum: analysis_collate_fn must be a callable (a collate function: a list of samples -> a "
                f"batch) or None (the training loader's), got {analysis_collate_fn!r}"
            )
        self.analysis_collate_fn = analysis_collate_fn
        self._batch_in_flight: Any = None  # the training batch between on_train_batch_start and its end
        self._accumulation_watch: BatchesPerStep | None = None  # manual optimization: accumulation by hand?
        self.total_tokens: int | None = None
        if total_tokens is not None:
            self.total_tokens = check_int("Curriculum", "total_tokens", total_tokens, 1, error=CurriculumConfigError)
            self.effi_progress = functools.partial(self.token_progress, self.total_tokens)  # picklable (ddp_spawn)
        self.controller: CurriculumController | None = None
        #: the CurriculumDataModule this fit attached the controller to (detached at the fit's end)
        self._datamodule: CurriculumDataModule | None = None
        self.consumed_tokens = 0
        self._warned_other_tokens = False  # consumed_tokens read integer ids beside features of another length
        self._pending: tuple[int, int, dict[str, int], int] | None = None
        self._backward_seen = False  # the batch in flight has had a backward (on_before_backward)
        self._ended_early: int | None = None  # the step of a batch committed before its on_train_batch_end
        self._tokens_through_current = 0
        self._loaded: dict[str, Any] | None = None
        self._restored = False  # this fit restored a curriculum state (a checkpoint, or load_state_dict by hand)
        #: the optimizer step this fit resumed at from a checkpoint without curriculum state (None: it did not); the
        #: run record marks the technique ``added_on_resume`` (``lightning_effi.report.record.make_record``)
        self.effi_added_on_resume: int | None = None
        self.last_difficulties: dict[str, int] = {}
        # the current batch before seqlen_truncate (its cl_full_length, cl_cut_mask, cl_cut_left, cl_cut_axes), for
        # effi_baseline
        self._full_length: int | None = None
        self._cut_mask: torch.Tensor | None = None
        self._cut_left = False
        self._cut_axes: dict[Any, tuple[int, ...]] | None = None
        self._cut_mask_path: tuple[Any, ...] | None = None
        self._cut_values: dict[Any, torch.Tensor] | None = None
        keep_settings(self, Curriculum, given)

    @classmethod
    def from_config(cls, config: CurriculumConfig, **kwargs: Any) -> Curriculum:
        """A curriculum with ``config``'s metrics and options, e.g. a DeepSpeed config read by
        :func:`~lightning_effi.curriculum.parse_deepspeed_config`::

            Curriculum.from_config(parse_deepspeed_config(ds_config), total_tokens=...)

        Args:
            config: a :class:`~lightning_effi.curriculum.CurriculumConfig`. kwargs: the callback's own arguments
                (``analysis_batch_size``, ``analysis_collate_fn``, ``total_tokens``, ``strict``, ``nonfinite_loss``).

        Raises:
            CurriculumConfigError: ``config`` is not a ``CurriculumConfig`` (``parse_deepspeed_config`` returns None
                for a config whose curriculum is disabled), or ``kwargs`` names a setting the config holds.
        """
        if not isinstance(config, CurriculumConfig):
            raise CurriculumConfigError(
                f"Curriculum.from_config: expected a CurriculumConfig, got {type(config).__name__} "
                "(parse_deepspeed_config returns None when the config's curriculum_learning is disabled)"
            )
        held = sorted(set(kwargs) & {"metrics", *_OPTION_DEFAULTS})
        if held:
            raise CurriculumConfigError(
                f"Curriculum.from_config: {held} are the config's; change them in the config (or pass them to "
                "parse_deepspeed_config as options)"
            )
        args: dict[str, Any] = {"metrics": {name: _metric_arguments(m) for name, m in config.metrics.items()}}
        args.update({k: getattr(config, k) for k in _OPTION_DEFAULTS})
        args["truncate_keys"] = None if config.truncate_keys is None else list(config.truncate_keys)
        return cls(**args, **kwargs)

    def _arguments(self) -> dict[str, Any]:
        """The constructor arguments of this callback, in order (the metrics as parsed, unset optional keys left
        out; ``truncate_keys`` ``None`` when it is the default)."""
        c = self.config
        if c is None:
            out: dict[str, Any] = {"metrics": None, **_OPTION_DEFAULTS}
        else:
            out = {"metrics": {name: _metric_arguments(m) for name, m in c.metrics.items()}}
            out.update({k: getattr(c, k) for k in _OPTION_DEFAULTS})
            out["truncate_keys"] = None if c.truncate_keys is None else list(c.truncate_keys)
        out.update(
            analysis_batch_size=self.analysis_batch_size,
            total_tokens=self.total_tokens,
            strict=self.strict,
            nonfinite_loss=self.nonfinite_guard.policy,
            analysis_collate_fn=self.analysis_collate_fn,
        )
        return out

    def effi_settings(self) -> dict[str, Any]:
        """The constructor arguments (:meth:`_arguments`), for the run record (``write_result``)."""
        return self._arguments()

    def __repr__(self) -> str:
        return f"Curriculum({', '.join(f'{k}={v!r}' for k, v in self._arguments().items())})"

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key()

    def wrap_datamodule(self, datamodule: pl.LightningDataModule) -> pl.LightningDataModule:
        """``CurriculumDataModule(datamodule)`` unless ``datamodule`` or a DataModule it wraps is one already (used by
        the Hydra app, which calls every callback's ``wrap_datamodule`` in order: with InfoBatch either nesting
        results, and both train identically)."""
        return datamodule if find_wrapper(datamodule, CurriculumDataModule) else CurriculumDataModule(datamodule)

    # ------------------------------------------------------------------------------------------------- setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # settings set on the callback since it was built (lightning_effi.core.settings)
            apply_changed_settings(self, trainer)
        if stage != "fit":
            return
        check_trainer(trainer)
        dm = find_wrapper(trainer.datamodule, CurriculumDataModule)  # the outermost wrapper or a nested one
        if dm is None:
            got = trainer.datamodule
            raise CurriculumConfigError(
                "Curriculum needs trainer.fit(..., datamodule=CurriculumDataModule(your_datamodule)); got "
                f"{type(got).__name__ if got is not None else 'no datamodule'}"
            )
        if self.config is not None and dm.config is not None:
            raise CurriculumConfigError(
                "curriculum configured twice: give metrics to Curriculum(...) or to CurriculumDataModule(...), not both"
            )
        config = self.config or dm.config
        if config is None:
            raise CurriculumConfigError(
                "curriculum has no metrics: pass metrics={...} to Curriculum(...) or to CurriculumDataModule(...)"
            )
        if trainer.world_size > 1 and uses_distributed_sampler(trainer):
            raise CurriculumConfigError(
                "Curriculum under DDP needs Trainer(use_distributed_sampler=False): its batch sampler shards by rank "
                "itself, and Lightning would inject a DistributedSampler into it"
            )
        # a fresh fit starts from a fresh stream; a checkpoint's state arrives later through load_state_dict
        self.consumed_tokens, self._tokens_through_current, self.last_difficulties = 0, 0, {}
        self._warned_other_tokens = False
        self._pending, self._ended_early = None, None
        self._full_length, self._cut_mask, self._cut_left, self._cut_axes = None, None, False, None
        self._cut_mask_path, self._cut_values = None, None
        self.nonfinite_guard.count, self.nonfinite_guard.first_step = 0, None
        self._restored, self.effi_added_on_resume = False, None
        template = dm.template()
        dataset, n = template["dataset"], template["length"]
        if n < 1:
            raise CurriculumConfigError("curriculum: the training set is empty")
        if "seqlen_truncate" in config.metrics and config.truncate_keys is None:
            _refuse_encoder_decoder(pl_module)
        if set(TRANSFORM_METRICS) & set(config.metrics):
            check = (
                functools.partial(_warn_channel_first_window, config) if "seqlen_truncate" in config.metrics else None
            )
            length = data_sequence_length(dataset, template["collate_fn"], n, config.truncate_keys, check)
            # no one length (per-batch padding): the longest batch bounds the range. Probes of one length are
            # confirmed by the same pass: rows of two lengths, every probed row short, read as one-length data
            # refused the data's real longest batch (qa106-user 02)
            longest = self._longest_sequence(trainer, dataset, template["collate_fn"], n, config.truncate_keys)
            if length is not None and longest is not None and longest > length:
                length = None
            if length is not None or longest is not None:
                try:
                    messages = config.check_data_length(length or longest, one_length=length is not None)
                except CurriculumConfigError as err:
                    raise CurriculumConfigError(
                        f"{err}{_length_source(config, dataset, template['collate_fn'])}"
                    ) from None
                for message in messages:
                    rank_zero_warn(f"Curriculum: {message}")
        indexes = self._indexes(config, dataset, template["collate_fn"], n)
        if trainer.world_size > 1:
            self._check_same_indexes(trainer, indexes)
        self.controller = CurriculumController(
            config,
            indexes,
            n,
            micro_batch_size=int(template["batch_size"]),
            dp_size=trainer.world_size,
            dp_rank=trainer.global_rank,
            # a GradientAccumulationScheduler's factor (one for the whole run: a changing one is refused) is set on
            # the Trainer only at the first epoch's start
            grad_accum=accumulate_grad_batches_at(trainer, 0),
        )
        dm.controller = self.controller
        self._datamodule = dm
        if self._loaded is not None:  # load_state_dict called before this fit's setup (by hand)
            self._apply(self._loaded)
            self._loaded = None
        c = self.controller
        if pl_module.automatic_optimization:  # manual: its steps per batch are known at train start
            self._check_budget(trainer)
        rank_zero_info(
            f"Curriculum: N={n}, global batch {c.global_batch} ({c.mbs} x {c.dp} ranks x {c.ga} "
            f"accumulation), {len(c)} micro-batches per data epoch, metrics {list(config.metrics)}"
        )

    @staticmethod
    def _longest_sequence(
        trainer: pl.Trainer, dataset: Any, collate_fn: Any, n: int, keys: Sequence[str] | None
    ) -> int | None:
        """:func:`~lightning_effi.curriculum.data.data_longest_sequence`, read once: under DDP global rank zero
        reads the training set and broadcasts the length (every rank trains on the same set, so each rank reading it
        would read it ``world_size`` times, costly for a set that tokenizes or decodes on access)."""
        longest = data_longest_sequence(dataset, collate_fn, n, keys) if trainer.global_rank == 0 else None
        if trainer.world_size > 1:
            longest = trainer.strategy.broadcast(longest, src=0)
        return longest

    def _indexes(self, config: CurriculumConfig, dataset: Any, collate_fn: Any, n: int) -> dict[str, Any]:
        from lightning_effi.curriculum.analysis.index import MetricIndex

        out = {}
        for name, m in config.metrics.items():
            if not m.schedule_based:
                continue
            if m.analysis is not None:
                try:
                    collate = self.analysis_collate_fn if self.analysis_collate_fn is not None else collate_fn
                    values = analyze_in_memory(dataset, m.analysis, collate, self.analysis_batch_size)
                except CurriculumConfigError as err:
                    raise CurriculumConfigError(f"curriculum_metrics.{name}: {err}") from None
                if len(values) != n:
                    raise CurriculumConfigError(
                        f"curriculum_metrics.{name}: analysis returned {len(values)} values for {n} samples"
                    )
                idx = MetricIndex.from_sample_to_metric(values)
            else:
                metric_path = m.index_to_metric_path
                if (
                    m.difficulty_type == "percentile"
                    and metric_path is not None
                    and str(m.index_to_sample_path).endswith("_percentile_merged")
                ):
                    # DeepSpeed reads index_to_metric for value metrics only; Megatron-DeepSpeed's BERT script gives
                    # a merged index (rows of several values) with it: refused as "from another analysis" (its rows
                    # are fewer; qa108-break 02)
                    rank_zero_warn(
                        f"Curriculum: curriculum_metrics.{name}.index_to_metric_path is not read for a percentile "
                        "metric whose index_to_sample_path is a _percentile_merged index (its rows merge several "
                        "values), as in DeepSpeed"
                    )
                    metric_path = None
                idx = _load_index(name, m.index_to_sample_path, metric_path, n, dataset)
            if m.difficulty_type == "value" and idx.values is None:
                raise CurriculumConfigError(
                    f"curriculum_metrics.{name}: difficulty_type 'value' needs per-row values "
                    "(index_to_metric); a _percentile_merged index is only valid for "
                    "'percentile'"
                )
            out[name] = idx
        return out

    @staticmethod
    def _check_same_indexes(trainer: pl.Trainer, indexes: Mapping[str, Any]) -> None:
        digest = int(indexes_fingerprint(indexes)[:15], 16)
        local = torch.tensor([digest], dtype=torch.int64, device=trainer.strategy.root_device)
        everyone = trainer.strategy.all_gather(local).reshape(-1).tolist()
        if len(set(everyone)) != 1:
            raise CurriculumConfigError(
                f"curriculum: the analysis indexes differ between ranks (hashes {everyone}); "
                "every rank must read the same index files"
            )

    # ---------------------------------------------------------------------------------------------- batches
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Refuse the Lightning features visible only now (``core.requirements.check_started``); refuse a fit that
        starts at ``global_step > 0`` without curriculum state (:meth:`_check_start`); warn (rank zero) about
        schedules that do nothing or do not reach ``max_difficulty`` within the run (:meth:`_warn_schedules`).

        Raises:
            CurriculumConfigError: see :meth:`_check_start`.
        """
        check_started(trainer)
        self._accumulation_watch = None
        if not pl_module.automatic_optimization:
            self._check_manual_steps(trainer)
            if len(trainer.optimizers) <= 1:
                self._accumulation_watch = BatchesPerStep()
        self._check_start(trainer)
        self._warn_schedules(trainer)
        self._warn_limited_epochs(trainer)
        self._warn_estimated_steps(trainer)

    def _warn_estimated_steps(self, trainer: pl.Trainer) -> None:
        """Warn (rank zero) when a run bounded by epochs ends, at the end of the sample budget ``N x num_epochs``,
        before ``trainer.estimated_stepping_batches``: Lightning estimates ``max_epochs x ceil(batches of an epoch /
        accumulate_grad_batches)`` steps, which overshoots where ``N`` is not a multiple of the global batch (the
        stream continues across epochs, so no epoch ends with a partial step) or ``num_epochs < max_epochs``. A
        step-interval LR schedule sized by the estimate (``OneCycleLR(total_steps=...)``) would not finish its
        anneal."""
        c = self.controller
        estimated = trainer.estimated_stepping_batches
        if c is None or trainer.max_steps not in (-1, None) or not math.isfinite(estimated):
            return
        if not trainer.lightning_module.automatic_optimization and len(trainer.optimizers) > 1:
            return  # global_step counts every optimizer.step(): said by _check_manual_steps, in that unit
        if c.total_steps < int(estimated):
            rank_zero_warn(
                f"Curriculum: the sample budget N x num_epochs = {c.n} x {c.config.num_epochs} = {c.total_samples} "
                f"samples ends this run at {c.total_steps} optimizer steps of {c.global_batch} samples, while "
                f"trainer.estimated_stepping_batches is {int(estimated)}: an LR schedule sized by the estimate "
                "(OneCycleLR(total_steps=trainer.estimated_stepping_batches), a cosine decay) would stop "
                f"{int(estimated) - c.total_steps} steps short of its end. Set max_steps={c.total_steps} (the "
                "estimate then reads it), or size the schedule by the curriculum's total_tokens progress"
            )

    def _warn_limited_epochs(self, trainer: pl.Trainer) -> None:
        """Warn (rank zero) when ``Trainer(limit_train_batches=...)`` cuts an epoch to ``K`` batches that do not divide
        the data epoch's ``M`` micro-batches: the curriculum's loader ends a Lightning epoch at the end of its data
        epoch too, so the epochs train ``K, ..., K, M mod K`` batches, and a ``max_epochs``-bound run trains fewer
        steps than ``max_epochs x K`` (epoch-interval schedulers and ``check_val_every_n_epoch`` see short epochs)."""
        c = self.controller
        limited = trainer.num_training_batches
        if c is None or not isinstance(limited, int) or limited <= 0:
            return
        full = c.epoch_micro
        if limited >= full or full % limited == 0:
            return
        pattern = [limited] * (full // limited) + [full % limited]
        rank_zero_warn(
            f"Curriculum: limit_train_batches={trainer.limit_train_batches} cuts an epoch to {limited} batches, and "
            f"the curriculum ends an epoch at the end of its data epoch ({full} micro-batches) as well: the epochs "
            f"train {pattern} batches, over and over, so max_epochs={trainer.max_epochs} trains fewer than "
            f"max_epochs x {limited} steps; bound the run by max_steps, or use a limit that divides {full}"
        )

    def _check_budget(self, trainer: pl.Trainer) -> None:
        """Refuse a ``max_steps`` or a ``min_steps`` beyond the sample budget ``N x num_epochs`` (the curriculum's
        stream ends there: Lightning would run empty epochs for a ``min_steps`` it never reaches, forever with
        ``max_epochs=-1``), and a ``min_epochs`` above ``num_epochs`` (without ``limit_train_batches``, whose shorter
        epochs make more of them); a minimum only where it acts: not with ``max_steps`` set (within the budget), nor
        where ``max_epochs`` ends the fit within ``num_epochs`` (Lightning's maximum ends a fit whatever the
        minimum).

        Raises:
            CurriculumConfigError: naming both figures.
        """
        c = self.controller
        assert c is not None
        if trainer.fast_dev_run:
            return
        budget = (
            f"the sample budget N x num_epochs = {c.n} x {c.config.num_epochs} = {c.total_samples} samples = "
            f"{c.total_steps} optimizer steps of {c.global_batch}"
        )
        if trainer.max_steps not in (-1, None) and trainer.max_steps > c.total_steps:
            raise CurriculumConfigError(
                f"curriculum: trainer.max_steps={trainer.max_steps} exceeds {budget}; raise num_epochs or lower "
                "max_steps"
            )
        # a minimum acts only below the run's maximum (Lightning's max_steps / max_epochs end a fit whatever its
        # min_steps / min_epochs): one above it is no empty epoch (qa110-loops 01)
        bounded_steps = trainer.max_steps not in (-1, None)
        max_epochs = trainer.max_epochs if trainer.max_epochs not in (-1, None) else None
        # the most optimizer steps max_epochs trains: a Lightning epoch ends at a data epoch's end, or earlier at
        # limit_train_batches (Lightning epochs, not data epochs: qa112-regress 03)
        limit = trainer.limit_train_batches
        per_epoch = c.epoch_micro
        if isinstance(limit, int) and not isinstance(limit, bool):
            per_epoch = min(per_epoch, limit)
        elif isinstance(limit, float) and limit < 1.0:
            per_epoch = max(1, min(per_epoch, int(per_epoch * limit)))
        epochs_steps = None if max_epochs is None else max_epochs * math.ceil(per_epoch / c.ga)
        min_steps = trainer.fit_loop.min_steps
        if (
            min_steps is not None
            and not bounded_steps
            and (epochs_steps is None or epochs_steps > c.total_steps)
            and min_steps > c.total_steps
        ):
            raise CurriculumConfigError(
                f"curriculum: trainer.min_steps={min_steps} exceeds {budget}: the fit would go on with empty epochs "
                "after the stream ends (forever with max_epochs=-1); raise num_epochs or lower min_steps"
            )
        # each epoch ends at a data epoch's end (without limit_train_batches, one epoch per data epoch)
        min_epochs = trainer.fit_loop.min_epochs
        full_epochs = isinstance(trainer.limit_train_batches, float) and trainer.limit_train_batches == 1.0
        if (
            min_epochs is not None
            and full_epochs
            and not bounded_steps
            and min(min_epochs, max_epochs or min_epochs) > c.config.num_epochs
        ):
            raise CurriculumConfigError(
                f"curriculum: trainer.min_epochs={min_epochs} exceeds the sample budget's {c.config.num_epochs} data "
                f"epochs (num_epochs; {budget}): the epochs after the stream ends would train nothing; raise "
                "num_epochs or lower min_epochs"
            )

    def _check_manual_steps(self, trainer: pl.Trainer) -> None:
        """Under manual optimization Lightning's ``global_step`` counts every ``optimizer.step()``: with one optimizer
        stepped once a batch it counts batches, and the budget check applies; with several it does not (the
        curriculum's schedule and its budget count global batches, ``trainer.max_steps``, random-LTD's and the
        V-cycle's schedules count ``global_step``), said in a warning instead of a refusal in a unit that does not
        apply."""
        optimizers = len(trainer.optimizers)
        if optimizers <= 1:
            self._check_budget(trainer)
            return
        rank_zero_warn(
            f"Curriculum: manual optimization with {optimizers} optimizers: trainer.global_step (and so "
            "trainer.max_steps) counts every optimizer.step() call, while the curriculum's schedule "
            "(total_curriculum_step) and its sample budget count global batches; with each optimizer stepped once a "
            f"batch, max_steps={trainer.max_steps} is {optimizers}x the batches trained. Other techniques' "
            "schedules (random-LTD's require_steps, the V-cycle's stages) count global_step: size them in that unit"
        )

    def _warn_accumulation_by_hand(self, trainer: pl.Trainer) -> None:
        """Under manual optimization with one optimizer stepped every ``k`` batches (gradients accumulated by hand),
        warn once (rank zero): the curriculum draws one global batch per training batch (Lightning's
        ``accumulate_grad_batches`` is 1 under manual optimization), so its schedule and its budget count batches,
        ``k`` a step, and the micro-batches of one optimizer step are drawn at difficulties of their own (the
        schedule reached its end after 3 optimizer steps for 6, qa45-break 02)."""
        watch = self._accumulation_watch
        if watch is None:
            return
        found = watch.batch_end(trainer)
        if watch.done:
            self._accumulation_watch = None
        if found is None or found[0] != "batches":
            return
        k = found[1]
        rank_zero_warn(
            f"Curriculum: manual optimization stepped the optimizer once every {k} batches (gradients accumulated by "
            "hand), while the curriculum, under manual optimization, draws one global batch per training batch: its "
            f"schedule (total_curriculum_step, difficulty_step) and its sample budget count batches, {k} an optimizer "
            f"step, so it runs {k} times as fast as trainer.global_step and the {k} micro-batches of one step are "
            "drawn at difficulties of their own. Give the schedule in batches (the optimizer steps you mean x "
            f"{k}), or let Lightning accumulate (automatic optimization with Trainer(accumulate_grad_batches={k}): "
            "one difficulty per optimizer step)"
        )

    def _check_start(self, trainer: pl.Trainer) -> None:
        """A fit that starts at ``global_step > 0`` with no curriculum state restored (the checkpoint's state and the
        global step are both restored before ``on_train_start``):

        - without ``ckpt_path`` (a second ``trainer.fit()`` on a Trainer that trained before, e.g. with a raised
          ``max_steps``): refused. ``setup`` lays the stream out afresh, so the fit would draw again, from
          curriculum step 1, the batches and difficulties its earlier steps trained (the stream is a function of the
          seed and the curriculum step), while ``global_step`` goes on.
        - with ``ckpt_path`` (a checkpoint written by a fit without the curriculum): the curriculum starts at its
          step 1 (min difficulty) on the resumed weights, as documented; a warning says so, with the steps.

        Raises:
            CurriculumConfigError: the first case, naming the step and the remedies (resume from a checkpoint with
                ``ckpt_path``, or a fresh Trainer and callback).
        """
        step = int(trainer.global_step)
        if self.controller is None or self._restored or step == 0:
            return
        first = self.controller.first_difficulties()
        if getattr(trainer, "ckpt_path", None):
            self.effi_added_on_resume = step
            rank_zero_warn(
                f"Curriculum: resumed at optimizer step {step} from a checkpoint without curriculum state (written by "
                f"a fit without this callback): the curriculum starts at its step 1 (difficulties {first}) on the "
                f"resumed weights, its schedules counting from this resume (curriculum step s = optimizer step "
                f"{step} + s - 1), not from optimizer step 0. Resume from a checkpoint written with the Curriculum to "
                "continue its stream"
            )
            return
        raise CurriculumConfigError(
            f"Curriculum: this fit starts at optimizer step {step} without curriculum state (its Trainer trained "
            f"before: a second trainer.fit() on the same Trainer), but the curriculum's stream is laid out afresh at "
            f"every fit: from optimizer step {step} on it would train again the samples and difficulties (from "
            f"{first}) that optimizer steps 0, 1, ... trained, while global_step goes on. Resume "
            "from a checkpoint instead (trainer.fit(..., ckpt_path=...) with a checkpoint this run wrote, e.g. "
            "ckpt_path='last' with ModelCheckpoint(save_last=True)), or fit with a fresh Trainer and a fresh "
            "Curriculum callback (the curriculum then starts over at step 0)"
        )

    def _warn_schedules(self, trainer: pl.Trainer) -> None:
        """Warn (rank zero) once per metric about a schedule that does nothing or does not reach ``max_difficulty``
        within the run (:meth:`~lightning_effi.curriculum.CurriculumConfig.reach_warnings`). The run's optimizer
        steps are :func:`~lightning_effi.core.progress.run_length` of ``max_steps`` and
        ``estimated_stepping_batches`` (the sample budget's steps at most); its last optimizer step trains curriculum
        step ``s0 + (run - global_step)``, with ``s0`` the curriculum steps already trained (a resumed stream)."""
        c = self.controller
        if c is None:
            return
        total = run_length(trainer.max_steps, trainer.estimated_stepping_batches)
        done = int(c.committed["micro"]) // c.ga  # curriculum steps already trained in full (a resumed stream)
        last, run = None, ""
        if total is not None and not trainer.fast_dev_run:
            last = done + max(0, total - int(trainer.global_step))
            run = f"the last of a run of {total} optimizer steps"
            if trainer.global_step:
                run += f" resumed at optimizer step {trainer.global_step}"
            if last > c.total_steps:
                last = c.total_steps
                run = (
                    f"the sample budget N x num_epochs = {c.total_samples} samples ends the run there, at "
                    f"{c.total_steps} steps of {c.global_batch}"
                )
        for message in c.config.reach_warnings(done + 1, last, run):
            rank_zero_warn(f"Curriculum: {message}")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.controller is None:
            return
        if self._accumulation_watch is not None:
            self._accumulation_watch.batch_start(trainer)
        meta = batch_meta(trainer) or {}
        if any(k not in meta for k in BATCH_KEYS):
            raise CurriculumConfigError(
                "Curriculum: the training batch does not come from the CurriculumDataModule's loader (it carries "
                f"none of the curriculum's batch metadata {list(BATCH_KEYS)})"
            )
        (
            step,
            micro,
            difficulty,
            self._full_length,
            self._cut_mask,
            cut_left,
            self._cut_axes,
            self._cut_mask_path,
            self._cut_values,
        ) = (meta[k] for k in BATCH_KEYS)
        self._cut_left = bool(cut_left)
        tokens = self._batch_tokens(batch, pl_module)
        if trainer.world_size > 1:
            t = torch.tensor(float(tokens), device=trainer.strategy.root_device)
            tokens = int(trainer.strategy.reduce(t, reduce_op="sum").item())
        self._pending = (int(step), int(micro), dict(difficulty), int(tokens))
        self._backward_seen = False
        self._tokens_through_current = self.consumed_tokens + int(tokens)
        self._batch_in_flight = batch

    def effi_nonfinite_hint(self, trainer: pl.Trainer) -> str | None:
        """Why the batch in flight may have a non-finite loss that the curriculum caused, for the non-finite loss
        policy's message (:class:`~lightning_effi.core.nonfinite.NonFiniteLossGuard`): ``seqlen_truncate`` cut it to
        positions whose ``labels`` are all ``-100`` (ignored), e.g. the prompt of a prompt-masked fine-tuning batch,
        so a mean over its labelled tokens is ``0 / 0``. None otherwise."""
        batch = self._batch_in_flight
        if batch is None or self.controller is None or "seqlen_truncate" not in self.controller.config.metrics:
            return None
        labels = next((v for path, v in tensor_leaves(batch) if path and path[-1] == "labels"), None)
        if labels is None or labels.is_floating_point() or not labels.numel() or not bool((labels == -100).all()):
            return None
        length = F.sequence_length(batch, self.controller.config.truncate_keys)
        return (
            f"the curriculum's seqlen_truncate cut this batch to {length} of its {self._full_length} tokens, and every "
            "label left is -100 (ignored), so a mean over its labelled tokens is 0/0: with targets after a prompt "
            "(prompt-masked fine-tuning), raise seqlen_truncate's min_difficulty above the prompts' length"
        )

    def _batch_tokens(self, batch: Any, pl_module: pl.LightningModule) -> int:
        """The tokens of a training batch, for ``consumed_tokens`` and the ``total_tokens`` progress: the module's
        ``effi_count_tokens(batch)`` when it defines one, else the batch's real tokens
        (:func:`~lightning_effi.core.accounting.tokens_of`: the attention mask, or the token ids); a batch without
        token ids (continuous features, ``truncate_keys``) counts the positions of its sequence axis, ``B x T``, as
        the EfficiencyMonitor does.

        Raises:
            CurriculumConfigError: ``total_tokens`` is set and the batch has no tokens to count (no ids, no sequence
                axis, and no ``effi_count_tokens``): the progress would stay at 0.
        """
        count = getattr(pl_module, "effi_count_tokens", None)
        if callable(count):
            return int(count(batch))
        source = token_source(batch)
        if source is not None:
            keys = ("input_ids", *(self.controller.config.truncate_keys or ())) if self.controller else ("input_ids",)
            named_ids = any(v is source[1] and path and path[-1] in keys for path, v in tensor_leaves(batch))
            if source[0] == "ids" and source[1].ndim == 2 and not named_ids and not self._warned_other_tokens:
                # ids named input_ids or in truncate_keys are the tokens (a vision-language batch's visual_embeds
                # beside them, qa50-break 02, 06); another integer tensor beside float features may be CTC targets
                other = F.other_sequences(batch, int(source[1].shape[0]), int(source[1].shape[1]))
                if other:  # CTC targets beside audio frames were counted as the tokens (qa48-speech 05)
                    self._warned_other_tokens = True
                    shown = ", ".join(f"{'.'.join(map(str, p)) or 'batch'!r} {list(v.shape)}" for p, v in other)
                    message = (
                        f"Curriculum: consumed_tokens counts the batch's integer {list(source[1].shape)} tensor as "
                        f"its tokens, beside {shown}, a sequence of another length (audio or other features beside "
                        "their CTC targets?); define `effi_count_tokens(batch) -> int` on your LightningModule to "
                        "count the positions your model trains on"
                    )
                    if self.total_tokens is not None:
                        raise CurriculumConfigError(
                            f"{message}: Curriculum(total_tokens={self.total_tokens}) would follow that count"
                        )
                    rank_zero_warn(message)
            return int(tokens_of(batch))
        assert self.controller is not None
        seq = F.sequence_length(batch, self.controller.config.truncate_keys)
        size = batch_size_of(batch) if seq else None
        tokens = int(seq * size) if seq and size else 0
        if tokens == 0 and self.total_tokens is not None:
            raise CurriculumConfigError(
                f"Curriculum(total_tokens={self.total_tokens}): the training batch has no tokens to count (no "
                "attention_mask, no integer [B, T] token ids, no sequence tensor), so the token progress would stay "
                "at 0; define `effi_count_tokens(batch) -> int` on your LightningModule, or leave total_tokens unset"
            )
        return tokens

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        """The non-finite loss policy (``nonfinite_loss``): stop before the backward pass of a NaN / infinite loss
        (``"raise"``), or count it (``"warn"``).

        Raises:
            NonFiniteLossError: a non-finite loss under ``"raise"``.
        """
        self.nonfinite_guard.check(trainer, loss)
        self._backward_seen = True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batch_in_flight = None
        if self.controller is None:
            return
        self._warn_accumulation_by_hand(trainer)
        if self._pending is not None:
            self._end_batch(trainer)
        elif self._ended_early is None:
            return
        step, self._ended_early = self._ended_early, None
        difficulty = self.last_difficulties
        logs = {f"effi/curriculum/{name}_difficulty": float(d) for name, d in difficulty.items()}
        stats = self.controller.stats(step)
        if stats is not None:
            logs["effi/curriculum/eligible_samples"] = float(stats[0])
            logs["effi/curriculum/num_clusters"] = float(stats[1])
        logs["effi/curriculum/consumed_tokens"] = float(self.consumed_tokens)
        pl_module.log_dict(logs, on_step=True, on_epoch=False, prog_bar=False, logger=True, rank_zero_only=True)
        self.nonfinite_guard.log_count(trainer)  # effi/nonfinite_losses, by the stack's checking guard only

    def _end_batch(self, trainer: pl.Trainer) -> None:
        """Commit the trained batch: the stream's position, the consumed tokens, the last difficulties; stop the fit
        when the sample budget is spent. ``_ended_early`` keeps its step for the logging in ``on_train_batch_end``.
        A batch the ``training_step`` skipped (it returned None: no backward) moves the stream on, as it was drawn,
        but its tokens were not trained and are not counted (they were, and ``total_tokens``' progress ran ahead of
        the training, qa54-extras 03)."""
        assert self.controller is not None and self._pending is not None
        step, micro, difficulty, tokens = self._pending
        self._pending = None
        self.controller.commit(step, micro)
        if self.controller.exhausted:
            rank_zero_info(
                f"Curriculum: the sample budget ({self.controller.total_samples} samples) is spent; stopping the fit"
            )
            trainer.should_stop = True
        if not open_batch_skipped(trainer, trainer.lightning_module, self._backward_seen):
            self.consumed_tokens += tokens
        self.last_difficulties = difficulty
        self._ended_early = step

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A checkpoint written inside ``on_train_batch_end`` before this callback's own (a user's callback calling
        ``trainer.save_checkpoint`` there, listed before the curriculum) resumes after the batch: the batch is
        committed now and the state written with it (it was written one batch behind, and the resumed fit trained
        the stream's steps one step late, qa38-break 01)."""
        if self._pending is not None and self.controller is not None and saving_in_train_batch_end(trainer):
            self._end_batch(trainer)
            callbacks = checkpoint.get("callbacks")
            if isinstance(callbacks, dict) and self.state_key in callbacks:
                callbacks[self.state_key] = self.state_dict()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """(Rank zero) report the non-finite losses counted under ``nonfinite_loss="warn"``."""
        self.nonfinite_guard.report_at_end()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """The fit raised: forget the batch in flight (not committed: its tokens are not counted, its difficulty is not
        the last one; the stream position stays the last committed batch's, as a checkpoint written then records).
        A batch that trained, whose ``on_train_batch_end`` raised in a callback before this one, is committed:
        Lightning resumes a checkpoint written now (``OnExceptionCheckpoint``) after it (qa39-break 06)."""
        if self._pending is not None and self.controller is not None and saving_in_train_batch_end(trainer):
            self._end_batch(trainer)
        self._pending, self._ended_early = None, None
        self._tokens_through_current = self.consumed_tokens
        self._full_length, self._cut_mask, self._cut_left, self._cut_axes = None, None, False, None
        self._cut_mask_path, self._cut_values = None, None
        self._detach()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._detach()

    def _detach(self) -> None:
        """The end of a fit, normal or not: the CurriculumDataModule forgets this callback's controller, so a later
        fit of it without the Curriculum callback is refused (it trained the stream's last batches over and over,
        with nothing advancing them) and a later fit with one attaches that one's. The controller stays this
        callback's (its state, ``stats``). Idempotent."""
        dm, self._datamodule = self._datamodule, None
        if dm is not None and dm.controller is self.controller:
            dm.controller = None

    def effi_baseline(self, batch: Any, pl_module: pl.LightningModule) -> Baseline | None:
        """The current training batch as it would have been without ``seqlen_truncate``
        (:class:`~lightning_effi.core.protocols.ProvidesBaseline`, read by the
        :class:`~lightning_effi.core.accounting.EfficiencyMonitor` in ``on_train_batch_end``), any batch structure:
        the tensors the truncation cut at the untruncated length ``S`` recorded by the collate (``cl_full_length``),
        the padding mask with the values the truncation removed put back (``cl_cut_mask`` at ``cl_cut_mask_path``:
        a tuple's unnamed mask too; on the left for a left-padded batch: ``cl_cut_left``), each tensor widened on
        the axes it was cut (``cl_cut_axes``), so the module's counting hooks count the untruncated batch exactly,
        padding included (:func:`~lightning_effi.curriculum.functional.lengthen_batch`; only shapes and the mask are
        real). A batch without a padding mask (a tuple ``(ids, labels)``) counts every position. The monitor's
        difference is the curriculum's saving (``saved/curriculum/...``).

        Returns None when there is nothing to undo: no ``seqlen_truncate`` metric (``seqlen_reshape`` re-chunks
        rather than drops tokens and is not undone; the other metrics only choose samples), before ``setup``, or a
        batch the truncation left whole.
        """
        if self.controller is None or "seqlen_truncate" not in self.controller.config.metrics:
            return None
        if self._full_length is None:
            return None
        keys = self.controller.config.truncate_keys
        if (seq := F.sequence_length(batch, keys)) is None or seq >= self._full_length:
            return None
        long = F.lengthen_batch(
            batch,
            keys,
            self._full_length,
            mask=self._cut_mask,
            left=self._cut_left,
            axes=self._cut_axes or None,
            mask_path=self._cut_mask_path,
            values=self._cut_values,
        )
        return Baseline(batch=long)

    def token_progress(self, total_tokens: float) -> float:
        """Training progress in ``[0, 1]`` on the consumed-token axis, including the batch being trained (read by a
        step-interval LR scheduler, which steps before ``on_train_batch_end``). Use with
        :func:`lightning_effi.core.lr_schedules.progress_lambda` for token-based LR decay (legacy tutorial guidance)."""
        if total_tokens <= 0:
            raise ValueError(f"token_progress: total_tokens must be > 0, got {total_tokens}")
        return min(1.0, max(0.0, self._tokens_through_current / float(total_tokens)))

    @property
    def effi_run_complete(self) -> bool:
        """Whether the sample budget (``num_epochs`` of data) is spent: the fit then stops at this run's configured
        end, not early (read by :func:`lightning_effi.report.record.stopped_early`)."""
        return self.controller is not None and bool(self.controller.exhausted)

    def effi_schedule_state(self) -> dict[str, float]:
        """The difficulty of the batch being trained (else of the last one): ``{"difficulty": d}`` with one metric,
        ``{"<metric>_difficulty": d}`` with several (a sequence length in tokens for ``seqlen_truncate``). Empty
        before the first batch."""
        current = self._pending[2] if self._pending is not None else self.last_difficulties
        if len(current) == 1:
            return {"difficulty": float(next(iter(current.values())))}
        return {f"{name}_difficulty": float(d) for name, d in current.items()}

    def effi_summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"curriculum/consumed_tokens": int(self.consumed_tokens)}
        for name, d in self.last_difficulties.items():
            out[f"curriculum/{name}_difficulty"] = int(d)
        return out

    # ------------------------------------------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        if self.controller is None:
            return dict(self._loaded) if self._loaded is not None else {}
        return {
            "stream": self.controller.state_dict(),
            "consumed_tokens": int(self.consumed_tokens),
            "last_difficulties": dict(self.last_difficulties),
            "nonfinite_loss": self.nonfinite_guard.state_dict(),
            "added_on_resume": self.effi_added_on_resume,
            "total_tokens": self.total_tokens,
        }

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A resumed ``fit`` from a V-cycle checkpoint written at a coarse level needs the V-cycle
        (:func:`~lightning_effi.core.state.check_coarse_vcycle_resume`)."""
        check_coarse_vcycle_resume(type(self).__name__, trainer, checkpoint)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the committed stream position, the token count, the last difficulties, the non-finite loss
        count (a checkpoint written before the count existed restores 0) and the step the curriculum joined the run at
        when it was added on resume (``effi_added_on_resume``; None when absent). Before ``setup`` (by hand) the
        state is checked now and applied in ``setup``.

        Raises:
            CurriculumConfigError: an invalid entry, named: no ``stream``, a ``consumed_tokens`` that is not an int
                >= 0, ``last_difficulties`` that are not an int per configured metric, an ``added_on_resume`` or
                ``total_tokens`` that is neither null nor an int >= 1; (``strict``, else a warning, when applied) a
                ``total_tokens`` other than this callback's; the stream position's own errors, a changed
                configuration among them (:meth:`~lightning_effi.curriculum.CurriculumController.load_state_dict`).
            ValueError: an invalid non-finite loss count
                (:meth:`~lightning_effi.core.nonfinite.NonFiniteLossGuard.load_state_dict`).
        """
        if not state_dict:
            return
        self._check_loaded(state_dict)
        if self.controller is not None:
            self._apply(state_dict)
        else:  # before setup: applied there
            self._loaded = dict(state_dict)

    def _check_loaded(self, state: Mapping[str, Any]) -> NonFiniteLossGuard:
        """Check a checkpoint state's own entries (the stream position is the controller's to check) before anything
        is restored; returns a guard holding the checkpoint's non-finite loss count.

        Raises:
            CurriculumConfigError: naming the entry, its value and what it must be.
            ValueError: an invalid non-finite loss count (:class:`~lightning_effi.core.nonfinite.NonFiniteLossGuard`).
        """
        fix = "the checkpoint is corrupt or was edited: resume from another checkpoint, or start the run afresh"
        if not isinstance(state, Mapping) or not isinstance(state.get("stream"), Mapping):
            got = state.get("stream") if isinstance(state, Mapping) else state
            raise CurriculumConfigError(
                f"Curriculum: the checkpoint's stream must be a dict (the stream position), got {got!r}; {fix}"
            )
        tokens = state.get("consumed_tokens", 0)
        if not is_int(tokens) or tokens < 0:
            raise CurriculumConfigError(
                f"Curriculum: the checkpoint's consumed_tokens must be an int >= 0 (tokens trained so far), got "
                f"{tokens!r}; {fix}"
            )
        last = state.get("last_difficulties", {})
        if not isinstance(last, Mapping) or any(not isinstance(k, str) or not is_int(v) for k, v in last.items()):
            raise CurriculumConfigError(
                f"Curriculum: the checkpoint's last_difficulties must be a dict metric name -> int difficulty, got "
                f"{last!r}; {fix}"
            )
        added = state.get("added_on_resume")  # absent from checkpoints written before it was kept
        if added is not None and (not is_int(added) or added < 1):
            raise CurriculumConfigError(
                f"Curriculum: the checkpoint's added_on_resume must be null or an int >= 1 (the optimizer step the "
                f"curriculum joined the run at), got {added!r}; {fix}"
            )
        budget = state.get("total_tokens")
        if budget is not None and (not is_int(budget) or budget < 1):
            raise CurriculumConfigError(
                f"Curriculum: the checkpoint's total_tokens must be null or an int >= 1 (the run's token budget), got "
                f"{budget!r}; {fix}"
            )
        counted = state.get("nonfinite_loss", {})  # absent from checkpoints written before the policy existed
        if not isinstance(counted, Mapping):
            raise CurriculumConfigError(
                f"Curriculum: the checkpoint's nonfinite_loss must be a dict {{count, first_step}}, got {counted!r}; "
                f"{fix}"
            )
        guard = NonFiniteLossGuard(self.nonfinite_guard.owner, self.nonfinite_guard.policy)
        guard.load_state_dict(dict(counted))
        return guard

    def _apply(self, state: Mapping[str, Any]) -> None:
        assert self.controller is not None
        guard = self._check_loaded(state)  # every entry checked before anything changes
        saved = state.get("total_tokens", self.total_tokens)  # absent from checkpoints written before it was kept
        if saved != self.total_tokens:
            config_mismatch(
                "Curriculum",
                f"the checkpoint was written with total_tokens={saved}, this fit has total_tokens={self.total_tokens}: "
                "the token progress (effi_progress, which LR schedules and other techniques follow) would jump at "
                "the resume; resume with the same total_tokens",
                self.strict,
                fix="continue with this total_tokens",
                error=CurriculumConfigError,
            )
        self.controller.load_state_dict(state["stream"], strict=self.strict)
        self.consumed_tokens = int(state.get("consumed_tokens", 0))
        self._tokens_through_current = self.consumed_tokens
        self.last_difficulties = {k: int(v) for k, v in state.get("last_difficulties", {}).items()}
        self.nonfinite_guard.count, self.nonfinite_guard.first_step = guard.count, guard.first_step
        added = state.get("added_on_resume")
        self.effi_added_on_resume = None if added is None else int(added)  # a later resume keeps the mark
        self._restored = True


CurriculumCallback = Curriculum


def _warn_channel_first_window(config: CurriculumConfig, batch: Any, length: int) -> None:
    """Warn about a sequence tensor that reads as channel first ``[B, C, T]`` (:func:`~lightning_effi.curriculum
    .functional.channel_first_window`) in ``batch``, samples of the training set the setup check read:
    ``seqlen_truncate`` cuts axis 1, its channels, and the run would train on the first channels of every window
    while reporting the cut as the curriculum's saving (qa56-ts 03). A warning, not a refusal: the shape cannot tell
    it from batch-first features as wide as ``max_difficulty``, trained short throughout (qa58-break 01)."""
    top = config.metrics["seqlen_truncate"].max_difficulty
    found = F.channel_first_window(batch, config.truncate_keys, top)
    if found is not None:
        rank_zero_warn(
            f"Curriculum: curriculum_metrics.seqlen_truncate: the sequence tensor {found} (samples of the training "
            f"set) is read batch first, [B, S, D] with S = {length} on axis 1, the axis seqlen_truncate cuts, and "
            f"max_difficulty ({top}) is its last axis: if it is a channel-first [B, C, T] window (C channels, T "
            "steps), the run cuts its channels; hold it [B, T, C] (transpose in the data set or collate, and back "
            "in the model). If axis 1 is the sequence and the run trains short sequences throughout, ignore this"
        )


def _length_source(config: CurriculumConfig, dataset: Any, collate_fn: Any) -> str:
    """Where ``truncate_keys=None`` read the data's sequence length from, said after a refusal of the range when it
    is neither ``attention_mask`` nor ``input_ids`` (a CTC batch's ``labels`` beside its audio features: the advice
    "set max_difficulty to 5", the transcript's length, came before the refusal naming truncate_keys, qa111-audio
    03); empty otherwise."""
    if config.truncate_keys is not None:
        return ""
    try:
        batch = (collate_fn or default_collate)([dataset[0]])
    except Exception:  # noqa: BLE001 - the user's data: the loader reports its own errors
        return ""
    path = F.sequence_path(batch)
    if path is None or path.split(".")[-1] in ("attention_mask", "input_ids"):
        return ""
    return (
        f" (the data's sequence length was read from {path!r}, the batch's first integer [B, T] tensor, as "
        "truncate_keys=None reads it: if the sequence to cut is another tensor, such as audio features beside "
        "their CTC targets, name it: truncate_keys=[its name])"
    )


def _refuse_encoder_decoder(pl_module: pl.LightningModule) -> None:
    """``seqlen_truncate`` with ``truncate_keys=None`` on an encoder-decoder (a Hugging Face model whose config says
    ``is_encoder_decoder``, PyTorch's ``nn.Transformer``, or an ``nn.TransformerEncoder`` beside an
    ``nn.TransformerDecoder``): its targets (``labels``, ``decoder_input_ids``) have a length of their own, and the
    automatic rule would cut them only in the batches where that length equals the source's.

    Raises:
        CurriculumConfigError: naming the model and ``truncate_keys``.
    """
    kinds = {type(m) for m in pl_module.modules()}
    both = nn.TransformerEncoder in kinds and nn.TransformerDecoder in kinds
    for name, module in pl_module.named_modules():
        config = getattr(module, "config", None)
        # PyTorch's own nn.Transformer, or its encoder beside its decoder: their targets were cut to the source's
        # curriculum length in silence (qa50-seq2seq 01)
        own = isinstance(module, nn.Transformer) or (both and isinstance(module, nn.TransformerDecoder))
        if getattr(config, "is_encoder_decoder", False) is True or own:
            raise CurriculumConfigError(
                f"seqlen_truncate with truncate_keys=None on an encoder-decoder ({type(module).__name__} at "
                f"{name or 'the module'}): the automatic rule cuts every tensor of the batch's sequence length, and "
                "the decoder's targets (labels, decoder_input_ids) have a length of their own, so they would be cut "
                "only in the batches where it equals the source's. Name the source's tensors, as your batch holds "
                "them: truncate_keys=['input_ids', 'attention_mask'] for text; a model whose source is fixed-length "
                "audio features (Whisper pads every clip to 30 s) cannot be cut: order its samples by a difficulty "
                "metric of their duration instead"
            )


def _load_index(name: str, samples_path: Any, metric_path: Any, n: int, dataset: Any) -> Any:
    """``MetricIndex.load`` with the current dtype table, else DeepSpeed <= 0.13.2's: index files written before
    DeepSpeed 0.13.3 renumbered its dtype codes read as damaged with the current table (their pointers are those
    of the older codes' item sizes) and could not be used (qa108-break 05); read with the table whose pointers match,
    with a warning naming it. A file neither table reads raises the current table's error."""
    from lightning_effi.curriculum.analysis.index import MetricIndex
    from lightning_effi.curriculum.analysis.indexed_dataset import IndexFileError

    def structural(err: Exception) -> bool:  # the files' layout, not what they hold
        return any(word in str(err) for word in ("damaged", "pointers", "dtype code"))

    try:
        return MetricIndex.load(samples_path, metric_path, num_samples=n, dataset=dataset)
    except IndexFileError as err:
        try:
            idx = MetricIndex.load(samples_path, metric_path, num_samples=n, dataset=dataset, dtype_table="legacy")
        except IndexFileError as legacy:
            if structural(err) and not structural(legacy):  # older files, read, of another data set (qa109-regress 01)
                raise IndexFileError(f"{legacy} (read with DeepSpeed <= 0.13.2's dtype table)") from None
            raise err from None
        except Exception:  # noqa: BLE001 - not a legacy file either: the current table's error stands
            raise err from None
    rank_zero_warn(
        f"Curriculum: curriculum_metrics.{name}: the index files were read with DeepSpeed <= 0.13.2's dtype table "
        "(their dtype codes are the older numbering: files of an older DeepSpeed or Megatron-DeepSpeed analysis)"
    )
    return idx
