"""The Hydra app's own keys and the Trainer's integer settings checked at the start of ``lightning_effi.train.run``,
before anything is built (issue #21): a string for a flag (``train='no'`` would be true), an unknown
``optimized_mode``, ``trainer.max_steps=ten``."""

from __future__ import annotations

import pytest

import lightning_effi.train as train
from lightning_effi.utils.instantiate import ConfigError
from tests.helpers.hydra import compose_train


@pytest.fixture
def no_build(monkeypatch):
    """``train.build`` that fails the test: the checks must refuse the config before anything is built."""

    def build(cfg):
        raise AssertionError("build() was reached: the config was not checked first")

    monkeypatch.setattr(train, "build", build)


@pytest.mark.parametrize(
    "override, match",
    [
        ("train='no'", r"^train must be a bool \(true / false\), got 'no'$"),
        ("train='false'", r"^train must be a bool \(true / false\), got 'false'$"),
        ("test='false'", r"^test must be a bool \(true / false\), got 'false'$"),
        ("test=1", r"^test must be a bool \(true / false\), got 1$"),
        ("optimized_mode=maximize", r"^optimized_mode must be one of \('min', 'max'\), got 'maximize'$"),
        ("optimized_metric=3", r"^optimized_metric must be a str or None, got 3$"),
        # the default mode (null: from the name) and an explicit one against the name
        (
            "optimized_metric=val/foo",
            r"^optimized_mode is read from optimized_metric's name, and 'val/foo' says neither .*optimized_mode=max$",
        ),
        ("optimized_metric=val/acc optimized_mode=min", r"^optimized_mode=min contradicts optimized_metric=val/acc"),
        ("optimized_metric=val/foo optimized_mode=null", r"^optimized_mode is read from optimized_metric's name, and"),
        ("trainer.max_steps=ten", r"^trainer\.max_steps must be an int >= -1, got 'ten' \(a str\)$"),
        ("trainer.max_steps=2.5", r"^trainer\.max_steps must be an int >= -1, got 2\.5$"),
        ("trainer.max_epochs=-2", r"^trainer\.max_epochs must be an int >= -1, got -2$"),
        ("trainer.max_steps=0", r"^trainer\.max_steps=0 trains nothing: give an int >= 1, or -1"),  # qa58-args 09
        # the same empty training record; the LR schedule's own error (qa60-break 03)
        ("trainer.max_epochs=0", r"^trainer\.max_epochs=0 trains nothing: give an int >= 1, or -1"),
        ("+trainer.limit_train_batches=0", r"^trainer\.limit_train_batches=0 trains nothing: give an int >= 1"),
        ("+trainer.limit_train_batches=0.0", r"^trainer\.limit_train_batches=0\.0 trains nothing"),
        ("+trainer.accumulate_grad_batches=0", r"^trainer\.accumulate_grad_batches must be an int >= 1, got 0$"),
        ("trainer.log_every_n_steps=often", r"^trainer\.log_every_n_steps must be an int >= 1, got 'often' \(a str\)$"),
        # Lightning skips clipping at <= 0: a sign typo trained unclipped
        ("trainer.gradient_clip_val=-1", r"^trainer\.gradient_clip_val: expected a number >= 0 \(0 or null: no "),
        ("trainer.gradient_clip_val=high", r"^trainer\.gradient_clip_val: expected a number >= 0 .*got 'high'$"),
        ("tags=true", r"^tags: expected a list of strings \(tags='\[a,b\]'\), one string \(tags=a\) or null, got True"),
        ("tags=[[a],b]", r"^tags: expected a list of strings"),
    ],
)
def test_bad_settings_are_refused_before_anything_is_built(tmp_path, no_build, override, match):
    cfg = compose_train(override.split(" "), tmp_path)
    with pytest.raises(ConfigError, match=match):
        train.run(cfg)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["train=false", "test=true", "optimized_mode=max", "optimized_metric=null", "trainer.max_epochs=null"],
        ["bench=gpt_stack", "arm=baseline_50", "trainer.check_val_every_n_epoch=null"],  # max_steps interpolated
    ],
)
def test_valid_settings_pass_the_checks(tmp_path, overrides):
    cfg = compose_train(overrides, tmp_path)
    train.check_settings(cfg)  # raises nothing
    if "bench=gpt_stack" in overrides:
        assert cfg.trainer.max_steps == 1000  # round(2000 x 0.5): the interpolation was resolved and checked


@pytest.mark.parametrize(
    "overrides, mode",
    [
        ([], "min"),
        (["optimized_metric=val/acc"], "max"),
        (["experiment=cifar10_cnn"], "max"),
        (["optimized_metric=null"], "min"),
        (["optimized_metric=val/acc", "optimized_mode=null"], "max"),
    ],
)
def test_the_mode_is_read_from_the_metric_name_and_reaches_the_checkpoint_callback(tmp_path, overrides, mode):
    """Overriding only optimized_metric=val/acc kept the default mode min: ModelCheckpoint kept the worst weights and
    the report ranked the runs backwards. The default is now null: read from the metric's name."""
    cfg = compose_train([*overrides, "callbacks=default"], tmp_path)
    train.check_settings(cfg)
    assert cfg.optimized_mode == mode
    checkpoint = next(c for c in cfg.callbacks.values() if c and "ModelCheckpoint" in str(c.get("_target_")))
    assert checkpoint.mode == mode


