"""Curriculum in a Trainer: difficulty attached to each batch with prefetching workers, exact resume, evaluation
untouched, token-based LR progress, DDP sharding and setup errors, the repr, the requirements and the metadata."""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

import lightning_effi.curriculum
from lightning_effi.callbacks import Curriculum, InfoBatchCallback
from lightning_effi.core.batch import batch_meta
from lightning_effi.core.errors import DataConfigError
from lightning_effi.core.requirements import BATCH_STRUCTURES, IncompatibleTechniques, Requirements
from lightning_effi.curriculum import CurriculumConfig, CurriculumConfigError, CurriculumController
from lightning_effi.curriculum.analysis.index import MetricIndex
from lightning_effi.curriculum.analysis.metrics import register_metric
from lightning_effi.curriculum.schedules import difficulties
from lightning_effi.data import CurriculumDataModule
from tests.helpers.harness import assert_resume_equals_uninterrupted, fit_ddp, make_trainer
from tests.helpers.tiny import TinyDataModule, TokenBlocks, tiny_gpt2, tiny_lm_data


def first_token(batch):
    return batch["input_ids"][:, 0].long()


register_metric("curriculum_test_first_token", first_token)

TRUNC = dict(
    difficulty_type="value",
    clustering_type="single_cluster",
    min_difficulty=2,
    max_difficulty=16,
    schedule_type="fixed_linear",
    schedule_config=dict(total_curriculum_step=14, difficulty_step=1),
)
PCT = dict(
    difficulty_type="percentile",
    clustering_type="schedule_based",
    analysis="curriculum_test_first_token",
    min_difficulty=20,
    max_difficulty=100,
    schedule_type="fixed_linear",
    schedule_config=dict(total_curriculum_step=16, difficulty_step=20),
)
METRICS = {"first_token": PCT, "seqlen_truncate": TRUNC}


def curriculum(**kw):
    return Curriculum(metrics=METRICS, percentile_rounding="proportional", seed=3, **kw)


class Record(pl.Callback):
    """Sees the curriculum's cl_* metadata (batch_meta). Records per training batch (step, difficulty, input_ids)."""

    def __init__(self, out_dir=None):
        self.train, self.val, self.out_dir = [], [], out_dir

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        batch = {**batch, **batch_meta(trainer)}  # the user's batch and the curriculum's metadata
        self.train.append(
            {
                "global_step": trainer.global_step,
                "cl_step": batch["cl_step"],
                "cl_micro": batch["cl_micro"],
                "difficulty": dict(batch["cl_difficulty"]),
                "input_ids": batch["input_ids"].tolist(),
            }
        )

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.val.append(tuple(batch["input_ids"].shape))

    def on_fit_end(self, trainer, pl_module):
        if self.out_dir:
            Path(self.out_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(self.out_dir) / f"cl_rank{trainer.global_rank}.json", "w") as f:
                json.dump(self.train, f)


def expected_difficulties(steps):
    cfg = CurriculumConfig(metrics=METRICS, percentile_rounding="proportional")
    return {name: dict(zip(steps, difficulties(s, steps))) for name, s in cfg.schedules().items()}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_each_batch_carries_its_own_difficulty(tmp_path, num_workers):
    rec = Record()
    trainer = make_trainer(tmp_path, [rec, curriculum()], max_steps=16, max_epochs=-1)
    dm = CurriculumDataModule(tiny_lm_data(batch_size=4, num_workers=num_workers))
    trainer.fit(tiny_gpt2(), datamodule=dm)
    steps = [r["cl_step"] for r in rec.train]
    assert steps == list(range(1, 17)) and [r["global_step"] for r in rec.train] == list(range(16))
    expected = expected_difficulties(steps)
    seen = set()
    for r in rec.train:
        d = r["difficulty"]
        assert d == {name: expected[name][r["cl_step"]] for name in METRICS}
        assert np.array(r["input_ids"]).shape == (4, d["seqlen_truncate"])  # truncated to its own difficulty
        seen.add(d["seqlen_truncate"])
    assert len(seen) == 14  # 3..16: the difficulty changes at almost every step, so a mismatch would show


