"""Every technique from a LightningCLI YAML (``lightning.pytorch.cli.LightningCLI``): the callbacks under
``trainer.callbacks``, the technique's DataModule wrapper as ``data`` around the user's DataModule
(``data: class_path: ..., init_args: datamodule: class_path: ...``). Each test writes its YAML in ``tmp_path``, runs
``fit`` on a tiny GPT-2 (the shipped reference task) over the shared tiny token blocks, and checks the technique's
effect by hand count."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("jsonargparse")  # the `cli` extra (also in `dev`)

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402

from lightning_effi.random_ltd import functional as ltd  # noqa: E402

#: quiet, deterministic CPU training; the model and the user's DataModule (16 blocks of 16 tokens, batches of 8)
COMMON = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  num_sanity_val_steps: 0
  limit_val_batches: 0
  deterministic: true
model:
  class_path: lightning_effi.tasks.GPT2CausalLM
  init_args:
    vocab_size: 64
    n_positions: 32
    n_layer: 2
    n_embd: 32
    n_head: 2
    attn_implementation: eager
    optimizer: {class_path: torch.optim.SGD, init_args: {lr: 0.05}}
"""
USER_DATA = """\
class_path: tests.helpers.tiny.TinyDataModule
init_args: {train: {class_path: tests.helpers.tiny.TokenBlocks, init_args: {n: 16}}, batch_size: 8}"""
N, BATCH, T = 16, 8, 16


def data(wrapper: str | None, extra: str = "") -> str:
    """The ``data:`` section: the user's DataModule, inside ``wrapper`` (a class path) when given."""
    if wrapper is None:
        return "data:\n" + textwrap.indent(USER_DATA, "  ") + "\n"
    inner = "datamodule:\n" + textwrap.indent(USER_DATA, "  ") + "\n" + extra
    return f"data:\n  class_path: {wrapper}\n  init_args:\n" + textwrap.indent(inner, "    ")


def fit(tmp_path: Path, config: str) -> LightningCLI:
    """``LightningCLI(args=["fit", "--config", common, "--config", technique])`` (the later file overrides and adds
    keys), run to the end of ``fit``."""
    common, technique = tmp_path / "common.yaml", tmp_path / "technique.yaml"
    common.write_text(COMMON)
    technique.write_text(config)
    return LightningCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=["fit", "--config", str(common), "--config", str(technique), f"--trainer.default_root_dir={tmp_path}"],
        save_config_kwargs={"overwrite": True},
    )


def callback(cli: LightningCLI, name: str) -> Any:
    (found,) = [c for c in cli.trainer.callbacks if type(c).__name__ == name]
    return found


SEQLEN = """\
seqlen_truncate:
  difficulty_type: value
  clustering_type: single_cluster
  min_difficulty: 4
  max_difficulty: 16
  schedule_type: fixed_linear
  schedule_config: {total_curriculum_step: 3, difficulty_step: 4}
"""  # 8, 12, 16, 16 tokens at steps 1..4: 4 + 12 * s / 3


@pytest.mark.parametrize("where", ["callback", "datamodule"])
def test_curriculum(tmp_path, where):
    """Configured on the callback (a bare CurriculumDataModule, whose options the CLI fills with None: they used to
    arrive as defaults and be refused as "options given without metrics") or on the DataModule (a bare callback,
    its options filled with their defaults). The batches follow the schedule; the monitor counts the saving."""
    metrics = "metrics:\n" + textwrap.indent(SEQLEN, "  ")
    on_callback = "  init_args:\n" + textwrap.indent(metrics, "    ") if where == "callback" else ""
    on_data = metrics + "seed: 3\n" if where == "datamodule" else ""
    cli = fit(
        tmp_path,
        f"""\
trainer:
  max_steps: 4
  callbacks:
    - class_path: lightning_effi.EfficiencyMonitor
      init_args: {{print_summary: false}}
    - class_path: lightning_effi.Curriculum
{textwrap.indent(on_callback, "    ")}
    - class_path: tests.cli.recorders.Batches
"""
        + data("lightning_effi.CurriculumDataModule", on_data),
    )
    lengths = [8, 12, 16, 16]
    assert callback(cli, "Batches").shapes == [(BATCH, n) for n in lengths]
    curriculum = callback(cli, "Curriculum")
    assert curriculum.consumed_tokens == BATCH * sum(lengths)
    assert (curriculum.config or cli.datamodule.config).seed == (3 if where == "datamodule" else 1234)
    summary = callback(cli, "EfficiencyMonitor").summary
    assert summary["baseline_tokens"] == 4 * BATCH * T and summary["tokens"] == BATCH * sum(lengths)
    assert summary["saved/curriculum/tokens_frac"] == pytest.approx(1 - sum(lengths) / (4 * T))