def test_a_checkpoint_holding_an_omegaconf_node_passes_the_resume_check(tmp_path):
    """The app's ImageClassifier saves its model_kwargs (a DictConfig) among the hyperparameters: torch's
    weights-only loader refused the file, and the app called its own checkpoint "not a readable Lightning
    checkpoint". The check now reads it as the resume does; damaged files and other models are still refused."""
    import torch
    from omegaconf import OmegaConf

    model = torch.nn.Linear(2, 3)
    path = tmp_path / "last.ckpt"
    torch.save(
        {"state_dict": model.state_dict(), "hyper_parameters": {"model_kwargs": OmegaConf.create({"width": 2})}}, path
    )
    train.check_checkpoint(str(path), model)
    with pytest.raises(ConfigError, match=r"holds weights of a different model"):
        train.check_checkpoint(str(path), torch.nn.Linear(2, 4))
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ConfigError, match=r"is not a readable Lightning checkpoint"):
        train.check_checkpoint(str(path), model)


def test_a_checkpoint_of_another_head_count_is_refused(tmp_path):
    """Weights of one shape under another n_head: a 2-head checkpoint was tested as a 4-head model (qa61-ideas 04).
    Settings the weights do not fix (dropout, weight_decay) may differ."""
    import torch

    from tests.helpers.tiny import tiny_gpt2

    path = tmp_path / "last.ckpt"
    two = tiny_gpt2(n_head=2)
    torch.save({"state_dict": two.state_dict(), "hyper_parameters": dict(two.hparams)}, path)
    train.check_checkpoint(str(path), tiny_gpt2(n_head=2, dropout=0.3, weight_decay=0.5))
    train.check_checkpoint(str(path), tiny_gpt2(n_head=2, dropout=0, weight_decay=0))  # ints, no architecture
    with pytest.raises(ConfigError, match=r"\(model settings \(checkpoint vs model\) \['n_head 2 vs 4'\]"):
        train.check_checkpoint(str(path), tiny_gpt2(n_head=4))
    # a timm model's head count among its model_kwargs (qa62-break 04)
    vit = {"model_name": "vit_tiny", "model_kwargs": {"num_heads": 4, "drop_rate": 0.0}}
    assert train._architecture_differences(vit, {**vit, "model_kwargs": {"num_heads": 2, "drop_rate": 0.1}}) == [
        "model_kwargs.num_heads 4 vs 2"
    ]
    # a user module's int settings that are no architecture: a resume that extends the run (qa63-break 02)
    own = {"n_head": 4, "warmup_steps": 100, "max_epochs": 10, "batch_size": 32, "num_workers": 2}
    assert train._architecture_differences(own, {**own, "warmup_steps": 200, "max_epochs": 20, "num_workers": 0}) == []
    assert train._architecture_differences(own, {**own, "n_head": 8}) == ["n_head 4 vs 8"]
    # a name that only holds such a word is none (head_lr_mult, a metric's top_k); per-stage head counts are
    # (qa65-break 03, 04)
    other = {"head_lr_mult": 10, "top_k": 5, "num_heads": [1, 2, 5, 8], "moe_top_k": 2}
    changed = {"head_lr_mult": 1, "top_k": 1, "num_heads": [1, 2, 4, 8], "moe_top_k": 1}
    told = ["num_heads [1, 2, 5, 8] vs [1, 2, 4, 8]", "moe_top_k 2 vs 1"]
    assert train._architecture_differences(other, changed) == told
    # written on one side only: the other side's default is unknown (a timm ViT saved with its default 3 heads resumed
    # with num_heads=6 was accepted, qa67-break 03); a rotary model at a longer context is no other (qa67-break 08)
    default = {"model_kwargs": {"depth": 2}, "max_position_embeddings": 64}
    given = {"model_kwargs": {"depth": 2, "num_heads": 6}, "max_position_embeddings": 128}
    assert train._architecture_differences(default, given) == ["model_kwargs.num_heads (not set) vs 6"]
    assert train._architecture_differences(given, default) == ["model_kwargs.num_heads 6 vs (not set)"]


@pytest.mark.parametrize(
    "override, tags",
    [("tags=mytag", ["mytag"]), ("tags=5", ["5"]), ("tags=[a,b]", ["a", "b"]), ("tags=null", []), (None, ["dev"])],
)
def test_one_tag_is_a_tag_not_its_characters(tmp_path, override, tags):
    """``tags=mytag`` was recorded as ['m', 'y', 't', 'a', 'g'], and ``tags=5`` ended in a bare TypeError."""
    cfg = compose_train([override] if override else [], tmp_path)
    train.check_settings(cfg)
    assert train.run_tags(cfg) == tags