def test_batches_come_from_the_eligible_set(tmp_path):
    rec = Record()
    make_trainer(tmp_path, [rec, curriculum()], max_steps=16, max_epochs=-1).fit(
        tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=4))
    )
    data = TokenBlocks().data
    index = MetricIndex.from_sample_to_metric(data[:, 0].numpy())
    for r in rec.train:
        p = r["difficulty"]["first_token"]
        eligible = data[index.ids[: len(data) * p // 100]]
        for row in r["input_ids"]:
            assert any(torch.equal(torch.tensor(row), e[: len(row)]) for e in eligible)


@pytest.mark.parametrize("num_workers,resume_step", [(0, 10), (0, 13), (2, 7)])
def test_resume_continues_the_exact_stream(tmp_path, num_workers, resume_step):
    # N = 40, 4 per batch: 10 batches per data epoch; percentile clusters of 8-40 samples reshuffle every few steps;
    # difficulties change before and after the checkpoint
    a, b = assert_resume_equals_uninterrupted(
        tiny_gpt2,
        lambda: CurriculumDataModule(tiny_lm_data(batch_size=4, num_workers=num_workers)),
        tmp_path,
        total_steps=24,
        resume_step=resume_step,
        callbacks_fn=lambda: [Record(), curriculum()],
    )
    rec_a = next(c for c in a.callbacks if isinstance(c, Record)).train
    rec_b = next(c for c in b.callbacks if isinstance(c, Record)).train
    assert len(rec_b) == 24 - resume_step
    assert rec_b == rec_a[resume_step:]
    assert len({tuple(r["difficulty"].values()) for r in rec_a[:resume_step]}) > 1
    assert len({tuple(r["difficulty"].values()) for r in rec_b}) > 1


def test_gradient_accumulation_shares_one_step(tmp_path):
    rec = Record()
    make_trainer(tmp_path, [rec, curriculum()], max_steps=5, max_epochs=-1, accumulate_grad_batches=2).fit(
        tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=4))
    )
    assert [(r["cl_step"], r["cl_micro"]) for r in rec.train] == [(s, m) for s in range(1, 6) for m in (0, 1)]
    for x, y in zip(rec.train[::2], rec.train[1::2]):
        assert x["difficulty"] == y["difficulty"]


def test_validation_is_never_truncated(tmp_path):
    rec = Record()
    trainer = make_trainer(
        tmp_path, [rec, curriculum()], max_steps=6, max_epochs=-1, limit_val_batches=2, val_check_interval=3
    )
    trainer.fit(tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=4)))
    assert max(len(r["input_ids"][0]) for r in rec.train) < 16
    assert rec.val and all(shape[1] == 16 for shape in rec.val)


def test_user_step_sees_its_own_batch_and_tokens_are_counted(tmp_path):
    seen = []
    cb = curriculum()
    model = tiny_gpt2()
    original = model.training_step

    def step(batch, batch_idx):
        seen.append(sorted(batch))
        return original(batch, batch_idx)

    model.training_step = step
    rec = Record()
    make_trainer(tmp_path, [rec, cb], max_steps=6, max_epochs=-1).fit(
        model, datamodule=CurriculumDataModule(tiny_lm_data(batch_size=4))
    )
    assert seen == [["input_ids"]] * 6
    assert cb.consumed_tokens == sum(4 * r["difficulty"]["seqlen_truncate"] for r in rec.train)
    assert cb.effi_summary()["curriculum/consumed_tokens"] == cb.consumed_tokens


def test_a_batch_the_step_skips_moves_the_stream_on_without_its_tokens(tmp_path):
    """A training_step returning None (Lightning skips the batch: no backward, no update) had its tokens counted in
    consumed_tokens, which Curriculum(total_tokens=...)'s progress reads (qa54-extras 03). The stream goes on (the
    batch was drawn); its tokens are left out."""
    cb = curriculum()
    model = tiny_gpt2()
    original = model.training_step
    tokens: dict[str, list[int]] = {"trained": [], "skipped": []}

    def step(batch, batch_idx):
        skip = batch_idx % 3 == 1
        tokens["skipped" if skip else "trained"].append(batch["input_ids"].numel())
        return None if skip else original(batch, batch_idx)

    model.training_step = step
    make_trainer(tmp_path, [cb], max_steps=4, max_epochs=-1).fit(
        model, datamodule=CurriculumDataModule(tiny_lm_data(batch_size=4))
    )
    assert tokens["trained"] and tokens["skipped"]
    assert cb.consumed_tokens == sum(tokens["trained"])


def test_token_progress_drives_the_lr(tmp_path):
    from lightning_effi.core.lr_schedules import progress_lambda

    total = 500
    cb = curriculum(total_tokens=total)
    lrs = []

    class LR(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    model = tiny_gpt2(scheduler=lambda opt, total_steps, progress=None: progress_lambda(opt, lambda p: 1 - p, progress))
    rec = Record()
    make_trainer(tmp_path, [rec, cb, LR()], max_steps=6, max_epochs=-1).fit(
        model, datamodule=CurriculumDataModule(tiny_lm_data(batch_size=4))
    )
    base = 0.05  # tests.helpers.tiny.sgd
    through = np.cumsum([4 * r["difficulty"]["seqlen_truncate"] for r in rec.train])
    assert lrs == pytest.approx([base * (1 - t / total) for t in through])  # the scheduler saw the current batch


def test_setup_errors(tmp_path):
    with pytest.raises(CurriculumConfigError, match="CurriculumDataModule"):
        make_trainer(tmp_path, [curriculum()], max_steps=1).fit(tiny_gpt2(), datamodule=tiny_lm_data())
    with pytest.raises(CurriculumConfigError, match="configured twice"):
        make_trainer(tmp_path, [curriculum()], max_steps=1).fit(
            tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(), metrics={"seqlen_truncate": TRUNC})
        )
    with pytest.raises(CurriculumConfigError, match="has no metrics"):
        make_trainer(tmp_path, [Curriculum()], max_steps=1).fit(
            tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data())
        )
    # configured on the DataModule only: works
    cb = Curriculum()
    make_trainer(tmp_path, [cb], max_steps=2).fit(
        tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(), metrics={"seqlen_truncate": TRUNC})
    )
    assert cb.consumed_tokens == 8 * 3 + 8 * 4  # steps 1, 2: d = floor(s / 14 * 14 + 2)


