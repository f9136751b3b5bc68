"""V-cycle checkpoints at any stage, with a LightningModule as users write it (an HF GPT-2 built from a config under
its own attribute name, a plain loss, tuple or dict batches, no V-cycle code).

A checkpoint written below level 1 holds the full model in its ``state_dict`` (the coarse model de-coalesced level
by level, no interpolation), so ``trainer.validate/test/predict(ckpt_path=...)`` and ``load_from_checkpoint`` work
with or without the callback; the exact coarse weights travel in the callback's state, so a resumed fit equals the
uninterrupted run. The network attribute is found without ``model_attr``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_effi.callbacks import VCycleCallback
from lightning_effi.functional import vcycle as V
from lightning_effi.models.gpt2 import HFGPT2VCycleAdapter
from lightning_effi.models.vcycle_base import find_vcycle_adapter, find_vcycle_network
from tests.helpers.harness import assert_resume_equals_uninterrupted, make_trainer
from tests.helpers.tiny import TinyDataModule, TokenBlocks


def gpt2(n_layer: int = 2, n_embd: int = 32, n_head: int = 2) -> GPT2LMHeadModel:
    cfg = GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def unpack(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, dict):
        return batch["input_ids"], batch["labels"]
    x, y = batch
    return x, y


class UserLM(pl.LightningModule):
    """As a user writes it: the network under ``net``, ``training_step`` returns the loss, tuple or dict batches, a
    plain ``configure_optimizers``; nothing for the V-cycle."""

    def __init__(self, n_layer: int = 2, n_embd: int = 32, n_head: int = 2, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = gpt2(n_layer, n_embd, n_head)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = unpack(batch)
        return self.net(input_ids=x, labels=y).loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = unpack(batch)
        self.log("val_loss", self.net(input_ids=x, labels=y).loss)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = unpack(batch)
        self.log("test_loss", self.net(input_ids=x, labels=y).loss)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(input_ids=unpack(batch)[0]).logits

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def as_tuples(items: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([item["input_ids"] for item in items])
    return ids, ids


def as_dicts(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    ids = torch.stack([item["input_ids"] for item in items])
    return {"input_ids": ids, "labels": ids}


def user_data(collate: Any = as_tuples) -> TinyDataModule:
    """40 training blocks (5 batches of 8 per epoch), 16 validation blocks (2 batches)."""
    return TinyDataModule(TokenBlocks(), TokenBlocks(n=16, seed=1), collate_fn=collate)


def fit_with_checkpoints(root: Path, vcycle: VCycleCallback, steps: int = 6, **model_kw: Any):
    """Fit ``UserLM`` validating after every step; checkpoints of every validation (monitor ``val_loss``) under
    ``root/ckpts`` and weights-only ones under ``root/weights``."""
    full = ModelCheckpoint(dirpath=root / "ckpts", monitor="val_loss", save_top_k=-1, filename="{step}")
    weights = ModelCheckpoint(
        dirpath=root / "weights", every_n_train_steps=1, save_top_k=-1, filename="{step}", save_weights_only=True
    )
    pl.seed_everything(0)
    model = UserLM(**model_kw)
    trainer = make_trainer(
        root / "fit",
        [vcycle, full, weights],
        max_steps=steps,
        max_epochs=-1,
        limit_val_batches=2,
        val_check_interval=1,
        check_val_every_n_epoch=None,
    )
    trainer.fit(model, datamodule=user_data())
    scores = {int(Path(p).stem.split("=")[1]): float(s) for p, s in full.best_k_models.items()}
    return trainer, model, full, scores


def validate(root: Path, path: Path, callbacks: list[Any] | None = None, model: UserLM | None = None) -> float:
    trainer = make_trainer(root, callbacks or [], limit_val_batches=2)
    result = trainer.validate(model or UserLM(), datamodule=user_data(), ckpt_path=path, verbose=False)
    return float(result[0]["val_loss"])


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> tuple[Path, VCycleCallback, dict[int, float]]:
    """2 levels with the default schemes (width and depth halved), e_a=2, e_small=3 over 6 steps: level 2 trains
    steps 3 to 5 and is in place when steps 2 to 4 end (their checkpoints)."""
    root = tmp_path_factory.mktemp("default")
    cb = VCycleCallback(e_a=2, e_small=3)
    *_, scores = fit_with_checkpoints(root, cb)
    return root, cb, scores


def test_coarse_checkpoint_holds_the_full_model_de_coalesced(default_run):
    """A level-2 checkpoint's weights are ``decoalesce`` of the exact level-2 weights kept in the callback's state (a
    weights-only checkpoint too); ``load_from_checkpoint`` builds that full model without the V-cycle or user code.
    The network was found without ``model_attr``."""
    root, cb, _ = default_run
    assert cb.model_attr == "net" and cb.switches == 2
    plan = find_vcycle_adapter(gpt2()).plan(gpt2(), "half", "adjacent", "official")
    path = root / "ckpts" / "step=3.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    state = checkpoint["callbacks"][cb.state_key]
    assert cb.state_key == "VCycleCallback{'levels': 2, 'model_attr': 'net'}"
    assert state["level"] == 2 and state["weights"]["transformer.wte.weight"].shape == (64, 16)
    expected = V.decoalesce(state["weights"], plan)
    assert {k[4:] for k in checkpoint["state_dict"]} == set(expected)
    for k, v in expected.items():
        assert torch.equal(checkpoint["state_dict"]["net." + k], v), k
    weights_only = torch.load(root / "weights" / "step=3.ckpt", weights_only=True)  # no callback state
    assert "callbacks" not in weights_only
    for k, v in expected.items():
        assert torch.equal(weights_only["state_dict"]["net." + k], v), k
    loaded = UserLM.load_from_checkpoint(path)
    for k, v in expected.items():
        assert torch.equal(loaded.net.state_dict()[k], v), k
    assert loaded.net.lm_head.weight is loaded.net.transformer.wte.weight
    at_level_1 = torch.load(root / "ckpts" / "step=5.ckpt", weights_only=True)
    assert "weights" not in at_level_1["callbacks"][cb.state_key]


@pytest.mark.parametrize("other", ["monitor", "random_ltd", "infobatch", "curriculum"])
def test_a_coarse_checkpoint_resumed_without_the_vcycle_is_refused_by_any_technique(tmp_path, default_run, other):
    """A level-2 checkpoint holds the full model's weights but the coarse model's optimizer state: a fit without the
    V-cycle cannot resume it (torch refused the optimizer's parameter groups, or, with width coalescing only, loaded
    moments of the wrong shapes and failed inside the optimizer's step). Any lightning_effi callback in the Trainer
    refuses it first, naming the level; a level-1 checkpoint of the same run resumes."""
    from lightning_effi.callbacks import Curriculum, InfoBatchCallback, RandomLTDCallback
    from lightning_effi.core.accounting import EfficiencyMonitor

    root, _, _ = default_run
    make = {
        "monitor": lambda: EfficiencyMonitor(print_summary=False),
        "random_ltd": lambda: RandomLTDCallback(min_value=4, require_steps=4, layer_ids=[1]),
        "infobatch": lambda: InfoBatchCallback(prune_ratio=0.5, seed=0),
        "curriculum": lambda: Curriculum(
            metrics={
                "seqlen_truncate": dict(
                    difficulty_type="value",
                    clustering_type="single_cluster",
                    min_difficulty=4,
                    max_difficulty=16,
                    schedule_type="fixed_linear",
                    schedule_config=dict(total_curriculum_step=4, difficulty_step=4),
                )
            }
        ),
    }[other]
    from lightning_effi.data import CurriculumDataModule, InfoBatchDataModule

    wrap = {"infobatch": InfoBatchDataModule, "curriculum": CurriculumDataModule}
    callback = make()
    name = type(callback).__name__
    trainer = make_trainer(tmp_path / "coarse", [callback], max_epochs=2, limit_val_batches=0)
    with pytest.raises(
        ValueError,
        match=rf"^{name}: this checkpoint was written by a V-cycle at a coarse level "
        r"\(level 2\): its weights are the full model's, but its optimizer",
    ):
        trainer.fit(
            UserLM(), datamodule=wrap.get(other, lambda d: d)(user_data()), ckpt_path=root / "ckpts" / "step=3.ckpt"
        )
    if other == "monitor":  # at level 1 the optimizer state is the full model's: the fit resumes without the V-cycle
        # (and without a monitor: the run had none, so one added now is refused, test_a_monitor_added_on_resume_...)
        trainer = make_trainer(tmp_path / "full", [], max_epochs=2, limit_val_batches=0)
        trainer.fit(UserLM(), datamodule=user_data(), ckpt_path=root / "ckpts" / "step=5.ckpt")
        assert trainer.global_step > 5


def test_validate_test_predict_run_the_de_coalesced_model(tmp_path, default_run):
    """``trainer.validate/test/predict(ckpt_path=...)`` of a level-2 checkpoint, with or without the callback in the
    Trainer, run the de-coalesced full model. Depth de-coalescing does not preserve the function, so its validation
    loss differs from the one logged for the level-2 model; a level-1 checkpoint reproduces its own."""
    root, _, scores = default_run
    path = root / "ckpts" / "step=3.ckpt"
    loaded = UserLM.load_from_checkpoint(path)
    reference = float(
        make_trainer(tmp_path / "h", [], limit_val_batches=2).validate(loaded, user_data())[0]["val_loss"]
    )
    assert validate(tmp_path / "v", path) == reference
    assert validate(tmp_path / "w", path, [VCycleCallback(e_a=2, e_small=3)]) == reference
    assert reference == pytest.approx(4.1650681, abs=1e-6)
    assert scores[3] == pytest.approx(4.1630116, abs=1e-6)  # the level-2 model's: depth copies change the function
    tested = make_trainer(tmp_path / "t", []).test(
        UserLM(), dataloaders=user_data().val_dataloader(), ckpt_path=path, verbose=False
    )
    assert tested[0]["test_loss"] == reference
    predict = make_trainer(tmp_path / "p", [VCycleCallback(e_a=2, e_small=3)])
    logits = predict.predict(UserLM(), dataloaders=user_data().val_dataloader(), ckpt_path=path)
    x = torch.cat([unpack(b)[0] for b in user_data().val_dataloader()])
    with torch.no_grad():
        assert torch.equal(torch.cat(logits), loaded.net.eval()(input_ids=x).logits)
    for step in (1, 5):  # level-1 checkpoints: the model that was validated
        assert validate(tmp_path / f"v{step}", root / "ckpts" / f"step={step}.ckpt") == scores[step]


def evaluate(trainer: pl.Trainer, fn: str, model: UserLM, path: Path) -> Any:
    """``trainer.<fn>(model, ckpt_path=path)`` on the 2 validation batches: the logged loss, or the logits."""
    loader = user_data().val_dataloader()
    if fn == "predict":
        return torch.cat(trainer.predict(model, dataloaders=loader, ckpt_path=path))
    out = getattr(trainer, fn)(model, dataloaders=loader, ckpt_path=path, verbose=False)
    return float(out[0][f"{'test' if fn == 'test' else 'val'}_loss"])


@pytest.fixture(scope="module")
def named_run(tmp_path_factory) -> tuple[Path, pl.Trainer, UserLM, VCycleCallback]:
    """As ``default_run`` with ``model_attr="net"`` given (so that a new callback of the same arguments has the
    fit's state key and its state is handed to it): the fit's Trainer, module and callback."""
    root = tmp_path_factory.mktemp("named")
    cb = VCycleCallback(e_a=2, e_small=3, model_attr="net")
    trainer, model, *_ = fit_with_checkpoints(root, cb)
    return root, trainer, model, cb


@pytest.mark.parametrize("fn", ["validate", "test", "predict"])
@pytest.mark.parametrize("step", [3, 5], ids=["level_2", "level_1"])
def test_evaluating_a_checkpoint_with_the_callback_in_the_trainer(tmp_path, named_run, fn, step):
    """Issue #18: ``trainer.validate/test/predict(ckpt_path=...)`` of a level-2 checkpoint with a V-cycle in the
    Trainer (the fit's own Trainer after the fit, whose callback holds the checkpoint's state key; a new Trainer with
    an identical callback, whose ``alpha_original`` is still unresolved) loads the full-size weights into the full
    model and gives exactly what a Trainer without the callback gives; the fit's callback and level are untouched
    (outside ``fit`` the callback does nothing). Before the fix: a RuntimeError (level 2 checkpoint, model at level
    1), and a ValueError "configuration differs: alpha_original (0.25, None)"."""
    root, trainer, model, cb = named_run
    path = root / "ckpts" / f"step={step}.ckpt"
    state = torch.load(path, weights_only=True)
    assert state["callbacks"][cb.state_key]["level"] == (2 if step == 3 else 1)
    reference = evaluate(make_trainer(tmp_path / "plain", [], limit_val_batches=2), fn, UserLM(), path)
    fresh = VCycleCallback(e_a=2, e_small=3, model_attr="net")
    assert fresh.state_key == cb.state_key and fresh.alpha_original is None
    for got in (
        evaluate(trainer, fn, model, path),
        evaluate(make_trainer(tmp_path / "new", [fresh], limit_val_batches=2), fn, UserLM(), path),
    ):
        if fn == "predict":
            assert torch.equal(got, reference)
        else:
            assert got == reference
    assert cb.level == 1 and cb.switches == 2 and cb.stage_index == 2 and fresh.level == 1
    assert model.net.transformer.wte.weight.shape == (64, 32) and len(model.net.transformer.h) == 2
    for k, v in state["state_dict"].items():  # the fit's module holds the checkpoint's full-size weights
        assert torch.equal(model.state_dict()[k], v), k
    assert "on_load_checkpoint" not in vars(model)  # no resume wrapper outside fit


def test_configuration_compared_with_unresolved_automatic_arguments(named_run):
    """``alpha_original`` / ``model_attr`` left None (resolved in ``setup``) match the checkpoint's resolved values;
    any other difference is still refused."""
    root, _, _, cb = named_run
    state = torch.load(root / "ckpts" / "step=3.ckpt", weights_only=True)["callbacks"][cb.state_key]
    assert state["config"]["alpha_original"] == 0.25 and state["config"]["model_attr"] == "net"
    VCycleCallback(e_a=2, e_small=3)._compare_config(state)  # no raise
    VCycleCallback(e_a=2, e_small=3, alpha_original=0.25, model_attr="net")._compare_config(state)
    with pytest.raises(ValueError, match=r"configuration differs.*alpha_original"):
        VCycleCallback(e_a=2, e_small=3, alpha_original=0.5)._compare_config(state)
    with pytest.raises(ValueError, match=r"configuration differs.*model_attr"):
        VCycleCallback(e_a=2, e_small=3, model_attr="other")._compare_config(state)
    with pytest.raises(ValueError, match=r"configuration differs.*depth_scheme"):
        VCycleCallback(e_a=2, e_small=3, depth_scheme=None)._compare_config(state)


def test_width_only_checkpoints_reproduce_the_logged_validation_loss(tmp_path):
    """Width-only levels (``depth_scheme=None``) under ``embedding_convention="exact"``: de-coalescing preserves
    GPT-2's function, so every checkpoint, the level-2 ones and ``ckpt_path="best"`` included, validates to the loss
    logged when it was written."""
    cb = VCycleCallback(e_a=2, e_small=3, depth_scheme=None, embedding_convention="exact")
    trainer, model, full, scores = fit_with_checkpoints(tmp_path, cb)
    assert sorted(scores) == [1, 2, 3, 4, 5, 6]
    for step, score in scores.items():
        level = torch.load(tmp_path / "ckpts" / f"step={step}.ckpt", weights_only=True)["callbacks"][cb.state_key]
        assert level["level"] == (2 if step in (2, 3, 4) else 1)
        assert validate(tmp_path / f"v{step}", tmp_path / "ckpts" / f"step={step}.ckpt") == pytest.approx(
            score, rel=1e-6
        ), step
    best = trainer.validate(model, datamodule=user_data(), ckpt_path="best", verbose=False)  # the fit's Trainer
    assert best[0]["val_loss"] == pytest.approx(float(full.best_model_score), rel=1e-6)


@pytest.mark.parametrize("collate", [as_tuples, as_dicts], ids=["tuple_batches", "dict_batches"])
def test_resume_from_a_coarse_checkpoint_equals_the_uninterrupted_run(tmp_path, collate):
    """Resumed inside the level-2 stage (step 3 of 7): weights, optimizer, learning rates and the callback's state
    equal the uninterrupted run's."""
    assert_resume_equals_uninterrupted(
        UserLM,
        lambda: user_data(collate),
        tmp_path,
        total_steps=7,
        resume_step=3,
        callbacks_fn=lambda: [VCycleCallback(e_a=2, e_small=3, lr_multiplier={2: 4.0})],
        ignore_state=("map_seconds",),
    )


def test_three_levels_checkpoints_and_resume(tmp_path):
    """K = 3 (4 layers x 32 -> 2 x 16 -> 1 x 8; stages [(1, 1), (2, 1), (3, 2), (2, 1)]): a level-3 checkpoint holds
    its weights de-coalesced twice, a level-2 one (up-leg, snapshot of level 1 pending) once; resuming from level 3
    equals the uninterrupted run."""
    kw = dict(n_layer=4, n_head=4)
    assert_resume_equals_uninterrupted(
        lambda: UserLM(**kw),
        user_data,
        tmp_path,
        total_steps=6,
        resume_step=3,
        callbacks_fn=lambda: [VCycleCallback(levels=3, e_a=1, e_small=2, up_leg=1)],
        ignore_state=("map_seconds",),
    )
    net = gpt2(**kw)
    plans = V.plan_levels(net, find_vcycle_adapter(net), 3)
    for step, level in ((3, 3), (4, 2)):
        checkpoint = torch.load(tmp_path / "ckpts" / f"step={step}.ckpt", weights_only=True)
        state = checkpoint["callbacks"]["VCycleCallback{'levels': 3, 'model_attr': 'net'}"]
        assert state["level"] == level and sorted(state["snapshots"]) == (["1", "2"] if level == 3 else ["1"])
        expected = state["weights"]
        for plan in reversed(plans[: level - 1]):
            expected = V.decoalesce(expected, plan)
        assert checkpoint["state_dict"]["net.transformer.wte.weight"].shape == (64, 32)
        for k, v in expected.items():
            assert torch.equal(checkpoint["state_dict"]["net." + k], v), (step, k)
        UserLM.load_from_checkpoint(tmp_path / "ckpts" / f"step={step}.ckpt", **kw)


@pytest.fixture(scope="module")
def four_layer_checkpoint(tmp_path_factory) -> Path:
    """A level-2 checkpoint (step 3) of a 2-level V-cycle on a 4-layer UserLM."""
    root = tmp_path_factory.mktemp("four")
    ckpt = ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    pl.seed_everything(0)
    trainer = make_trainer(root, [VCycleCallback(e_a=2, e_small=3), ckpt], max_steps=5, max_epochs=-1)
    trainer.fit(UserLM(n_layer=4, n_head=4), datamodule=user_data())
    return root / "step=3.ckpt"


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (
            dict(levels=3, e_a=1, e_small=1, up_leg=1),
            r"written by a V-cycle with levels=2, model_attr='net' .*at level 2\), this callback has levels=3, "
            r"model_attr='net'.*resume with the configuration it was written with",
        ),
        (dict(e_a=2, e_small=3, depth_scheme=None), r"configuration differs .*depth_scheme"),
    ],
    ids=["other_levels", "other_depth_scheme"],
)
def test_resume_refuses_a_checkpoint_of_another_configuration(tmp_path, four_layer_checkpoint, kwargs, error):
    """Before any weight loads: another number of levels (another state key: its state would be skipped and a new
    cycle would start on the checkpoint's weights) or another configuration raise, naming both."""
    model = UserLM(n_layer=4, n_head=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = make_trainer(tmp_path, [VCycleCallback(**kwargs)], max_steps=8, max_epochs=-1)
    with pytest.raises(ValueError, match=error):
        trainer.fit(model, datamodule=user_data(), ckpt_path=four_layer_checkpoint)
    assert trainer.global_step == 0 and all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_not_strict_resume_with_other_shapes_still_refuses(tmp_path, four_layer_checkpoint):
    """``strict=False`` warns about another configuration, but level-2 weights of other shapes cannot be loaded."""
    trainer = make_trainer(tmp_path, [VCycleCallback(e_a=2, e_small=3, depth_scheme=None, strict=False)], max_steps=8)
    with (
        pytest.warns(UserWarning, match="configuration differs"),
        pytest.raises(ValueError, match=r"level-2 weights do not fit the level-2 model of this configuration"),
    ):
        trainer.fit(UserLM(n_layer=4, n_head=4), datamodule=user_data(), ckpt_path=four_layer_checkpoint)


# ------------------------------------------------------------------------------------------------------ model_attr
class Distill(pl.LightningModule):
    """A teacher and a student GPT-2 (the student trains on the loss plus a KL term to the teacher)."""

    def __init__(self, freeze_teacher: bool) -> None:
        super().__init__()
        self.teacher, self.student = gpt2(), gpt2()
        self.teacher.requires_grad_(not freeze_teacher)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = unpack(batch)
        out = self.student(input_ids=x, labels=y)
        with torch.no_grad():
            target = self.teacher(input_ids=x).logits.log_softmax(-1)
        kl = nn.functional.kl_div(out.logits.log_softmax(-1), target, log_target=True, reduction="batchmean")
        return out.loss + kl

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05)