def test_a_wrapped_datamodule_that_saves_its_hyperparameters_gets_its_own(tmp_path):
    """Under LightningCLI every DataModule built for ``data`` gets that entry's config as its hyperparameters: the
    wrapped one got the wrapper's (``_class_path`` CurriculumDataModule, its own settings nested under
    ``datamodule``) and failed in its ``setup`` reading ``self.hparams.n`` (qa39-user 01). It gets its own; the
    wrapper holds the whole ``data`` entry (the loggers' and the checkpoint's DataModule hyperparameters)."""
    saving = "class_path: tests.cli.recorders.SavingDataModule\ninit_args: {n: 24, batch_size: 8}"
    metrics = "metrics:\n" + textwrap.indent(SEQLEN, "  ")
    inner = "datamodule:\n" + textwrap.indent(saving, "  ") + "\n" + metrics
    cli = fit(
        tmp_path,
        "trainer:\n  max_steps: 3\n  callbacks:\n    - class_path: lightning_effi.Curriculum\n"
        "    - class_path: tests.cli.recorders.Batches\n"
        "data:\n  class_path: lightning_effi.CurriculumDataModule\n  init_args:\n" + textwrap.indent(inner, "    "),
    )
    user = cli.datamodule.datamodule
    assert {k: v for k, v in user.hparams.items() if not k.startswith("_")} == {"n": 24, "batch_size": 8}
    assert user.hparams["_class_path"] == "tests.cli.recorders.SavingDataModule" and len(user.train_dataset) == 24
    assert cli.datamodule.hparams["_class_path"] == "lightning_effi.CurriculumDataModule"
    assert cli.datamodule.hparams["datamodule"]["init_args"] == {"n": 24, "batch_size": 8}
    assert callback(cli, "Batches").shapes == [(8, 8), (8, 12), (8, 16)]


def test_a_wrapper_under_the_cli_logs_no_hyperparameters_that_clash_with_the_modules(tmp_path):
    """The wrapper's CLI config holds its unset options as None (``seed``, ``num_epochs``, ...): logged as the
    DataModule's hyperparameters beside a module's ``seed`` and ``num_epochs``, Lightning's merge refused the fit
    (qa81-regress 01). Under the CLI the wrapper keeps them out of the loggers, as before; the checkpoint holds them."""
    config = tmp_path / "config.yaml"
    config.write_text(
        "seed_everything: 0\n"
        "trainer: {accelerator: cpu, devices: 1, max_steps: 2, enable_progress_bar: false,\n"
        "  enable_model_summary: false, limit_val_batches: 0,\n"
        "  logger: {class_path: lightning.pytorch.loggers.CSVLogger, init_args: {save_dir: " + str(tmp_path) + "}},\n"
        "  callbacks: [{class_path: lightning_effi.Curriculum}]}\n"
        "model: {class_path: tests.cli.recorders.SeededLM, init_args: {seed: 1, num_epochs: 2}}\n"
        "data:\n  class_path: lightning_effi.CurriculumDataModule\n  init_args:\n"
        "    datamodule: {class_path: tests.cli.recorders.SavingDataModule, init_args: {n: 24, batch_size: 8}}\n"
        "    metrics:\n" + textwrap.indent(SEQLEN, "      ")
    )
    cli = LightningCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=["fit", "--config", str(config), f"--trainer.default_root_dir={tmp_path}"],
        save_config_kwargs={"overwrite": True},
    )
    assert cli.trainer.global_step == 2 and not cli.datamodule._log_hyperparams
    assert cli.datamodule.hparams["seed"] is None and cli.model.hparams["seed"] == 1