def test_ddp_needs_use_distributed_sampler_false():
    dm = CurriculumDataModule(tiny_lm_data(), metrics={"seqlen_truncate": TRUNC})
    trainer = SimpleNamespace(
        world_size=2, datamodule=dm, callbacks=[], _accelerator_connector=SimpleNamespace(use_distributed_sampler=True)
    )
    with pytest.raises(CurriculumConfigError, match="use_distributed_sampler=False"):
        Curriculum().setup(trainer, None, "fit")


class OtherSampler(pl.Callback):
    """A stand-in technique that owns the training sampler and cannot act inside another one's."""

    requirements = Requirements(owns_train_sampler=True)


def test_setup_refuses_a_sampler_that_cannot_thin_but_accepts_infobatch():
    from lightning_effi.core.requirements import check_trainer

    cb = Curriculum(metrics={"seqlen_truncate": TRUNC})
    # InfoBatch thins inside the curriculum's sampler (tests/composition): the rules accept the pair, in both orders
    check_trainer(SimpleNamespace(callbacks=[cb, InfoBatchCallback()], strategy=None))
    check_trainer(SimpleNamespace(callbacks=[InfoBatchCallback(), cb], strategy=None))
    trainer = SimpleNamespace(callbacks=[cb, OtherSampler()], strategy=None)
    with pytest.raises(
        IncompatibleTechniques, match=r"Curriculum and OtherSampler cannot be combined \(two training samplers\)"
    ):
        cb.setup(trainer, None, "fit")


def test_requirements_are_declared_and_match_metadata():
    req = Curriculum.requirements
    assert isinstance(req, Requirements)
    # any batch structure (was ("dict",): truncation refused tuple batches; tests/curriculum/test_user_modules.py)
    assert req.owns_train_sampler and req.edits_batch and req.batch_structures == BATCH_STRUCTURES
    assert not (req.changes_epoch_length or req.changes_model_shapes or req.patches_layers or req.needs_per_sample_loss)
    folder = Path(lightning_effi.curriculum.__file__).parent
    metadata = json.loads((folder / "metadata.json").read_text())
    assert metadata["requirements"] == json.loads(json.dumps(req.as_dict()))  # tuples as lists
    assert metadata["class_name"] == Curriculum.__name__
    root = folder.parent.parent
    assert (root / metadata["card"]).is_file() and (root / metadata["hydra"]).is_file()


def test_repr_round_trips():
    cb = Curriculum(
        metrics=METRICS,
        seed=np.int64(3),
        num_epochs=50,
        rounding="deepspeed",
        percentile_rounding="proportional",
        dp_split="deepspeed",
        drop_last=True,
        truncate_keys=("input_ids", "labels"),
        causal_label_shift=True,
        analysis_batch_size=np.int64(64),
        total_tokens=1000,
        strict=False,
    )
    again = eval(repr(cb), {"Curriculum": Curriculum})
    assert repr(again) == repr(cb)
    assert again.config.describe() == cb.config.describe() and type(again.config.seed) is int
    assert (again.analysis_batch_size, again.total_tokens, again.strict) == (64, 1000, False)
    # every constructor argument appears, in order
    names = list(inspect.signature(Curriculum).parameters)
    assert [kw.arg for kw in ast.parse(repr(cb), mode="eval").body.keywords] == names
    bare = Curriculum()  # configured on the DataModule
    assert repr(bare).startswith("Curriculum(metrics=None, seed=1234, num_epochs=1000, ")
    assert repr(eval(repr(bare), {"Curriculum": Curriculum})) == repr(bare)
    default_keys = Curriculum(metrics={"seqlen_truncate": TRUNC})
    assert "truncate_keys=None" in repr(default_keys) and "index_to_sample_path" not in repr(default_keys)


def test_in_memory_analysis_import_paths():
    from lightning_effi.curriculum.analysis import analyze_in_memory
    from lightning_effi.curriculum.analysis.in_memory import analyze_in_memory as in_memory

    assert lightning_effi.curriculum.analyze_in_memory is analyze_in_memory is in_memory
    data = TokenBlocks()
    values = analyze_in_memory(data, "curriculum_test_first_token", batch_size=16)
    assert values.dtype == np.int64 and values.tolist() == data.data[:, 0].tolist()


def masking_collate(samples):
    """A masked LM's collate (as DataCollatorForLanguageModeling): 15% of the tokens replaced by id 1, at random."""
    batch = torch.utils.data.default_collate(samples)
    ids = batch["input_ids"].clone()
    ids[torch.rand(ids.shape) < 0.15] = 1
    return {**batch, "input_ids": ids}


