"""The compatibility matrix, how the model runs: ``torch.compile``, the precisions and the distributed strategies, each
with every technique column (:data:`~tests.compat.setups.TECHNIQUES`).

- ``torch_compile``: both ways users compile under Lightning, ``trainer.fit(torch.compile(model))`` (Lightning unwraps
  the ``OptimizedModule`` and compiles ``training_step``, ``lightning.pytorch.utilities.compile``) and a compiled
  submodule (``module.model = torch.compile(module.model)``), with a counting backend
  (``torch._dynamo.testing.CompileCounter``: the captured graphs run as traced, no inductor, whose C++ builds take
  minutes on CPU). Each cell counts the graphs compiled at every step: compiles happen only when the run changes
  (warm-up, a new epoch, a new network, a batch shape not seen before, the first new reserved length), never per step.
- ``bf16_mixed``, ``bf16_true``, ``fp16_mixed``, ``fp64_true``: the dtypes of the parameters, of the hidden states
  entering every block and of the matmuls (autocast), InfoBatch's score table and loss weights (float32, exact).
- ``ddp`` (``strategy="ddp"``: Lightning relaunches the script, so the cells run in one worker process, this module
  run as a script), ``ddp_spawn`` (spawned from the test, :func:`tests.helpers.harness.fit_ddp`), ``fsdp`` (the
  worker, torch's FSDP on CPU: see :class:`CPUFSDPStrategy`): 2 CPU processes (gloo); each rank's probe shows the
  technique's effect, the ranks trained different samples and end with the same weights (FSDP: each rank held half).
- ``deepspeed``: deepspeed is not installed: Lightning refuses ``Trainer(strategy="deepspeed")`` itself, and every
  technique refuses the ``DeepSpeedStrategy`` class at ``setup`` (tested with a strategy class of that name).

Worker (the ``ddp`` and ``fsdp`` cells launch it): ``python -m tests.compat.test_runtime <ddp|fsdp> <out_dir>
<technique>...`` fits each technique with 2 processes and writes each rank's records under ``<out_dir>/<technique>``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import FSDPStrategy, SingleDeviceStrategy
from torch._dynamo.testing import CompileCounter

from lightning_effi import InfoBatchCallback
from lightning_effi.tasks import GPT2CausalLM
from tests.compat.registry import Row, expect, works
from tests.compat.setups import (
    LAYERS,
    REFUSED,
    TECHNIQUES,
    WORKS,
    Probe,
    Run,
    assert_effect,
    assert_refused,
    build,
)
from tests.helpers.harness import RecordBatches, fit_ddp, make_trainer
from tests.helpers.tiny import TINY_GPT2, sgd

ROOT = Path(__file__).resolve().parents[2]

ROWS: list[Row] = [
    Row(
        "torch_compile",
        "torch.compile",
        works(),
        "trainer.fit(torch.compile(model)) and a compiled submodule both train with the technique's effect, "
        "compiling again only when the run changes (a new epoch, network, batch shape, or the first new reserved "
        "length), never per step: random-LTD draws its tokens outside the graph and marks the reserved length "
        "dynamic (tested with a counting backend, no inductor). The V-cycle replaces the network: "
        "trainer.fit(torch.compile(model)) recompiles once per level and trains the new network; a compiled "
        "submodule is refused before the first step, also one compiled in configure_model (the levels' plain "
        "networks would replace it). The all-four stack needs "
        "torch._dynamo.config.recompile_limit=16: its many regimes recompile transformers' shared decorator frame "
        "more than the default 8 times. The EfficiencyMonitor records a compiled module once per regime (batch and "
        "parameter shapes), in one uncompiled step, and leaves the other steps one graph; it counts a compiled fit's "
        "FLOPs, layer-tokens and samples exactly as the uncompiled run's.",
    ),
    Row(
        "bf16_mixed",
        'Trainer(precision="bf16-mixed")',
        works(),
        "float32 parameters and hidden states in every block (also those random-LTD scattered and the V-cycle's "
        "coarse network), bfloat16 matmuls; InfoBatch's scores and loss weights float32 and exact.",
    ),
    Row(
        "bf16_true",
        'Trainer(precision="bf16-true")',
        works(),
        "bfloat16 parameters and hidden states in every block, the V-cycle's coarse network included; InfoBatch's "
        "scores and loss weights stay float32 (not bfloat16-rounded).",
    ),
    Row(
        "fp16_mixed",
        'Trainer(precision="16-mixed")',
        works(),
        "float16 matmuls with a gradient scaler, float32 parameters and hidden states; InfoBatch's scores and loss "
        'weights float32 and exact. On CPU Lightning runs precision="16-mixed" as "bf16-mixed" (with a '
        'warning); the cells pass its fp16 plugin, MixedPrecision("16-mixed", "cpu"), to train in float16.',
    ),
    Row(
        "fp64_true",
        'Trainer(precision="64-true")',
        works(),
        "float64 parameters and hidden states in every block, the V-cycle's coarse network included; InfoBatch's "
        "scores, loss weights and weighted loss float32 (exact weights).",
    ),
    Row(
        "ddp",
        'Trainer(strategy="ddp")',
        works(),
        "2 processes (Lightning relaunches the script): the technique acts on each rank, the ranks train different "
        "samples at every step and end with identical weights.",
    ),
    Row(
        "ddp_spawn",
        'Trainer(strategy="ddp_spawn")',
        works(),
        "2 spawned processes: the technique acts on each rank, the ranks train different samples at every step and "
        "end with identical weights.",
    ),
    Row(
        "fsdp",
        'Trainer(strategy="fsdp")',
        works(vcycle=REFUSED, stack=REFUSED),
        "2 CPU processes (Lightning's FSDPStrategy, with torch's FSDP told the CPU device; Lightning itself asks "
        "for a GPU), each holding half the parameters, identical full weights at the end. The V-cycle refuses FSDP "
        "(the sharded wrapper cannot be rebuilt at a level change), and so the stack; InfoBatch trains fresh FSDP "
        "fits and refuses to resume one (FSDP restores checkpoints after setup, later than its resume needs).",
    ),
    Row(
        "deepspeed",
        'Trainer(strategy="deepspeed")',
        works(**dict.fromkeys(TECHNIQUES, REFUSED)),
        "every technique refuses the DeepSpeedStrategy at setup (its engine partitions the model and owns the "
        "precision and gradient steps, which the techniques are not validated with); use ddp or fsdp, or DeepSpeed's "
        "own curriculum and random-LTD. Without the deepspeed package Lightning refuses the strategy itself.",
    ),
]


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread per test: the tiny matmuls in bfloat16, float16 and float64 run about 10x faster than
    with threads that wait for each other on a busy machine (the multi-process cells get one thread per process from
    Lightning)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


#: the optimizer steps of a multi-process cell bounded by steps (the curriculum's sample budget on 2 ranks: 24
#: samples x 2 epochs / (4 x 2) = 6 steps)
DISTRIBUTED_STEPS = 6


# ------------------------------------------------------------------------------------------------------ compile
class CompileSafeProbe(Probe):
    """The matrix's probe with its recording hook run eagerly (``torch.compiler.disable``): under ``torch.compile``
    it measures what each ``ln_1`` received at run time, and it adds no guard of its own (a traced hook guards on the
    shapes it already recorded and would recompile the graphs whenever they change)."""

    _record = torch.compiler.disable(Probe._record)


def _depth(pl_module: pl.LightningModule) -> int:
    return sum(name.endswith("ln_1") for name, _ in pl_module.named_modules())


class CompileLog(Callback):
    """Per training batch: the graphs compiled while it ran (``CompileCounter``), the depth of the network in place
    and the loss. Put it before the probe (its records pair with the probe's, batch by batch)."""

    def __init__(self, counter: CompileCounter) -> None:
        self.counter = counter
        self.steps: list[dict[str, Any]] = []
        self._before = self._depth_now = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._before = int(self.counter.frame_count)
        self._depth_now = _depth(pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.steps.append(
            dict(
                compiled=int(self.counter.frame_count) - self._before,
                depth=self._depth_now,
                batch_idx=idx,
                loss=float(outputs["loss"]),
            )
        )


def _guard_failures() -> dict[Any, int]:
    from torch._dynamo.utils import guard_failures

    return {code: len(reasons) for code, reasons in guard_failures.items()}


def _new_guard_failures(before: dict[Any, int], where: str) -> list[str]:
    """The recompile reasons recorded since ``before`` for the frames of source files under ``where``."""
    from torch._dynamo.utils import guard_failures

    return [
        reason
        for code, reasons in guard_failures.items()
        if where in code.co_filename
        for reason in reasons[before.get(code, 0) :]
    ]


#: dynamo's recompile limit per code object in the compiled cells: its default (8), and 16 for the all-four stack.
#: Graph breaks inside the model (random-LTD's eager token draw, the probe's eager hooks) make transformers'
#: ``deprecate_kwarg`` wrapper, one code object for several GPT-2 methods, a frame of its own, compiled once per
#: method, call pattern and regime; the stack's regimes (3 sequence lengths, 2 batch sizes, 2 networks, random-LTD
#: active or paused) need more than 8 of them (a bounded number: no step compiles in a regime seen before)
RECOMPILE_LIMIT = {"stack": 16}


def _compiled_fit(technique: str, form: str, root: Path) -> tuple[Run, CompileCounter, CompileLog, list[str]]:
    """Fit ``technique`` compiled in ``form`` (``"fit"``: ``trainer.fit(torch.compile(model))``; ``"module"``:
    ``module.model = torch.compile(module.model)``); dynamo fails any frame that reaches its recompile limit. Returns
    the run, the counter, the per-batch log and the recompile reasons of random-LTD's frames."""
    torch.compiler.reset()
    run = build(technique)
    run.probe = CompileSafeProbe()
    counter = CompileCounter()
    log = CompileLog(counter)
    trainer = run.trainer(root, extra=[log])
    before = _guard_failures()
    limit = RECOMPILE_LIMIT.get(technique, 8)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=limit):
        if form == "fit":
            trainer.fit(torch.compile(run.model, backend=counter), datamodule=run.datamodule)
        else:
            run.model.model = torch.compile(run.model.model, backend=counter)
            trainer.fit(run.model, datamodule=run.datamodule)
    return run, counter, log, _new_guard_failures(before, os.path.join("lightning_effi", "random_ltd"))


def _assert_compiled(run: Run, counter: CompileCounter, log: CompileLog, ltd_reasons: list[str]) -> None:
    """The compiled run trained with the technique's effect, ran the network in place at every step, and compiled
    only where the run changed: its first two steps, the first batch of an epoch (Lightning's logging guards), a
    batch whose blocks received shapes never seen before (a new network, batch shape, sequence length or reserved
    length); of those, a reserved length that is the only novelty compiles at most once (dynamo then treats it as
    dynamic). Random-LTD's own frames recompile only for a tensor's size, never for its per-step state."""
    batches = run.probe.batches
    assert counter.frame_count > 0, "nothing was compiled"
    assert len(log.steps) == len(batches) > 0
    assert_effect(run)
    for i, (step, batch) in enumerate(zip(log.steps, batches)):
        assert len(batch["blocks"]) == step["depth"], f"batch {i} did not run the network in place: {batch}"
        assert torch.isfinite(torch.tensor(step["loss"])), step
    seen: set[tuple] = set()
    seen_shapes: set[tuple] = set()
    r_only = 0
    for i, (step, batch) in enumerate(zip(log.steps, batches)):
        shapes = tuple(tuple(s) for s in batch["blocks"])
        outer = (len(shapes), shapes[0], shapes[-1])  # the network's depth, the batch's (B, S, H)
        if step["compiled"] and i >= 2 and step["batch_idx"] > 0:
            assert shapes not in seen, f"step {i + 1} compiled {step['compiled']} graphs in a regime seen before"
            r_only += outer in seen_shapes
        seen.add(shapes)
        seen_shapes.add(outer)
    assert r_only <= 1, f"{r_only} steps compiled for a new reserved length alone"
    sizes = [r for r in ltd_reasons if "size mismatch" not in r]
    assert not sizes, f"random-LTD's frames recompiled for their state: {sizes}"


@pytest.mark.slow
@pytest.mark.parametrize("technique", TECHNIQUES)
def test_torch_compile(tmp_path, technique):
    """Both forms of compiling (:func:`_compiled_fit`) train with the technique's effect and compile only where the
    run changes (:func:`_assert_compiled`); with the V-cycle, ``trainer.fit(torch.compile(model))`` compiles every new
    network and trains it, and a compiled submodule is refused at setup."""
    assert expect("torch_compile", technique) == WORKS
    run, counter, log, reasons = _compiled_fit(technique, "fit", tmp_path / "fit")
    _assert_compiled(run, counter, log, reasons)
    if "random_ltd" in run.names:
        reserved = {tuple(s[1] for s in b["blocks"][1:-1]) for b in run.probe.batches if len(b["blocks"]) == 4}
        assert len(reserved) >= 3, f"the reserved length changed too little to test recompiles: {reserved}"
    if "vcycle" in run.names:
        # the coarse network trained, compiled, and the full one after it
        depths = [s["depth"] for s in log.steps]
        assert 2 in depths and depths[0] == depths[-1] == 4, depths
        changes = [i for i in range(1, len(depths)) if depths[i] != depths[i - 1]]
        assert all(log.steps[i]["compiled"] for i in changes), "a new network ran without being compiled"
        # a compiled submodule would be replaced by the levels' plain networks: refused
        torch.compiler.reset()
        refused = build(technique)
        refused.model.model = torch.compile(refused.model.model, backend=CompileCounter())
        assert_refused(refused, refused.trainer(tmp_path / "module"), "torch.compile'd submodule")
        return
    run, counter, log, reasons = _compiled_fit(technique, "module", tmp_path / "module")
    _assert_compiled(run, counter, log, reasons)


def test_vcycle_refuses_a_network_compiled_in_configure_model(tmp_path):
    """A network compiled in ``configure_model`` (Lightning's place for ``torch.compile``, run after the callbacks'
    ``setup``) is refused before the first step as one compiled in ``__init__`` is, not trained at level 1 until a
    bare ``TypeError`` at the first level change (qa113-cli 01)."""

    class CompiledInConfigureModel(GPT2CausalLM):
        def configure_model(self) -> None:
            if not isinstance(self.model, torch._dynamo.OptimizedModule):
                self.model = torch.compile(self.model, backend=CompileCounter())

    torch.compiler.reset()
    run = build("vcycle", lambda: CompiledInConfigureModel(**{**TINY_GPT2, "optimizer": sgd, "n_layer": LAYERS}))
    assert not isinstance(run.model.model, torch._dynamo.OptimizedModule)  # compiled after the callbacks' setup
    assert_refused(run, run.trainer(tmp_path), "torch.compile'd submodule")


@pytest.mark.slow
def test_random_ltd_compiles_once_for_every_reserved_length(tmp_path):
    """A compiled 12-layer GPT-2 (10 LTD layers) under a schedule whose reserved length changes every other step
    compiles its graphs at the first step and never again: the token draws run eagerly and the reserved-length axis is
    dynamic. ``dynamic=False`` (no automatic dynamic shapes): a frame guarded on the controller's step, or a static
    reserved length, would recompile at every step or every new length."""
    from lightning_effi import RandomLTDCallback
    from tests.harness.settings import seeded
    from tests.helpers.tiny import tiny_gpt2

    torch.compiler.reset()
    run = build("random_ltd", model_fn=seeded(tiny_gpt2, n_layer=12))
    ltd = RandomLTDCallback(min_value=4, max_value=16, seq_per_step=2, require_steps=12, seed=7)
    counter = CompileCounter()
    log = CompileLog(counter)

    class Reserved(Callback):
        def __init__(self) -> None:
            self.lengths: list[int] = []

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            assert ltd.controller is not None
            self.lengths.append(ltd.controller.records[0].reserved_length)

    reserved = Reserved()
    run.model.model = torch.compile(run.model.model, backend=counter, dynamic=False)
    trainer = make_trainer(tmp_path, [ltd, log, reserved], max_steps=12, max_epochs=-1)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        trainer.fit(run.model, datamodule=run.datamodule)
    assert reserved.lengths == [4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14]
    compiled = [s["compiled"] for s in log.steps]
    assert compiled[0] > 0 and not any(compiled[1:]), compiled


def test_random_ltd_draws_outside_compiled_graphs():
    """The compile-friendly pieces of random-LTD's layer patch (what ``test_torch_compile`` measures in a fit): the
    index lookup and the shape recorder of a paused level are excluded from dynamo (``torch.compiler.disable``), so
    compiled code never reads the controller's per-step state."""
    from lightning_effi.random_ltd.patching import LTDForward, _ObserveHook

    for fn in (LTDForward.select, _ObserveHook.__call__):
        assert getattr(fn, "_torchdynamo_disable", False), fn


# ---------------------------------------------------------------------------------------------------- precision
#: row -> (Trainer precision, parameter dtype, hidden-state dtype, matmul dtype)
PRECISIONS = {
    "bf16_mixed": ("bf16-mixed", torch.float32, torch.float32, torch.bfloat16),
    "bf16_true": ("bf16-true", torch.bfloat16, torch.bfloat16, torch.bfloat16),
    "fp16_mixed": ("16-mixed", torch.float32, torch.float32, torch.float16),
    "fp64_true": ("64-true", torch.float64, torch.float64, torch.float64),
}
#: InfoBatch's prune ratio in the precision cells: its weight 1 / (1 - r) = 1.4285714... is not a bfloat16 or a
#: float16 value, so a weight rounded to the training precision shows
PRUNE = 0.3


class DtypeProbe(Callback):
    """Per training batch: the dtypes of the hidden states entering every block (``ln_1``), of the attention's input
    projection (``c_attn``, a matmul: autocast's dtype), of the parameters of the network in place, of the loss; and
    InfoBatch's loss weights of the batch (its plan's table, or the weights of a thinned batch)."""

    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []
        self._handles: list[Any] = []
        self._seen: dict[str, set[torch.dtype]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._seen = {"hidden": set(), "matmul": set()}
        for name, module in pl_module.named_modules():
            if name.endswith("ln_1"):
                self._handles.append(module.register_forward_pre_hook(self._hidden))
            if name.endswith("c_attn"):
                self._handles.append(module.register_forward_hook(self._matmul))

    def _hidden(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self._seen["hidden"].add(args[0].dtype)

    def _matmul(self, module: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
        self._seen["matmul"].add(out.dtype)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        infobatch = next((c for c in trainer.callbacks if isinstance(c, InfoBatchCallback)), None)
        weights = None
        if infobatch is not None:
            thinned = outputs.get("infobatch_weight")
            weights = thinned if thinned is not None else infobatch.current_weights()[outputs["index"].cpu()]
            weights = weights.detach().cpu().clone()
        self.batches.append(
            dict(
                **self._seen,
                params={p.dtype for p in pl_module.parameters()},
                loss=outputs["loss"].detach().clone(),
                weights=weights,
            )
        )


def _precision_run(technique: str) -> Run:
    """The cell's run, with InfoBatch pruning :data:`PRUNE` of the well-learned samples (the data module stays the
    one :func:`build` wrapped; InfoBatch finds its wrapper in ``setup``)."""
    run = build(technique)
    for i, cb in enumerate(run.callbacks):
        if isinstance(cb, InfoBatchCallback):
            run.callbacks[i] = InfoBatchCallback(prune_ratio=PRUNE, delta=cb.delta, seed=cb.seed)
    return run


def _check_precision(tmp_path: Path, feature: str, technique: str) -> None:
    assert expect(feature, technique) == WORKS
    precision, params, hidden, matmul = PRECISIONS[feature]
    run = _precision_run(technique)
    probe = DtypeProbe()
    if feature == "fp16_mixed":
        # on CPU Lightning replaces precision="16-mixed" by "bf16-mixed"; its fp16 plugin (autocast to float16 and
        # a gradient scaler, as "16-mixed" is on a GPU) runs on CPU when passed explicitly
        with pytest.warns(UserWarning, match="fp16 is not supported on CPU. Using `precision='bf16-mixed'`"):
            cpu = run.trainer(tmp_path, precision=precision)
        assert isinstance(cpu.precision_plugin, MixedPrecision) and cpu.precision_plugin.precision == "bf16-mixed"
        trainer = run.fit(tmp_path, extra=[probe], plugins=[MixedPrecision(precision, "cpu")])
    else:
        trainer = run.fit(tmp_path, extra=[probe], precision=precision)
    assert_effect(run)
    assert len(probe.batches) == len(run.probe.batches) > 0
    depths = set()
    for i, (b, traced) in enumerate(zip(probe.batches, run.probe.batches)):
        depths.add(len(traced["blocks"]))
        assert b["params"] == {params}, f"batch {i}: parameters {b['params']}"
        assert b["hidden"] == {hidden}, f"batch {i}: hidden states {b['hidden']}"
        assert b["matmul"] == {matmul}, f"batch {i}: matmuls {b['matmul']}"
        assert torch.isfinite(b["loss"]), f"batch {i}: loss {b['loss']}"
    if "vcycle" in run.names:
        assert depths == {2, 4}, depths  # the coarse network kept the precision too
    assert {p.dtype for p in run.model.parameters()} == {params}
    if feature == "fp16_mixed":  # Lightning's CPU gradient scaler scaled the fp16 backward
        scaler = trainer.precision_plugin.scaler
        assert isinstance(scaler, torch.amp.GradScaler) and 0 < scaler.get_scale() < float("inf")
    if "infobatch" in run.names:
        cb = next(c for c in run.callbacks if isinstance(c, InfoBatchCallback))
        assert cb.score.dtype == torch.float32 and bool(torch.isfinite(cb.score[cb.seen]).all())
        values = torch.cat([b["weights"] for b in probe.batches])
        assert values.dtype in (torch.float32, torch.float64), values.dtype
        weight = torch.tensor(1 / (1 - PRUNE), dtype=values.dtype)
        assert weight.to(torch.bfloat16).to(weight.dtype) != weight and weight.half().to(weight.dtype) != weight
        assert set(values.unique().tolist()) <= {1.0, weight.item()}, values.unique()
        assert bool((values == weight).any()), "no batch trained a reweighted sample"
        for b in probe.batches:  # the weighted loss is not rounded to the training precision either
            assert b["loss"].dtype in (torch.float32, torch.float64), b["loss"].dtype


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_bf16_mixed(tmp_path, technique):
    _check_precision(tmp_path, "bf16_mixed", technique)


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_bf16_true(tmp_path, technique):
    _check_precision(tmp_path, "bf16_true", technique)


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_fp16_mixed(tmp_path, technique):
    _check_precision(tmp_path, "fp16_mixed", technique)


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_fp64_true(tmp_path, technique):
    _check_precision(tmp_path, "fp64_true", technique)


# -------------------------------------------------------------------------------------------------- distributed
class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` on CPU processes (gloo). Lightning refuses the ``"fsdp"`` name without a GPU, and
    torch's ``FullyShardedDataParallel`` runs on CPU only when given ``device_id=cpu`` (Lightning passes the device
    index, ``None`` on CPU); everything else is Lightning's (one FSDP unit, full sharding)."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )


def _digest(tensors: Iterable[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        # a copy: numpy's view would pin the storage, which FSDP frees when it reshards
        h.update(t.detach().to("cpu", copy=True).reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class RankState(Callback):
    """Writes ``<out_dir>/rank<r>.json`` at the end of fit: a digest of the rank's final weights (under FSDP the
    gathered full weights), the world size, the strategy, the model's parameter count (read in ``setup``, before the
    strategy wraps it) and the parameters the rank held while training (sharded under FSDP)."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = str(out_dir)
        self.total = self.held = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.total = sum(p.numel() for p in pl_module.parameters())

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.held = sum(p.numel() for p in trainer.strategy.model.parameters())

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = trainer.strategy.model
        if isinstance(model, FullyShardedDataParallel):
            with FullyShardedDataParallel.summon_full_params(model, writeback=False):
                digest = _digest(model.parameters())
        else:
            digest = _digest(pl_module.parameters())
        record = dict(
            digest=digest,
            world_size=trainer.world_size,
            strategy=type(trainer.strategy).__name__,
            start_method=getattr(trainer.strategy, "_start_method", "popen"),  # FSDP: always popen
            pid=os.getpid(),
            total=self.total,
            held=self.held,
            global_step=trainer.global_step,
        )
        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(self.out_dir) / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _distributed_run(technique: str, out: Path) -> tuple[Run, RankState, dict[str, Any]]:
    """The cell's run for 2 processes, its probe and rank state writing under ``out``, and its Trainer limits (the
    step-bounded columns stop at :data:`DISTRIBUTED_STEPS`)."""
    run = build(technique)
    run.probe = Probe(out / "probe")
    limits = dict(run.limits)
    if limits["max_steps"] > 0:
        limits["max_steps"] = DISTRIBUTED_STEPS
    return run, RankState(out / "state"), limits


def _worker(strategy: str, out: Path, techniques: Sequence[str]) -> None:
    """Fit each technique with ``strategy`` on 2 processes; a refusal is written to ``refused/rank<r>.json``."""
    for technique in techniques:
        where = out / technique
        run, state, limits = _distributed_run(technique, where)
        kind = CPUFSDPStrategy() if strategy == "fsdp" else strategy
        extra = [RecordBatches(where / "records"), state]
        trainer = run.trainer(where / "root", extra=extra, **{**limits, "strategy": kind, "devices": 2})
        try:
            trainer.fit(run.model, datamodule=run.datamodule)
        except MisconfigurationException as err:
            (where / "refused").mkdir(parents=True, exist_ok=True)
            record = dict(
                error=type(err).__name__,
                message=str(err),
                global_step=trainer.global_step,
                batches=len(run.probe.batches),
            )
            (where / "refused" / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


_LAUNCH_VARIABLES = {"LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED"}


def _launch(strategy: str, out: Path, techniques: Sequence[str] = TECHNIQUES) -> Path:
    """Run :func:`_worker` as a script (``strategy="ddp"`` and FSDP relaunch the script for rank 1). A worker that
    aborts at exit (gloo on CPU, after every fit wrote its records) is accepted; any other failure raises."""
    # a fresh launch: no rank or rendezvous variables of an earlier distributed run in this process
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "tests.compat.test_runtime", strategy, str(out), *techniques]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    complete = all(
        any((out / t / d / f"rank{r}.json").exists() for d in ("state", "refused")) for t in techniques for r in (0, 1)
    )
    if done.returncode != 0 and not complete:
        raise AssertionError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    return out


def _check_distributed(technique: str, out: Path, strategy: str, start_method: str, records: str = "records") -> None:
    """Both ranks ran ``strategy`` in their own process (started by ``start_method``) and trained the same steps
    with the technique's effect, different samples at every step, and end with identical weights; under FSDP each
    rank held about half the parameters, under DDP all of them. ``records``: the folder of the batch records."""
    run = build(technique)
    assert not (out / "refused").exists(), (out / "refused" / "rank0.json").read_text()
    states = [json.loads((out / "state" / f"rank{r}.json").read_text()) for r in (0, 1)]
    records = [json.loads((out / records / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [s["world_size"] for s in states] == [2, 2], states
    assert {(s["strategy"], s["start_method"]) for s in states} == {(strategy, start_method)}, states
    assert states[0]["pid"] != states[1]["pid"]
    assert states[0]["global_step"] == states[1]["global_step"] == records[0]["global_step"] > 0
    for rank in (0, 1):
        batches, complete = Probe.load(out / "probe", rank)
        assert_effect(run, batches, complete, world_size=2)
    assert len(records[0]["batches"]) == len(records[1]["batches"]) > 0
    for a, b in zip(records[0]["batches"], records[1]["batches"]):
        assert not set(a["fingerprint"]) & set(b["fingerprint"]), "the ranks trained the same sample in a step"
    assert states[0]["digest"] == states[1]["digest"], "the ranks' weights differ after fit"
    if strategy == "CPUFSDPStrategy":
        assert all(s["held"] <= (s["total"] + 1) // 2 + 1 for s in states), states
    else:
        assert all(s["held"] == s["total"] for s in states), states


def _check_refused(technique: str, out: Path, feature: str) -> None:
    """Both ranks refused before the first step, with a MisconfigurationException (the only error the worker
    records) naming ``feature`` and one of the technique callbacks, as :func:`~tests.compat.setups.assert_refused`
    checks in one process."""
    run = build(technique)
    assert not (out / "state").exists(), "the run trained"
    for rank in (0, 1):
        record = json.loads((out / "refused" / f"rank{rank}.json").read_text())
        assert feature in record["message"], record
        assert any(type(cb).__name__ in record["message"] for cb in run.callbacks), record
        assert record["global_step"] == 0 and record["batches"] == 0, record


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    return _launch("ddp", tmp_path_factory.mktemp("ddp"))


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    return _launch("fsdp", tmp_path_factory.mktemp("fsdp"))


@pytest.mark.slow
@pytest.mark.parametrize("technique", TECHNIQUES)
def test_ddp(ddp_runs, technique):
    assert expect("ddp", technique) == WORKS
    _check_distributed(technique, ddp_runs / technique, "DDPStrategy", "popen")


@pytest.mark.slow
@pytest.mark.parametrize("technique", TECHNIQUES)
def test_ddp_spawn(tmp_path, technique):
    assert expect("ddp_spawn", technique) == WORKS
    run, state, limits = _distributed_run(technique, tmp_path)
    callbacks = [*run.callbacks, state, run.probe]  # + RecordBatches
    fit_ddp(run.model, run.datamodule, tmp_path, callbacks, start_method="spawn", **limits)
    _check_distributed(technique, tmp_path, "DDPStrategy", "spawn", records="ddp_records")


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_callbacks_pickle_after_a_fit(tmp_path, technique):
    """A callback that has run one fit pickles (``ddp_spawn`` pickles the callbacks to start its processes; the
    InfoBatch and random-LTD callbacks failed on the closure that tells a finished fit from a running one). The
    pickled copy refers to no fit."""
    run = build(technique)
    run.fit(tmp_path)
    for cb in run.callbacks:
        twin = pickle.loads(pickle.dumps(cb))
        running = getattr(twin, "_running", None) or getattr(getattr(twin, "_stack", None), "running", None)
        if callable(running):
            assert running(None) is False


@pytest.mark.slow
@pytest.mark.parametrize("technique", TECHNIQUES)
def test_fsdp(fsdp_runs, technique):
    if expect("fsdp", technique) == REFUSED:
        _check_refused(technique, fsdp_runs / technique, "FSDP")
    else:
        _check_distributed(technique, fsdp_runs / technique, "CPUFSDPStrategy", "popen")


def test_lightning_refuses_fsdp_without_a_gpu():
    """Why the ``fsdp`` cells use :class:`CPUFSDPStrategy`: Lightning refuses the strategy's name on CPU."""
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        pl.Trainer(accelerator="cpu", strategy="fsdp", devices=2, logger=False)


DeepSpeedStrategy = type("DeepSpeedStrategy", (SingleDeviceStrategy,), {"__doc__": "A stand-in named as Lightning's."})


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_deepspeed(tmp_path, technique):
    """Each technique refuses the ``DeepSpeedStrategy`` class at ``setup`` (the techniques match strategies by class
    name, :func:`~lightning_effi.core.requirements.check_trainer`; the stand-in runs on one CPU device, so the
    refusal is tested in a real fit); and without the deepspeed package Lightning refuses ``strategy="deepspeed"``
    before any technique runs."""
    assert expect("deepspeed", technique) == REFUSED
    run = build(technique)
    assert_refused(run, run.trainer(tmp_path, strategy=DeepSpeedStrategy(device=torch.device("cpu"))), "DeepSpeed")
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        with pytest.raises(MisconfigurationException, match="DeepSpeed"):
            build(technique).trainer(tmp_path, strategy="deepspeed")
    from lightning.pytorch.strategies import DeepSpeedStrategy as Real

    # the real class (a DDPStrategy subclass, built without its __init__, which needs deepspeed) is refused too
    from lightning_effi.core.requirements import IncompatibleTechniques, check_trainer

    real = Real.__new__(Real)
    for cb in build(technique).callbacks:
        with pytest.raises(IncompatibleTechniques, match="DeepSpeedStrategy"):
            check_trainer(SimpleNamespace(strategy=real, callbacks=[cb]))


if __name__ == "__main__":  # the worker of the ``ddp`` and ``fsdp`` cells
    _worker(sys.argv[1], Path(sys.argv[2]), sys.argv[3:])


def test_infobatch_refuses_to_resume_under_a_strategy_that_restores_after_setup():
    """InfoBatch's resume needs its state before ``setup`` builds the epoch plan; FSDP restores checkpoints after
    ``setup`` and ``on_fit_start`` (``restore_checkpoint_after_setup``), so a resumed FSDP fit is refused when the
    checkpoint is loaded, before any step (a fresh FSDP fit works: ``test_fsdp``)."""
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn

    from lightning_effi import InfoBatchCallback
    from lightning_effi.core.requirements import IncompatibleTechniques

    class FSDPLike:
        restore_checkpoint_after_setup = True

    trainer = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING), strategy=FSDPLike())
    with pytest.raises(IncompatibleTechniques, match=r"cannot resume a fit under the FSDPLike strategy.*fresh"):
        InfoBatchCallback().on_load_checkpoint(trainer, None, {"callbacks": {}})  # type: ignore[arg-type]
    trainer.state.fn = TrainerFn.VALIDATING  # evaluating from a checkpoint is unaffected
    InfoBatchCallback().on_load_checkpoint(trainer, None, {"callbacks": {}})  # type: ignore[arg-type]


@pytest.mark.slow
def _calls_self(**kwargs: Any) -> pl.LightningModule:
    """The user-module ViT with a ``forward`` that ``training_step`` calls as ``self(x)``: the monitor records and
    replays that call of the module itself."""
    import torch.nn.functional as F

    from tests.user_modules.modules import TimmViT

    class ViaForward(TimmViT):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self(x), y)

    torch.manual_seed(0)
    return ViaForward(**kwargs)


def test_compiled_fit_counts_the_flops_of_the_uncompiled_run(tmp_path):
    """``trainer.fit(torch.compile(model))`` with random-LTD, on a module that calls ``self(x)``: the monitor's
    replay of that call ran Lightning's compiled ``forward``, bound to the real module (whose LTD layers were armed),
    instead of the fake copy: FLOPs and the baseline both read ~24% low and the saving high (0.385 for 0.238 on the
    user's timm ViT). The counts now equal the uncompiled run's, to the FLOP."""
    from lightning_effi import EfficiencyMonitor, RandomLTDCallback
    from tests.user_modules.modules import RandomImages, UserData

    summaries = []
    for compiled in (False, True):
        torch.compiler.reset()
        model = _calls_self()
        monitor = EfficiencyMonitor(print_summary=False)
        ltd = RandomLTDCallback(min_value=4, seq_per_step=4, require_steps=4, seed=7)
        trainer = make_trainer(tmp_path / str(compiled), [monitor, ltd], max_steps=4, max_epochs=-1)
        fitted = torch.compile(model, backend=CompileCounter()) if compiled else model
        trainer.fit(fitted, datamodule=UserData(RandomImages(), batch_size=8))
        summaries.append({k: monitor.summary[k] for k in ("flops", "baseline_flops", "layer_tokens", "samples")})
    assert summaries[0]["baseline_flops"] > summaries[0]["flops"] > 0
    assert summaries[1] == summaries[0]


class GraphCallsPerStep(Callback):
    """A dynamo backend that counts the calls of the graphs it compiled (:meth:`backend`), and, as a callback, the
    count of each training step (:attr:`per_step`; 0: the step ran uncompiled)."""

    def __init__(self) -> None:
        self.calls = 0
        self.per_step: list[int] = []

    def backend(self, gm: torch.fx.GraphModule, example: Any) -> Any:
        def run(*args: Any) -> Any:
            self.calls += 1
            return gm.forward(*args)

        return run

    def on_train_batch_end(self, *args: Any) -> None:
        self.per_step.append(self.calls - sum(self.per_step))


class _PaddedTokens(pl.LightningModule):
    """Token ids padded per batch to its longest row (one of three lengths, in turn), a hand-written encoder."""

    LENGTHS = (6, 9, 6, 12, 9, 6, 12, 6)

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, 16)
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        logits = self(ids)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        batches = [(torch.randint(0, 32, (4, t), generator=g),) for t in self.LENGTHS]
        return torch.utils.data.DataLoader(batches, batch_size=None)  # one batch of each length, in order

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_compiled_model_on_padded_batches_runs_uncompiled_once_per_length():
    """Batches padded to their longest row change length from one step to the next among a few: the monitor kept the
    record of the last length only, and recorded (uncompiled) at nearly every step: 39 of 40 (qa97-user 01). Each
    length is now recorded once; the FLOPs equal the uncompiled run's."""
    from lightning_effi import EfficiencyMonitor

    def fit(compiled: bool) -> tuple[list[int], EfficiencyMonitor]:
        counter = GraphCallsPerStep()
        torch.compiler.reset()
        model = _PaddedTokens()
        monitor = EfficiencyMonitor(print_summary=False)
        trainer = pl.Trainer(
            max_epochs=1,
            accelerator="cpu",
            callbacks=[monitor, counter],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(torch.compile(model, backend=counter.backend) if compiled else model)
        return counter.per_step, monitor

    per_step, compiled = fit(True)
    firsts = [_PaddedTokens.LENGTHS.index(t) == i for i, t in enumerate(_PaddedTokens.LENGTHS)]
    assert [n == 0 for n in per_step] == firsts  # uncompiled at each length's first batch only (3 of 8 steps)
    _, eager = fit(False)
    assert compiled.summary["flops"] == eager.summary["flops"] > 0
    assert compiled.summary["tokens"] == eager.summary["tokens"] == 4 * sum(_PaddedTokens.LENGTHS)


def test_the_monitor_leaves_a_compiled_model_one_graph():
    """The monitor's recording hooks run at every module call and broke dynamo's graph there: with the monitor, a
    compiled ViT trained as 23 graphs at every step. It now records a compiled module once per regime (batch and
    parameter shapes), in an uncompiled step, and no hook is set at the other steps: one graph per step after the
    first, as without the monitor; its FLOPs equal the uncompiled run's."""
    from lightning_effi import EfficiencyMonitor
    from tests.user_modules.modules import RandomImages, UserData

    def fit(monitor: EfficiencyMonitor | None, compiled: bool) -> list[int]:
        counter = GraphCallsPerStep()
        torch.compiler.reset()
        model = _calls_self()
        callbacks = ([monitor] if monitor else []) + [counter]
        trainer = pl.Trainer(
            max_steps=6,
            accelerator="cpu",
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,  # only the training step's graphs are counted
        )
        trainer.fit(
            torch.compile(model, backend=counter.backend) if compiled else model, UserData(RandomImages(), batch_size=8)
        )
        return counter.per_step

    assert fit(None, True) == [1] * 6
    monitor = EfficiencyMonitor(print_summary=False)
    assert fit(monitor, True) == [0] + [1] * 5  # the recorded first step runs uncompiled
    eager = EfficiencyMonitor(print_summary=False)
    fit(eager, False)
    assert monitor.summary["flops"] == eager.summary["flops"] > 0
    from torch._dynamo.eval_frame import _stance

    assert _stance.stance == "default"  # the stance is restored after the recorded step: nothing left forced eager