def test_a_result_writer_in_the_yaml_records_the_run_and_its_configuration(tmp_path):
    """A CLI run has no place to call write_result after fit: ResultWriter does it in on_fit_end, listed before the
    monitor too (write_result refused there: the monitor sums the fit up in its own on_fit_end, qa39-user 02), and
    records the CLI's configuration as overrides (the report could not tell a 3-layer arm from 4-layer baselines,
    qa39-user 03): the user's DataModule's entry, not the technique's wrapper, and no callbacks."""
    import json

    cli = fit(
        tmp_path,
        "trainer:\n  max_steps: 3\n  callbacks:\n"
        "    - class_path: lightning_effi.report.ResultWriter\n"
        f"      init_args: {{metric: train/loss, out_dir: {tmp_path / 'run'}}}\n"
        "    - class_path: lightning_effi.EfficiencyMonitor\n      init_args: {print_summary: false}\n"
        "    - class_path: lightning_effi.Curriculum\n"
        + data("lightning_effi.CurriculumDataModule", "metrics:\n" + textwrap.indent(SEQLEN, "  ")),
    )
    record = json.loads((tmp_path / "run" / "result.json").read_text())
    monitor = callback(cli, "EfficiencyMonitor")
    assert record["efficiency"]["tokens"] == monitor.summary["tokens"] == BATCH * (8 + 12 + 16)
    assert record["arm"] == "curriculum" and "curriculum" in record["techniques"]
    overrides = dict(o.split("=", 1) for o in record["overrides"])
    assert overrides["model.init_args.n_layer"] == "2" and overrides["trainer.max_steps"] == "3"
    assert overrides["data.class_path"] == '"tests.helpers.tiny.TinyDataModule"'
    assert overrides["data.init_args.batch_size"] == "8"
    assert not [
        k for k in overrides if k.startswith(("trainer.callbacks", "seed_everything", "data.init_args.metrics"))
    ]


def test_infobatch(tmp_path):
    """Four epochs, prune_ratio 0.5, delta 0.875: epochs 1 and 2 prune well-learned samples; the samples trained are
    the 4 x 16 drawn minus the pruned ones."""
    cli = fit(
        tmp_path,
        """\
trainer:
  max_epochs: 4
  callbacks:
    - class_path: lightning_effi.InfoBatchCallback
      init_args: {prune_ratio: 0.5, delta: 0.875, seed: 0}
    - class_path: tests.cli.recorders.Batches
"""
        + data("lightning_effi.InfoBatchDataModule"),
    )
    infobatch = callback(cli, "InfoBatchCallback")
    assert [h["kind"] for h in infobatch.history] == ["full", "prune", "prune", "full"]
    saved = infobatch.effi_summary()["infobatch/saved_samples"]
    assert saved == sum(h["saved"] for h in infobatch.history) > 0
    trained = [shape[0] for shape in callback(cli, "Batches").shapes]
    assert sum(trained) == 4 * N - saved
    assert cli.trainer.global_step == len(trained) == sum(math.ceil(h["size"] / BATCH) for h in infobatch.history)


def test_random_ltd(tmp_path):
    """min_value 4 -> max_value 8 over 3 steps on the two middle layers of a 4-layer GPT-2: those layers see r
    tokens of each sample, the outer two all 16."""
    cli = fit(
        tmp_path,
        """\
model:
  init_args: {n_layer: 4}
trainer:
  max_steps: 4
  callbacks:
    - class_path: lightning_effi.RandomLTDCallback
      init_args: {min_value: 4, max_value: 8, require_steps: 3, seq_per_step: 4, seed: 7}
"""
        + data(None),
    )
    r = [ltd.ltd_value(s, 4, 8, 3, 4) for s in range(4)]
    assert r == [4, 4, 4, 8]
    summary = callback(cli, "RandomLTDCallback").effi_summary()
    assert summary["random_ltd/full_layer_tokens"] == 4 * BATCH * T * 4
    assert summary["random_ltd/consumed_layer_tokens"] == sum(2 * BATCH * T + 2 * BATCH * v for v in r)