def test_a_collate_that_draws_at_random_is_refused_for_the_analysis(tmp_path):
    """The in-memory analysis read the batches of the training loader's collate: with a masked LM's random masking
    each sample's difficulty was a random draw (89 of 96 samples differed between two fits, qa38-user 03). Refused at
    setup, naming analysis_collate_fn; with a deterministic analysis_collate_fn the index is that collate's values, and
    the check leaves the global random state as it was."""
    metrics = {"first_token": {**PCT, "analysis": first_token}}
    with pytest.raises(
        CurriculumConfigError,
        match=r"collates the same 40 samples into batches on which the metric.*"
        r"pass Curriculum\(analysis_collate_fn=\.\.\.\)",
    ):
        make_trainer(tmp_path, [Curriculum(metrics=metrics)], max_steps=1).fit(
            tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(collate_fn=masking_collate))
        )
    from lightning_effi.curriculum.analysis.in_memory import check_deterministic_collate

    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    check_deterministic_collate(TokenBlocks(), torch.utils.data.default_collate, 16, "first_token", first_token)
    with pytest.raises(CurriculumConfigError, match="batches on which the metric gives other values"):
        check_deterministic_collate(TokenBlocks(), masking_collate, 16, "first_token", first_token)
    assert torch.equal(torch.rand(3), expected)  # the checks left the global random state as it was

    def masking_later_tokens(samples):  # random, but not where the metric reads (the first token): accepted
        batch = torch.utils.data.default_collate(samples)
        ids = batch["input_ids"].clone()
        ids[:, 1:][torch.rand(ids[:, 1:].shape) < 0.5] = 1
        return {**batch, "input_ids": ids, "weight": float("nan"), "text": object()}  # leaves that equal nothing

    check_deterministic_collate(TokenBlocks(), masking_later_tokens, 16, "first_token", first_token)
    cb = Curriculum(
        metrics=metrics, analysis_collate_fn=torch.utils.data.default_collate, percentile_rounding="proportional"
    )
    make_trainer(tmp_path, [cb], max_steps=1).fit(
        tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(collate_fn=masking_collate))
    )
    with pytest.raises(CurriculumConfigError, match=r"analysis_collate_fn must be a callable"):
        Curriculum(metrics=metrics, analysis_collate_fn="default_collate")


class AugmentedBlocks(TokenBlocks):
    """A dataset that augments in ``__getitem__`` (as a torchvision transform does): the first token replaced by a
    random id at each fetch (``where="first"``), or a later one (``where="later"``, which the metric does not read)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.data[i].clone()
        ids[0 if self.where == "first" else -1] = int(torch.randint(0, 64, ()))
        return {"input_ids": ids}


def test_a_dataset_that_augments_at_random_is_refused_for_the_analysis(tmp_path):
    """The check fetched the samples once and collated them twice, so a dataset drawing its augmentation in
    __getitem__ passed: 126 of 128 images' entropy difficulties changed at a second fetch (qa51-vision 01). Refused at
    setup, naming the dataset and the offline index; random draws the metric does not read pass, and the check leaves
    the global random state as it was."""
    from lightning_effi.curriculum.analysis.in_memory import check_deterministic_collate

    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    collate = torch.utils.data.default_collate
    with pytest.raises(
        CurriculumConfigError,
        match=r"the training dataset \(AugmentedBlocks\) gives other samples at a second fetch of the same indices: "
        r"the metric reads other values for \d+ of its first 16 samples .*compute the index offline",
    ):
        check_deterministic_collate(AugmentedBlocks("first"), collate, 16, "first_token", first_token)
    check_deterministic_collate(AugmentedBlocks("later"), collate, 16, "first_token", first_token)
    check_deterministic_collate(AugmentedBlocks("later"), None, 16, "first_token", first_token)  # the default
    assert torch.equal(torch.rand(3), expected)
    metrics = {"first_token": {**PCT, "analysis": first_token}}
    with pytest.raises(CurriculumConfigError, match=r"curriculum_metrics.first_token: .*gives other samples"):
        make_trainer(tmp_path, [Curriculum(metrics=metrics)], max_steps=1).fit(
            tiny_gpt2(), datamodule=CurriculumDataModule(TinyDataModule(AugmentedBlocks("first")))
        )


@pytest.mark.parametrize("cast", ["long", "int"])
@pytest.mark.parametrize("sign", [1, -1], ids=["positive", "negated"])
def test_a_nan_score_cast_to_an_integer_is_refused_naming_the_metric(tmp_path, sign, cast):
    """A float score cast as the float-metric message advises turns NaN (and infinity) into -2**63: among positive
    scores the index build overflowed (an error naming neither the metric nor the cause), among negated ones the NaN
    sample became the easiest and trained from the first step (qa32-break 04). Both are refused at setup, naming the
    metric's key; a MetricIndex over the int64 extremes no longer overflows."""

    def score(batch):
        value = sign * batch["input_ids"].float().std(1)
        value[0] = float("nan")  # the first sample of each batch diverged
        return getattr(value * 1000, cast)()

    metric = dict(
        difficulty_type="value",
        clustering_type="schedule_based",
        min_difficulty=-30000 if sign < 0 else 1000,
        max_difficulty=1000 if sign < 0 else 30000,
        schedule_type="fixed_linear",
        schedule_config=dict(total_curriculum_step=8, difficulty_step=1000),
        analysis=score,
    )
    dtype = "int64" if cast == "long" else "int32"
    lowest = -(2**63) if cast == "long" else -(2**31)
    with pytest.raises(
        CurriculumConfigError,
        match=rf"^curriculum_metrics.score: curriculum analysis: metric 'score' returned {lowest} \(the {dtype} "
        r"minimum\) for 1 of a batch's 40 samples \(the first at position 0\): a NaN or infinite float",
    ):
        make_trainer(tmp_path, [Curriculum(metrics={"score": metric})], max_steps=1).fit(
            tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data())
        )
    extremes = np.array([np.iinfo(np.int64).min, 5, np.iinfo(np.int64).max])
    assert MetricIndex.from_sample_to_metric(extremes).values.tolist() == sorted(extremes.tolist())


