"""DeepSpeed's random-LTD configuration (``data_efficiency.data_routing.random_ltd``, parsed by DeepSpeed in
``deepspeed/runtime/data_pipeline/config.py`` and used by ``data_routing/scheduler.py``), read into the arguments of
:class:`~lightning_effi.RandomLTDCallback`.

=====================================================  ===========================================================
DeepSpeed key                                          lightning_effi
=====================================================  ===========================================================
``random_ltd_layer_id``                                ``layer_ids``
``random_ltd_schedule.min_value`` / ``max_value``      ``min_value`` / ``max_value``
``schedule_config.require_steps`` / ``seq_per_step``   ``require_steps`` / ``seq_per_step``
``schedule_type: fixed_linear``                        the only schedule (as in DeepSpeed; others raise)
``total_layer_num``, ``random_ltd_layer_num``          checked against ``random_ltd_layer_id``
``model_mask_name``, ``model_type``,                   read by the adapter from the layers (``adapter="auto"``, or
``hidden_state_order``                                 ``GenericAdapter(masks=..., hidden_state_order=...)``)
``layer_token_lr_schedule.enabled: true``              raises, as in DeepSpeed (``lr_schedules.layer_token_lr``)
``global_batch_size``, ``micro_batch_size``            the engine's, not read (the Trainer's batches are counted)
=====================================================  ===========================================================
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any

from lightning_effi.core.checks import check_bool, check_int
from lightning_effi.core.state import plain_config

__all__ = ["parse_deepspeed_config"]

_LTD_KEYS = {
    "enabled",
    "total_layer_num",
    "random_ltd_layer_num",
    "random_ltd_layer_id",
    "model_mask_name",
    "model_type",
    "hidden_state_order",
    "random_ltd_schedule",
    "layer_token_lr_schedule",
    "global_batch_size",
    "micro_batch_size",
}
_SCHEDULE_KEYS = {"min_value", "max_value", "schedule_type", "schedule_config"}
_SCHEDULE_CONFIG_KEYS = {"require_steps", "seq_per_step"}
_ADAPTER_KEYS = ("model_mask_name", "model_type", "hidden_state_order")
_WHERE = "data_efficiency.data_routing.random_ltd"


_DE_KEYS = {"enabled", "seed", "data_sampling", "data_routing"}


def _block(ds_config: Any) -> tuple[Mapping[str, Any], list[str]]:
    """The ``random_ltd`` block of a whole DeepSpeed config, of its ``data_efficiency`` block, of its ``data_routing``
    block, or the block itself, and the parent sections given around it whose ``enabled`` is not true (a whole
    config's ``data_efficiency``, its ``data_routing``). An enabled ``data_sampling.dynamic_batching`` warns.

    Raises:
        ValueError: a ``data_routing`` block beside a whole config's engine keys (misplaced: DeepSpeed ignores it).
    """
    ds_config = plain_config(ds_config, "parse_deepspeed_config")
    if not isinstance(ds_config, Mapping):
        raise ValueError(f"parse_deepspeed_config: expected a DeepSpeed config dict, got {type(ds_config).__name__}")

    def child(d: Any, key: str, where: str) -> Any:
        if not isinstance(d, Mapping):
            raise ValueError(f"{where} must be a dict, got {type(d).__name__}")
        return d.get(key, {})

    parents: list[tuple[str, Any]] = []
    if "data_routing" in ds_config and not set(ds_config) <= _DE_KEYS:
        raise ValueError(
            "parse_deepspeed_config: 'data_routing' must sit under 'data_efficiency' (beside the engine keys "
            f"{sorted(set(ds_config) - _DE_KEYS)[:3]} DeepSpeed ignores it, as DeepSpeedExamples #696 found for "
            "data_sampling); move it into data_efficiency"
        )
    if "data_efficiency" in ds_config:  # a whole DeepSpeed config
        de = ds_config["data_efficiency"]
        routing = child(de, "data_routing", "data_efficiency")
        parents = [("data_efficiency", de), ("data_efficiency.data_routing", routing)]
        _warn_dynamic_batching(de)
        node: Any = child(routing, "random_ltd", "data_efficiency.data_routing")
    elif "data_routing" in ds_config:  # its data_efficiency block
        parents = [("data_efficiency", ds_config), ("data_efficiency.data_routing", ds_config["data_routing"])]
        _warn_dynamic_batching(ds_config)
        node = child(ds_config["data_routing"], "random_ltd", "data_efficiency.data_routing")
    elif "random_ltd" in ds_config:  # its data_routing block
        parents = [("data_efficiency.data_routing", ds_config)]
        node = ds_config["random_ltd"]
    elif set(ds_config) <= _LTD_KEYS:  # the random_ltd block itself
        node = ds_config
    else:
        raise ValueError(
            f"parse_deepspeed_config: no random-LTD block in the DeepSpeed config (expected {_WHERE}, or the block "
            f"itself), got the keys {sorted(ds_config)}"
        )
    if not isinstance(node, Mapping):
        raise ValueError(f"{_WHERE} must be a dict, got {type(node).__name__}")
    off = [
        name
        for name, d in parents
        if isinstance(d, Mapping) and not check_bool(name, "enabled", d.get("enabled", False))
    ]
    return node, off


def _warn_dynamic_batching(de: Any) -> None:
    """Warn when the config's ``data_sampling.dynamic_batching`` is enabled: not implemented (the curriculum's
    parser raises for it; a config with random-LTD alone is read here)."""
    ds = de.get("data_sampling") if isinstance(de, Mapping) else None
    dynamic = ds.get("dynamic_batching") if isinstance(ds, Mapping) else None
    if isinstance(dynamic, Mapping) and dynamic.get("enabled") not in (None, False):
        warnings.warn(
            "parse_deepspeed_config: data_efficiency.data_sampling.dynamic_batching is enabled in the DeepSpeed "
            "config, but lightning_effi does not implement DeepSpeed's dynamic batching (batches of a token budget): "
            "the run trains your DataLoader's fixed-size batches",
            UserWarning,
            stacklevel=4,
        )


def _known(section: str, d: Any, allowed: set[str]) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise ValueError(f"{section} must be a dict, got {type(d).__name__}")
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ValueError(f"{section}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    return d


def parse_deepspeed_config(ds_config: Any, **overrides: Any) -> dict[str, Any] | None:
    """The :class:`~lightning_effi.RandomLTDCallback` arguments of a DeepSpeed config's random-LTD block (the table
    in this module's docstring; Yao et al. 2022, "Random-LTD", Sec. 3; DeepSpeed
    ``deepspeed/runtime/data_pipeline/data_routing/scheduler.py``).

    Args:
        ds_config: a whole DeepSpeed config dict, its ``data_efficiency`` block, the ``random_ltd`` block itself, or
            the path of a DeepSpeed JSON file. Not mutated.
        overrides: other :class:`~lightning_effi.RandomLTDCallback` arguments (``adapter``, ``accounting``,
            ``rounding``, ``seed``, ...). ``rounding`` defaults to ``"clamped"`` (never below ``min_value``,
            ``max_value`` from ``require_steps`` on); DeepSpeed's own arithmetic is ``rounding="deepspeed"``. The two
            differ where ``min_value`` or ``max_value`` is not a multiple of ``seq_per_step`` and, by one
            ``seq_per_step`` at rare steps, where DeepSpeed's float64 product lands just below a whole number that
            ``"clamped"`` computes exactly (:func:`~lightning_effi.random_ltd.functional.ltd_value`); a warning names
            the steps.

    Returns:
        ``{"layer_ids", "min_value", "max_value", "require_steps", "seq_per_step", **overrides}``, or ``None`` when
        ``random_ltd.enabled`` is false or absent (DeepSpeed's only gate).

    Raises:
        ValueError: unknown keys (naming the section and the allowed ones), a missing required key
            (``total_layer_num``, ``random_ltd_layer_id``, ``min_value``, ``max_value``, ``require_steps``,
            ``seq_per_step``), a ``schedule_type`` other than ``fixed_linear`` (DeepSpeed: "Unsupported random LTD
            schedule type"), ``random_ltd_layer_num`` not the number of ids, an id outside ``[0, total_layer_num)``,
            ``layer_token_lr_schedule.enabled`` true (DeepSpeed: not yet supported), an override of a key the config
            holds, ``random_ltd.enabled`` under a ``data_efficiency`` / ``data_routing`` whose ``enabled`` is not true
            (DeepSpeed reads the child alone; as the curriculum's parser, a child on under a parent off is refused), a
            ``data_routing`` block beside a whole config's engine keys (misplaced: DeepSpeed ignores it).

    Warns:
        UserWarning: ``model_mask_name`` / ``model_type`` / ``hidden_state_order`` are given (the adapter reads them
            from the layers); the default rounding trains another schedule than DeepSpeed's at the first or the last
            step; ``data_sampling.dynamic_batching`` is enabled (not implemented: the DataLoader's batches train).
    """
    block, off = _block(ds_config)
    ltd = _known(_WHERE, copy.deepcopy(block), _LTD_KEYS)
    if not check_bool(_WHERE, "enabled", ltd.get("enabled", False)):
        return None
    if off:  # DeepSpeed reads random_ltd.enabled alone; a child on under a parent switched off is refused
        raise ValueError(
            f"{_WHERE}.enabled is true but its parent {off[0]}.enabled is not (DeepSpeed would drop tokens anyway, "
            "reading random_ltd.enabled alone); enable the parents, or disable random_ltd"
        )
    held = sorted(set(overrides) & {"layer_ids", "min_value", "max_value", "require_steps", "seq_per_step"})
    if held:
        raise ValueError(f"parse_deepspeed_config: {held} come from the DeepSpeed config; change them there")
    missing = [k for k in ("total_layer_num", "random_ltd_layer_id", "random_ltd_schedule") if k not in ltd]
    if missing:
        raise ValueError(f"{_WHERE}: missing required key(s) {missing}")
    total = check_int(_WHERE, "total_layer_num", ltd["total_layer_num"], minimum=1)
    ids = ltd["random_ltd_layer_id"]
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError(f"{_WHERE}.random_ltd_layer_id must be a non-empty list of layer indices, got {ids!r}")
    ids = [check_int(_WHERE, f"random_ltd_layer_id[{i}]", v, minimum=0) for i, v in enumerate(ids)]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{_WHERE}.random_ltd_layer_id lists a layer twice: {ids}")
    ids = sorted(ids)  # DeepSpeed sorts them (random_ltd_initialize)
    outside = [i for i in ids if i >= total]
    if outside:
        raise ValueError(f"{_WHERE}.random_ltd_layer_id {outside} outside [0, total_layer_num={total})")
    if "random_ltd_layer_num" in ltd and check_int(_WHERE, "random_ltd_layer_num", ltd["random_ltd_layer_num"]) != len(
        ids
    ):
        raise ValueError(
            f"{_WHERE}.random_ltd_layer_num = {ltd['random_ltd_layer_num']!r}, but random_ltd_layer_id lists "
            f"{len(ids)} layers (DeepSpeed requires them equal)"
        )
    lr = ltd.get("layer_token_lr_schedule")
    if isinstance(lr, Mapping) and lr.get("enabled") not in (None, False):
        raise ValueError(
            f"{_WHERE}.layer_token_lr_schedule.enabled: not supported (DeepSpeed raises too); schedule the LR by "
            "layer-tokens with lightning_effi.core.lr_schedules.layer_token_lr(optimizer, callback, ...)"
        )
    schedule = _known(f"{_WHERE}.random_ltd_schedule", ltd["random_ltd_schedule"], _SCHEDULE_KEYS)
    kind = schedule.get("schedule_type", "fixed_linear")
    if kind != "fixed_linear":
        raise ValueError(
            f"{_WHERE}.random_ltd_schedule.schedule_type must be 'fixed_linear' (the only schedule DeepSpeed runs: "
            f"'Unsupported random LTD schedule type'), got {kind!r}"
        )
    sc = _known(
        f"{_WHERE}.random_ltd_schedule.schedule_config", schedule.get("schedule_config", {}), _SCHEDULE_CONFIG_KEYS
    )
    values = {k: schedule[k] for k in ("min_value", "max_value") if k in schedule}
    values.update({k: sc[k] for k in ("require_steps", "seq_per_step") if k in sc})
    missing = [k for k in ("min_value", "max_value", "require_steps", "seq_per_step") if k not in values]
    if missing:
        raise ValueError(f"{_WHERE}.random_ltd_schedule: missing required key(s) {missing}")
    given = [k for k in _ADAPTER_KEYS if ltd.get(k) is not None]
    if given:
        warnings.warn(
            f"parse_deepspeed_config: {_WHERE} {' / '.join(given)} are not read: the adapter finds the mask, the "
            "causality and the hidden-state layout from the layers (adapter='auto' for HF GPT-2 / BERT, timm ViT and "
            "torch's TransformerEncoderLayer; lightning_effi.adapters.GenericAdapter(masks=..., "
            "hidden_state_order=...) for layers of your own)",
            UserWarning,
            stacklevel=2,
        )
    if "rounding" not in overrides:
        _warn_rounding(values)
    return {"layer_ids": ids, **values, **overrides}


def _schedules(lo: int, hi: int, steps: int, q: int, first: int, stop: int) -> tuple[Any, Any]:
    """:func:`~lightning_effi.random_ltd.functional.ltd_value` at steps ``first .. stop - 1``, both roundings
    (``clamped``, ``deepspeed``), computed as it computes them, with numpy (int64 and float64)."""
    import numpy as np

    t = np.arange(first, stop, dtype=np.int64)
    exact = (t * (hi - lo)) // steps + lo
    floated = np.floor(t.astype(np.float64) / steps * (hi - lo) + lo).astype(np.int64)
    exact, floated = np.minimum(exact - exact % q, hi), np.minimum(floated - floated % q, hi)
    return np.where(t >= steps, hi, np.maximum(exact, lo)), floated


def _warn_rounding(values: Mapping[str, Any]) -> None:
    """Warn where the default ``rounding="clamped"`` trains another reserved length than DeepSpeed's arithmetic:
    steps at the start and the end of the growth when ``min_value`` / ``max_value`` is not a multiple of
    ``seq_per_step`` (DeepSpeed's value goes on growing past ``require_steps`` until its rounding reaches
    ``max_value``: ViT-S/16's 32 -> 197 in 3910 steps trains 192 through step 3981), and steps where DeepSpeed's
    float64 product lands below the exact one. Every step is compared (numpy, in blocks of 2**20 steps), up to the
    one where DeepSpeed's value reaches ``max_value``; the first three runs of steps that differ are named."""
    import numpy as np

    from lightning_effi.random_ltd.functional import ltd_value

    lo, hi, steps, q = (values[k] for k in ("min_value", "max_value", "require_steps", "seq_per_step"))
    try:
        ltd_value(0, lo, hi, steps, q)
    except ValueError:  # invalid values: RandomLTDCallback names them
        return
    # DeepSpeed reaches max_value at most steps * q / (max - min) + 1 steps after require_steps (never when equal)
    last = steps + (steps * q // (hi - lo) + 2 if hi > lo else 1)
    runs: list[list[int]] = []  # [first, last] of each run of steps that differ
    differing = 0
    for first in range(0, last + 1, 2**20):
        clamped, deepspeed = _schedules(lo, hi, steps, q, first, min(first + 2**20, last + 1))
        for x in (np.flatnonzero(clamped != deepspeed) + first).tolist():
            differing += 1
            if runs and runs[-1][1] == x - 1:
                runs[-1][1] = x
            elif len(runs) < 4:
                runs.append([x, x])
    if not runs:
        return

    def shown(a: int, b: int) -> str:
        mine, theirs = ltd_value(a, lo, hi, steps, q), ltd_value(a, lo, hi, steps, q, "deepspeed")
        if a == b:
            return f"step {a}: {mine} (DeepSpeed: {theirs})"
        same = (mine, theirs) == (ltd_value(b, lo, hi, steps, q), ltd_value(b, lo, hi, steps, q, "deepspeed"))
        return (
            f"steps {a}-{b}: {mine} (DeepSpeed: {theirs})"
            if same
            else f"steps {a}-{b} (step {a}: {mine}, DeepSpeed: {theirs})"
        )

    named = runs[:3]
    more = differing - sum(b - a + 1 for a, b in named)
    why = (
        f"min_value {lo} / max_value {hi} is not a multiple of seq_per_step {q}"
        if lo % q or hi % q
        else "DeepSpeed computes the schedule in float64, which lands one seq_per_step lower at some steps"
    )
    warnings.warn(
        f"parse_deepspeed_config: {why}, so lightning_effi's default rounding='clamped' trains another reserved "
        f"length than DeepSpeed ({', '.join(shown(a, b) for a, b in named)}"
        + (f", and {more} more steps" if more else "")
        + "); pass rounding='deepspeed' to train DeepSpeed's schedule, or rounding='clamped' to keep this one and "
        "silence this warning",
        UserWarning,
        stacklevel=3,
    )