def test_vcycle(tmp_path):
    """Two levels: 2 steps on the full model, 3 on the coarse one (half the width, half the layers), the rest on the
    full model again."""
    cli = fit(
        tmp_path,
        """\
trainer:
  max_steps: 7
  callbacks:
    - class_path: lightning_effi.VCycleCallback
      init_args: {e_a: 2, e_small: 3, alpha_original: 0.3, lr_multiplier: {2: 4.0}}
    - class_path: tests.cli.recorders.Batches
"""
        + data(None),
    )
    assert callback(cli, "Batches").sizes == [(32, 2)] * 2 + [(16, 1)] * 3 + [(32, 2)] * 2
    vcycle = callback(cli, "VCycleCallback")
    assert vcycle.switches == 2 and vcycle.level == 1 and cli.trainer.global_step == 7


def test_the_readmes_command_line_append_adds_the_technique_to_the_yaml_stack(tmp_path):
    """The README's `--trainer.callbacks+=lightning_effi.VCycleCallback` failed as written: the V-cycle's stage
    lengths have no defaults (qa54-docs 01). The arguments it gives now build the stack, read from the README."""
    import re

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    found = re.search(r"append it with\s+`([^`]+)`", readme)
    assert found is not None
    common, technique = tmp_path / "common.yaml", tmp_path / "technique.yaml"
    common.write_text(COMMON)
    technique.write_text("trainer:\n  max_steps: 4\n  callbacks:\n    - class_path: lightning_effi.EfficiencyMonitor\n")
    technique.write_text(technique.read_text() + data(None))
    cli = LightningCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        args=["--config", str(common), "--config", str(technique), *found.group(1).split()],
        save_config_callback=None,
    )
    names = [type(c).__name__ for c in cli.trainer.callbacks]
    assert names.index("EfficiencyMonitor") < names.index("VCycleCallback")


def test_yaml_values_jsonargparse_types_from_the_signatures_are_accepted():
    """A duration given as a mapping kept its step count an int only if ``Duration.value`` is typed so (it was
    ``float``: ``e_small: {value: 6, unit: step}`` refused with "got 6.0"), and a per-sample loss function without a
    return annotation was refused by the ``Callable[[Any, Any], Tensor]`` type (qa52-cli 02, 03)."""
    from jsonargparse import ArgumentParser

    from lightning_effi import InfoBatchCallback, VCycleCallback
    from lightning_effi.core.progress import Duration
    from tests.cli.recorders import per_sample_cross_entropy

    parser = ArgumentParser()
    parser.add_class_arguments(VCycleCallback, "vcycle")
    parser.add_class_arguments(InfoBatchCallback, "infobatch")
    config = parser.parse_object(
        {
            "vcycle": {"e_a": "2st", "e_small": {"value": 6, "unit": "step"}},
            "infobatch": {"prune_ratio": 0.5, "per_sample_loss": "tests.cli.recorders.per_sample_cross_entropy"},
        }
    )
    built = parser.instantiate_classes(config)
    assert built.vcycle.e_small == Duration(6, "step") and type(built.vcycle.e_small.value) is int
    assert built.infobatch.per_sample_loss is per_sample_cross_entropy


def test_the_vcycle_refuses_lightning_clis_own_optimizer_at_setup(tmp_path):
    """LightningCLI's top-level ``optimizer:`` builds one optimizer before the fit and its configure_optimizers
    returns it at every call: the V-cycle's first level change failed, with advice about caching (qa52-cli 01).
    Refused at setup, naming the remedy."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    config = """\
optimizer: {class_path: torch.optim.SGD, init_args: {lr: 0.05}}
trainer:
  max_steps: 4
  callbacks:
    - class_path: lightning_effi.VCycleCallback
      init_args: {e_a: 1, e_small: 2}
""" + data(None)
    with (
        pytest.warns(UserWarning, match="configure_optimizers` will be overridden"),
        pytest.raises(MisconfigurationException, match=r"is LightningCLI's, for its `optimizer:`.*OptimizerCallable"),
    ):
        fit(tmp_path, config)