def test_empty_first_eligible_set_fails_in_setup(tmp_path):
    metrics = {
        "first_token": dict(PCT, min_difficulty=1, schedule_config=dict(total_curriculum_step=1000, difficulty_step=1))
    }
    with pytest.raises(
        CurriculumConfigError,
        match=r"first_token \(percentile\) at difficulty 1: 0 eligible.*N = 40"
        r"|N = 40.*first_token \(percentile\) at difficulty 1: 0 eligible",
    ):
        make_trainer(tmp_path, [Curriculum(metrics=metrics)], max_steps=1).fit(
            tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data())
        )  # deepspeed rounding: 40 // 100 = 0


@pytest.mark.slow
def test_ddp_ranks_share_global_batches(tmp_path):
    steps = 6
    _, _ = fit_ddp(
        tiny_gpt2(),
        CurriculumDataModule(tiny_lm_data(batch_size=4)),
        tmp_path,
        callbacks=[Record(tmp_path / "cl"), curriculum()],
        use_distributed_sampler=False,
        max_steps=steps,
        max_epochs=-1,
    )
    ranks = [json.loads((tmp_path / "cl" / f"cl_rank{r}.json").read_text()) for r in range(2)]
    assert [len(r) for r in ranks] == [steps, steps]
    # the same global batches computed by one process with the whole global batch (8 = 4 x 2 ranks)
    cfg = CurriculumConfig(metrics=METRICS, percentile_rounding="proportional", seed=3)
    data = TokenBlocks().data
    index = MetricIndex.from_sample_to_metric(data[:, 0].numpy())
    single = CurriculumController(cfg, {"first_token": index}, len(data), micro_batch_size=8)
    for r0, r1, keys in zip(ranks[0], ranks[1], single.micro_batches()):
        assert r0["cl_step"] == r1["cl_step"] == keys[0][1] and r0["difficulty"] == r1["difficulty"]
        d = r0["difficulty"]["seqlen_truncate"]
        whole = data[[k[0] for k in keys]][:, :d].tolist()
        assert r0["input_ids"] + r1["input_ids"] == whole  # disjoint halves covering the global batch


def growing(step: int, start: int = 20, per_step: int = 10) -> int:
    return min(100, start + per_step * step)