def test_network_found_without_model_attr():
    """One candidate is taken (a frozen teacher is not one); two ask for model_attr; none names what is supported."""
    attr, adapter = find_vcycle_network(Distill(freeze_teacher=True))
    assert attr == "student" and isinstance(adapter, HFGPT2VCycleAdapter)
    assert find_vcycle_network(UserLM())[0] == "net"
    with pytest.raises(
        ValueError,
        match=r"VCycleCallback\.model_attr: Distill holds several networks the V-cycle can coalesce: 'teacher' "
        r"\(GPT2LMHeadModel\), 'student' \(GPT2LMHeadModel\); pass model_attr=",
    ):
        find_vcycle_network(Distill(freeze_teacher=False))
    attr, adapter = find_vcycle_network(Distill(freeze_teacher=False), "teacher")
    assert attr == "teacher" and isinstance(adapter, HFGPT2VCycleAdapter)

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(4, 4)
            self.wrapped = nn.ModuleDict({"gpt": gpt2()})

    with pytest.raises(
        ValueError,
        match=r"no attribute of Plain holds a trainable network a registered V-cycle adapter handles \('head': no "
        r"V-cycle adapter for Linear; 'wrapped': no V-cycle adapter for ModuleDict\)\. The submodule 'wrapped\.gpt' "
        r"\(GPT2LMHeadModel\) is supported: hold it as an attribute .* Supported: hf_bert \(",
    ):
        find_vcycle_network(Plain())
    frozen = Distill(freeze_teacher=True).student.requires_grad_(False)
    host = nn.Module()
    host.student = frozen
    with pytest.raises(ValueError, match=r"'student': GPT2LMHeadModel, every parameter frozen"):
        find_vcycle_network(host)