def test_hydra_instantiated_callables(tmp_path):
    """A custom schedule and a user metric given as Hydra `_partial_` targets (no registration needed)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(
        {
            "_target_": "lightning_effi.callbacks.Curriculum",
            "percentile_rounding": "proportional",
            "metrics": {
                "first": dict(
                    PCT,
                    schedule_type="custom",
                    schedule_config={},
                    analysis={"_target_": "tests.curriculum.test_callback.first_token", "_partial_": True},
                    custom_schedule={
                        "_target_": "tests.curriculum.test_callback.growing",
                        "_partial_": True,
                        "start": 30,
                    },
                )
            },
        }
    )
    rec = Record()
    cb = instantiate(cfg)
    make_trainer(tmp_path, [rec, cb], max_steps=4, max_epochs=-1).fit(
        tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=4))
    )
    assert [r["difficulty"]["first"] for r in rec.train] == [40, 50, 60, 70]
    assert cb.state_dict()["stream"]["config"]["config"]["metrics"]["first"]["custom_schedule"] == {
        "callable": "tests.curriculum.test_callback.growing",
        "keywords": {"start": 30},
    }


def test_options_without_metrics_raise_and_the_callback_pickles():
    import pickle

    with pytest.raises(CurriculumConfigError, match=r"options \['seed'\] given without metrics"):
        Curriculum(seed=5)
    cb = pickle.loads(pickle.dumps(curriculum(total_tokens=100)))  # ddp_spawn pickles the callbacks
    assert cb.effi_progress() == 0.0 and cb.config.seed == 3


def test_seqlen_reshape_rechunks_each_batch_at_its_difficulty(tmp_path):
    reshape = dict(TRUNC, min_difficulty=3, max_difficulty=15)  # rows of d + 1 tokens; 16 = no change
    rec = Record()
    make_trainer(tmp_path, [rec, Curriculum(metrics={"seqlen_reshape": reshape})], max_steps=8, max_epochs=-1).fit(
        tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=4))
    )
    for r in rec.train:
        d = r["difficulty"]["seqlen_reshape"]
        rows = np.array(r["input_ids"])
        if d + 1 >= 16:
            assert rows.shape == (4, 16)
        else:
            full = -(-(4 * 16) // (d + 1))
            kept = min(full, 4 * (16 // (d + 1)) + 4)
            kept -= 1 if kept % 2 and kept > 1 else 0
            assert rows.shape == (kept, d + 1)


class WithLabels(TokenBlocks):
    """A causal-LM dataset as HF's collators make it: ``{"input_ids", "labels"}`` (labels a copy of the ids), and
    optionally a per-sample field ``"source"``."""

    def __init__(self, source: bool = False) -> None:
        super().__init__()
        self.source = source

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.data[i]
        item = {"input_ids": ids, "labels": ids.clone()}
        return item | ({"source": torch.tensor(i % 3)} if self.source else {})


def test_seqlen_reshape_carries_the_labels_into_the_rows_and_refuses_a_per_sample_field_at_setup(tmp_path):
    """The labels follow the ids into the same rows (only the ids came through: a step reading batch["labels"] died
    with a KeyError); a per-sample field cannot follow rows that are no longer samples: refused before any step."""
    reshape = dict(TRUNC, min_difficulty=3, max_difficulty=15)
    seen: list[tuple[list[str], bool]] = []

    class Keys(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append((sorted(batch), torch.equal(batch["labels"], batch["input_ids"])))

    make_trainer(tmp_path / "ok", [Keys(), Curriculum(metrics={"seqlen_reshape": reshape})], max_steps=3).fit(
        tiny_gpt2(), datamodule=CurriculumDataModule(TinyDataModule(WithLabels(), batch_size=4))
    )
    assert seen == [(["input_ids", "labels"], True)] * 3
    trainer = make_trainer(tmp_path / "bad", [Curriculum(metrics={"seqlen_reshape": reshape})], max_steps=3)
    with pytest.raises(DataConfigError, match=r"'source' \(shape \[4\]\) cannot follow the rows"):
        trainer.fit(tiny_gpt2(), datamodule=CurriculumDataModule(TinyDataModule(WithLabels(source=True), batch_size=4)))
    assert trainer.global_step == 0


class _TwoOptimizers(type(tiny_gpt2())):  # type: ignore[misc]
    """Manual optimization with ``n_opt`` optimizers (the embeddings' and the rest), each stepped once a batch."""

    n_opt = 2

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def configure_optimizers(self):
        params = list(self.parameters())
        groups = [params[:1], params[1:]] if self.n_opt == 2 else [params]
        return [torch.optim.SGD(g, lr=0.01) for g in groups]

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        for opt in optimizers:
            opt.zero_grad()
        self.manual_backward(out["loss"] if isinstance(out, dict) else out)
        for opt in optimizers:
            opt.step()


@pytest.mark.parametrize("n_opt", [1, 2])
def test_manual_optimization_with_several_optimizers_warns_of_the_step_unit_instead_of_refusing(tmp_path, n_opt):
    """Manual optimization, every optimizer stepped once a batch: global_step counts n_opt a batch. With one optimizer
    max_steps=3 past the 2-step budget is refused (at train start); with two, max_steps=4 is 2 batches, within the
    budget, and the units are said in a warning (it was refused)."""
    module = tiny_gpt2()
    module.__class__ = _TwoOptimizers
    module.automatic_optimization, module.n_opt = False, n_opt
    trainer = make_trainer(tmp_path, [curriculum(num_epochs=1)], max_steps=3 if n_opt == 1 else 4)
    data = CurriculumDataModule(TinyDataModule(TokenBlocks(n=8), batch_size=4))
    if n_opt == 1:
        with pytest.raises(CurriculumConfigError, match=r"max_steps=3 exceeds the sample budget"):
            trainer.fit(module, datamodule=data)
        return
    with pytest.warns(UserWarning, match=r"manual optimization with 2 optimizers: trainer.global_step"):
        trainer.fit(module, datamodule=data)
    assert trainer.global_step == 4


# ------------------------------------------------------------------------------------- hardening (QA findings)
def test_spent_budget_stops_the_fit_instead_of_hanging(tmp_path):
    cb = Curriculum(metrics={"seqlen_truncate": TRUNC}, num_epochs=1)
    trainer = make_trainer(tmp_path, [cb], max_epochs=50)
    trainer.fit(tiny_gpt2(), datamodule=CurriculumDataModule(TinyDataModule(TokenBlocks(n=8), batch_size=4)))
    assert trainer.global_step == 2 and cb.controller.exhausted
    with pytest.raises(CurriculumConfigError, match=r"max_steps=3 exceeds the sample budget .* = 2 optimizer steps"):
        make_trainer(tmp_path, [Curriculum(metrics={"seqlen_truncate": TRUNC}, num_epochs=1)], max_steps=3).fit(
            tiny_gpt2(), datamodule=CurriculumDataModule(TinyDataModule(TokenBlocks(n=8), batch_size=4))
        )


@pytest.mark.timeout(300)  # the bug this guards against ran forever
def test_min_steps_beyond_the_budget_is_refused(tmp_path):
    """min_steps past the budget ran empty epochs to max_epochs short of it, or forever with max_epochs=-1
    (qa38-break 02): refused as max_steps is; one within the budget trains."""
    for max_epochs in (10, -1):
        trainer = make_trainer(
            tmp_path, [Curriculum(metrics={"seqlen_truncate": TRUNC}, num_epochs=1)], max_epochs=max_epochs, min_steps=3
        )
        with pytest.raises(CurriculumConfigError, match=r"min_steps=3 exceeds the sample budget .* = 2 optimizer step"):
            trainer.fit(tiny_gpt2(), datamodule=CurriculumDataModule(TinyDataModule(TokenBlocks(n=8), batch_size=4)))
        assert trainer.global_step == 0
    trainer = make_trainer(
        tmp_path, [Curriculum(metrics={"seqlen_truncate": TRUNC}, num_epochs=1)], max_epochs=-1, min_epochs=2
    )  # and min_epochs past num_epochs: the epochs after the stream trained nothing (qa38-break 02, qa39-break 07)
    with pytest.raises(CurriculumConfigError, match=r"min_epochs=2 exceeds the sample budget's 1 data epochs"):
        trainer.fit(tiny_gpt2(), datamodule=CurriculumDataModule(TinyDataModule(TokenBlocks(n=8), batch_size=4)))
    trainer = make_trainer(tmp_path, [Curriculum(metrics={"seqlen_truncate": TRUNC}, num_epochs=1)], min_steps=2)
    trainer.fit(tiny_gpt2(), datamodule=CurriculumDataModule(TinyDataModule(TokenBlocks(n=8), batch_size=4)))
    assert trainer.global_step == 2


@pytest.mark.parametrize(
    ("limits", "steps"),
    [
        (dict(max_steps=1, min_steps=3), 1),
        (dict(max_epochs=1, min_epochs=2), 2),
        (dict(max_epochs=1, min_steps=3), 2),
        (dict(max_steps=2, max_epochs=-1, min_epochs=3), 2),
        # Lightning epochs of one batch (limit_train_batches): max_epochs=2 ends at the budget (qa112-regress 03)
        (dict(max_epochs=2, limit_train_batches=1, min_steps=3), 2),
    ],
)
def test_a_minimum_the_runs_maximum_overrides_is_not_refused(tmp_path, limits, steps):
    """Lightning's max_steps / max_epochs end a fit whatever its min_steps / min_epochs: a minimum past the budget
    under a maximum within it runs no empty epoch, and was refused naming a setting that had no effect
    (qa110-loops 01). It trains what plain Lightning trains."""
    for curriculum in (True, False):
        callbacks = [Curriculum(metrics={"seqlen_truncate": TRUNC}, num_epochs=1)] if curriculum else []
        trainer = make_trainer(tmp_path, callbacks, **limits)
        data = TinyDataModule(TokenBlocks(n=8), batch_size=4)
        trainer.fit(tiny_gpt2(), datamodule=CurriculumDataModule(data) if curriculum else data)
        assert trainer.global_step == steps


def test_a_reused_callback_starts_a_fresh_stream(tmp_path):
    cb, rec = curriculum(total_tokens=10_000), Record()
    for run in ("a", "b"):
        rec.train.clear()
        make_trainer(tmp_path / run, [rec, cb], max_steps=3, max_epochs=-1).fit(
            tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=4))
        )
        assert [r["cl_step"] for r in rec.train] == [1, 2, 3]
        assert cb.consumed_tokens == sum(4 * r["difficulty"]["seqlen_truncate"] for r in rec.train)


def test_truncation_without_a_truncatable_key_raises(tmp_path):
    from lightning_effi.core.errors import DataConfigError

    cb = Curriculum(metrics={"seqlen_truncate": TRUNC}, truncate_keys=["tokens"])
    with pytest.raises(DataConfigError, match=r"none of truncate_keys \['tokens'\]"):
        make_trainer(tmp_path, [cb], max_steps=1).fit(tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data()))


def test_resume_from_a_checkpoint_without_curriculum(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath=tmp_path / "old", filename="{step}", every_n_train_steps=3, save_top_k=-1)
    make_trainer(tmp_path, [ckpt], max_steps=3, max_epochs=-1).fit(tiny_gpt2(), datamodule=tiny_lm_data(batch_size=4))
    rec = Record()
    trainer = make_trainer(tmp_path, [rec, curriculum()], max_steps=6, max_epochs=-1)
    trainer.fit(
        tiny_gpt2(),
        datamodule=CurriculumDataModule(tiny_lm_data(batch_size=4)),
        ckpt_path=tmp_path / "old" / "step=3.ckpt",
    )
    assert trainer.global_step == 6 and [r["cl_step"] for r in rec.train] == [1, 2, 3]  # the curriculum starts over


def test_loader_settings_are_kept():
    import torch.utils.data as tud

    class DM(pl.LightningDataModule):
        def train_dataloader(self):
            return tud.DataLoader(TokenBlocks(), batch_size=4, num_workers=2, persistent_workers=True, timeout=30)

    dm = CurriculumDataModule(DM(), metrics={"seqlen_truncate": TRUNC})
    dm.controller = CurriculumController(dm.config, {}, 40, micro_batch_size=4)
    loader = dm.train_dataloader()
    assert (loader.num_workers, loader.persistent_workers, loader.timeout) == (2, True, 30)