def test_a_second_reference_to_the_network_is_refused():
    """The V-cycle replaces one attribute; another attribute holding part of the network would keep the old layers."""
    module = UserLM()
    module.head = module.net.lm_head
    with pytest.raises(ValueError, match=r"UserLM\.head share\(s\) parameters with UserLM\.net.* through self\.net"):
        find_vcycle_network(module)
    module = UserLM()
    module.alias = module.net  # the same network under two names: named as such, and sharing once one is chosen
    with pytest.raises(ValueError, match=r"UserLM\.net and UserLM\.alias are the same GPT2LMHeadModel, held under"):
        find_vcycle_network(module)
    with pytest.raises(ValueError, match=r"UserLM\.alias share\(s\) parameters with UserLM\.net"):
        find_vcycle_network(module, "net")


def test_two_trainable_networks_refused_at_setup_then_model_attr_chooses(tmp_path):
    """In a fit: two trainable networks raise in setup, before any step, asking for model_attr; with
    ``model_attr="student"`` the student goes through the cycle and the teacher is left as it is; with a frozen
    teacher the student is found."""
    trainer = make_trainer(tmp_path / "a", [VCycleCallback(e_a=1, e_small=2)], max_steps=4, max_epochs=-1)
    with pytest.raises(ValueError, match="several networks .*pass model_attr="):
        trainer.fit(Distill(freeze_teacher=False), datamodule=user_data())
    assert trainer.global_step == 0
    for freeze, model_attr in ((False, "student"), (True, None)):
        pl.seed_everything(0)
        module = Distill(freeze_teacher=freeze)
        teacher = {k: v.clone() for k, v in module.teacher.state_dict().items()}
        student = module.student
        cb = VCycleCallback(e_a=1, e_small=2, model_attr=model_attr)
        trainer = make_trainer(tmp_path / f"b{freeze}", [cb], max_steps=4, max_epochs=-1)
        trainer.fit(module, datamodule=user_data())
        assert cb.model_attr == "student" and cb.switches == 2 and module.student is student
        assert all(torch.equal(v, module.teacher.state_dict()[k]) for k, v in teacher.items())  # never replaced