@pytest.mark.parametrize("raised", [False, True])
def test_a_used_datamodule_without_its_callback_is_refused(tmp_path, raised):
    """A notebook's ablation cell: the CurriculumDataModule of a finished (or failed) curriculum fit, fitted again
    without the Curriculum callback. It kept the controller and trained the stream's last two batches over and over (8
    of 48 samples, qa35-break 01); it is refused as a new wrapper is, and a new callback attaches its own controller."""

    class Stop(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 3:
                raise RuntimeError("stop")

    dm = CurriculumDataModule(TinyDataModule(TokenBlocks(n=48), batch_size=4))
    first = make_trainer(tmp_path / "a", [curriculum(), *([Stop()] if raised else [])], max_steps=6, max_epochs=-1)
    if raised:
        with pytest.raises(RuntimeError, match="stop"):
            first.fit(tiny_gpt2(), datamodule=dm)
    else:
        first.fit(tiny_gpt2(), datamodule=dm)
    assert dm.controller is None
    with pytest.raises(DataConfigError, match="CurriculumDataModule needs the Curriculum callback"):
        make_trainer(tmp_path / "b", [], max_steps=2, max_epochs=-1).fit(tiny_gpt2(), datamodule=dm)
    again = curriculum()
    make_trainer(tmp_path / "c", [again], max_steps=2, max_epochs=-1).fit(tiny_gpt2(), datamodule=dm)
    assert again.controller is not None and again.controller.stats(2) is not None


class Ragged(torch.utils.data.Dataset):
    """A user's dataset of ``(ids, label)`` of 2 to 9 tokens (ids 1..29), padded by :func:`pad_right`."""

    def __init__(self, n: int = 20) -> None:
        g = torch.Generator().manual_seed(0)
        self.rows = [torch.randint(1, 30, (2 + i % 8,), generator=g) for i in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.rows[i], i % 3


def pad_right(samples):
    """Right padding with id 0 to the longest sample of the batch, no attention mask."""
    ids = torch.nn.utils.rnn.pad_sequence([s[0] for s in samples], batch_first=True, padding_value=0)
    return ids, torch.tensor([s[1] for s in samples])


def test_a_metric_that_counts_the_padding_of_its_batch_is_refused_for_the_analysis():
    """vocab_rarity counts every token unless told the padding (pad_token_id=None, as Megatron's for fixed-length GPT
    data): on ragged samples padded per batch, a sample's difficulty depended on its batch-mates (sample 0: 6, 12 or 13
    for analysis batches of 1, 4 or 20, qa79-curriculum 01). Refused, naming pad_token_id; with pad_token_id=0 every
    batch size gives the per-sample values, by hand: the sum of -ln(f / sum f) over the sample's real tokens."""
    from lightning_effi.curriculum.analysis.in_memory import analyze_in_memory

    data = Ragged()
    for batch_size in (1, 4, 20):
        with pytest.raises(
            CurriculumConfigError,
            match=r"other values collated together than each collated alone.*"
            r"its pad_token_id option",
        ):
            analyze_in_memory(data, {"name": "vocab_rarity", "vocab_size": 30}, pad_right, batch_size)
    counts = np.bincount(torch.cat(data.rows).numpy(), minlength=30).astype(np.float64)
    counts[counts == 0] = 1
    rarity = -np.log(counts / counts.sum())
    expected = [int(rarity[row.numpy()].sum()) for row in data.rows]
    for batch_size in (1, 4, 20):
        values = analyze_in_memory(
            data, {"name": "vocab_rarity", "vocab_size": 30, "pad_token_id": 0}, pad_right, batch_size
        )
        assert values.tolist() == expected


def test_ragged_samples_analysed_one_at_a_time_need_no_padding_collate():
    """Analysed one sample a batch with the default collate, ragged samples are never padded: the batch-composition
    check, which cannot collate them together, is skipped (it raised, qa81-regress 02)."""
    from lightning_effi.curriculum.analysis.in_memory import analyze_in_memory

    data = Ragged(8)
    values = analyze_in_memory([{"input_ids": data.rows[i]} for i in range(8)], "seqlen", None, 1)
    assert values.tolist() == [len(row) for row in data.rows]
