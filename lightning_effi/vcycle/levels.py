"""The models of the V-cycle's levels, without Lightning: :class:`LevelStack` holds the plans of every level change,
the modules of the larger levels (parked on the CPU while a coarser one trains) and the snapshots taken before
coalescing, and swaps the module of the current level into its host (``pl_module.<model_attr>`` for
:class:`~lightning_effi.vcycle.VCycleCallback`). The tensor work is done by the model-level steps of
:mod:`lightning_effi.vcycle.operators`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from lightning_effi.core.checks import is_int
from lightning_effi.vcycle import operators as V

__all__ = ["LevelStack", "NonFiniteWeightsError", "level_depths"]


class NonFiniteWeightsError(RuntimeError):
    """A level change found a NaN or infinite weight in what it would map (the current network, or the snapshot it
    would interpolate with): the V-cycle never coalesces, de-coalesces or interpolates non-finite weights, whatever
    the techniques' ``nonfinite_loss`` policy."""


def _copy_to(state: Mapping[str, Tensor], device: Any) -> dict[str, Tensor]:
    """Detached copies of ``state``'s tensors on ``device``; keys that share a tensor (tied weights) share the copy."""
    copies: dict[tuple[Any, ...], Tensor] = {}
    out = {}
    for key, value in state.items():
        same = (value.device, value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
        if same not in copies:
            copies[same] = value.detach().to(device, copy=True)
        out[key] = copies[same]
    return out


def level_depths(plans: Sequence[V.VCyclePlan]) -> list[int]:
    """The number of layers of the model of every level 1..K, from the plans of its level changes.

    >>> from types import SimpleNamespace as P
    >>> level_depths([P(num_layers=(12, 6)), P(num_layers=(6, 3))])
    [12, 6, 3]
    """
    if not plans:
        return []
    return [int(plans[0].num_layers[0]), *(int(p.num_layers[1]) for p in plans)]


class LevelStack:
    """The levels 1 (the full model) .. K of one V-cycle; the module of the current level is ``host.<attr>``.

    :meth:`coalesce_to` goes one level down (snapshot, coalesce into a fresh smaller module, the larger module waits
    on the CPU), :meth:`decoalesce_to` one level up (de-coalesce, interpolate with the snapshot, into the waiting
    module). :meth:`rebuild` makes fresh modules down to a level (resume: the checkpoint's weights are loaded next).
    A host with an integer ``effi_num_layers`` (FLOPs accounting) gets the depth of the level in place.

    Args:
        levels: K >= 2.
        owner: the name in error messages (the callback's class name).

    Attributes:
        level: the level whose module is in ``host.<attr>``.
        plans: ``plans[k - 1]``: level ``k`` → ``k + 1`` (set by :meth:`plan`).
        parked: level → the module of that level (on the CPU) while a coarser one trains.
        snapshots: level → the CPU float32 state dict saved before coalescing it, pending interpolation.
        running: set by the owner while a fit uses the stack (:func:`~lightning_effi.core.wrapping.live_fit`):
            ``running(trainer)`` tells whether that fit is still going, seen from a fit on ``trainer``; None outside.
    """

    def __init__(self, levels: int, owner: str = "VCycleCallback") -> None:
        self.levels, self.owner = levels, owner
        self.level = 1
        self.plans: list[V.VCyclePlan] = []
        self.parked: dict[int, nn.Module] = {}
        self.snapshots: dict[int, dict[str, Tensor]] = {}
        self.host: Any = None  # the object holding the module (a LightningModule)
        self.attr = "model"
        self.adapter: object = None
        self.running: Callable[[Any], bool] | None = None

    def check_full_model(self) -> None:
        """Raises RuntimeError: a coarser level is in place (a fit stopped below level 1: its host holds the coarse
        module), so the levels cannot be set up again."""
        if self.level != 1 or self.parked:
            raise RuntimeError(
                f"{self.owner}: a previous fit with this callback stopped at level {self.level} (the coarse "
                "model is still in its module); resume from a checkpoint with a new module and callback"
            )

    def bind(self, host: Any, attr: str) -> nn.Module:
        """Hold ``host.<attr>``, the full model (level 1), and return it; :meth:`plan` comes next.

        Raises:
            ValueError: ``host.<attr>`` is not an ``nn.Module``.
            RuntimeError: see :meth:`check_full_model`.
        """
        self.check_full_model()
        model = getattr(host, attr, None)
        if not isinstance(model, nn.Module):
            raise ValueError(f"{self.owner}.model_attr: {type(host).__name__} has no nn.Module attribute {attr!r}")
        self.host, self.attr = host, attr
        return model

    def plan(
        self,
        adapter: object,
        width_scheme: Any = "half",
        depth_scheme: Any = "adjacent",
        embedding_convention: str = "official",
    ) -> None:
        """Plan every level change of the bound model with ``adapter``
        (:func:`~lightning_effi.vcycle.operators.plan_levels`); nothing parked, no snapshot.

        Raises:
            ValueError: from the adapter: sizes a scheme cannot halve, unmapped parameters; ``levels`` deeper than the
                model allows (naming ``levels``, the level that cannot be coalesced and why, the deepest allowed).
        """
        self.adapter = adapter
        self.plans = V.plan_levels(
            self.model, adapter, self.levels, width_scheme, depth_scheme, embedding_convention, owner=self.owner
        )
        self.parked, self.snapshots = {}, {}

    @property
    def model(self) -> nn.Module:
        """The module of the current level (``host.<attr>``)."""
        model: nn.Module = getattr(self.host, self.attr)
        return model

    def num_layers(self, level: int) -> int:
        """The depth of the model of ``level`` (from the plans)."""
        plan, side = (self.plans[0], 0) if level == 1 else (self.plans[level - 2], 1)
        return plan.num_layers[side]

    def depths(self) -> list[int]:
        """The depth of the model of every level 1..K (:func:`level_depths` of the plans; empty before :meth:`plan`)."""
        return level_depths(self.plans)

    def _put(self, model: nn.Module, level: int) -> nn.Module:
        """Swap in the model of ``level``; a host's integer ``effi_num_layers`` follows it."""
        setattr(self.host, self.attr, model)
        self.level = level
        if is_int(getattr(self.host, "effi_num_layers", None)) and self.plans:
            self.host.effi_num_layers = self.num_layers(level)
        return model

    def _check_step(self, level: int, expected: int) -> None:
        if level != expected or not 1 <= level <= self.levels:
            raise RuntimeError(f"{self.owner}: cannot go from level {self.level} to {level}")

    def check_finite(self, path: Sequence[int], where: str = "") -> None:
        """Before going through the levels ``path`` (each next to the one before, starting next to the current one):
        the current module's parameters and the snapshots the up-moves of ``path`` interpolate with must be finite.
        The models in between are made from these by averages and copies, so checking the sources covers the path.
        ``where`` (e.g. ``"at step 5, the switch from stage 2 to stage 3 of 3"``) starts the message.

        Raises:
            NonFiniteWeightsError: naming ``where``, the level change, the tensor (the network's parameter or the
                snapshot's entry) and what it holds.
        """
        found, source = V.first_nonfinite(self.model), f"the level-{self.level} network's parameter"
        for k in [k for k in path if k < self.level] if found is None else []:  # the snapshots the up-moves use
            params = {n for n, _ in self.parked[k].named_parameters()} if k in self.parked else None
            snapshot = {n: t for n, t in self.snapshots.get(k, {}).items() if params is None or n in params}
            if (found := V.first_nonfinite(snapshot)) is not None:
                source = f"the level-{k} snapshot's parameter (taken before coalescing level {k})"
                break
        if found is None:
            return
        name, what = found
        change = " -> ".join(map(str, [self.level, *path]))
        raise NonFiniteWeightsError(
            f"{self.owner}: {where or 'at a level change'} (level {change}): {source} {name!r} holds {what}; the "
            "V-cycle never coalesces, de-coalesces or interpolates non-finite weights (the maps would spread them "
            "into every tensor they mix), whatever nonfinite_loss says. The run diverged before the switch: lower the "
            "learning rate, clip gradients, or resume from an earlier checkpoint"
        )

    def coalesce_to(self, level: int, where: str = "") -> nn.Module:
        """One level down (``level`` = the current one + 1): snapshot the current module, coalesce it into a fresh
        module of ``level`` (put in the host and returned), park the current one on the CPU.

        Raises:
            RuntimeError: ``level`` is not the next one down.
            NonFiniteWeightsError: the current module has a non-finite parameter (:meth:`check_finite`; ``where``
                starts the message).
        """
        self._check_step(level, self.level + 1)
        self.check_finite([level], where)
        current = self.model
        self.snapshots[self.level] = V.snapshot(current)
        new = V.coalesce_model(current, self.plans[self.level - 1], self.adapter)
        self.parked[self.level] = current.to("cpu")
        return self._put(new, level)

    def decoalesce_to(self, level: int, alpha_original: float, where: str = "") -> nn.Module:
        """One level up (``level`` = the current one − 1): de-coalesce the current module, interpolate with the
        snapshot of ``level`` (weight ``alpha_original``) into its parked module, which is put in the host (on the
        device of the current one) and returned.

        Raises:
            RuntimeError: ``level`` is not the next one up.
            NonFiniteWeightsError: the current module or the snapshot of ``level`` has a non-finite parameter
                (:meth:`check_finite`; ``where`` starts the message).
        """
        self._check_step(level, self.level - 1)
        self.check_finite([level], where)
        new = V.decoalesce_model(
            self.model, self.parked.pop(level), self.plans[level - 1], self.snapshots.pop(level), alpha_original
        )
        return self._put(new, level)

    def change_to(self, level: int, alpha_original: float, where: str = "") -> nn.Module:
        """One level down (:meth:`coalesce_to`) or up (:meth:`decoalesce_to`).

        Raises:
            RuntimeError: ``level`` is not next to the current one or outside 1..K.
            NonFiniteWeightsError: a non-finite weight in what the change maps (:meth:`check_finite`).
        """
        if level == self.level + 1:
            return self.coalesce_to(level, where)
        return self.decoalesce_to(level, alpha_original, where)

    def up_to_full(self, alpha_original: float, where: str = "") -> list[int]:
        """From the current level up to level 1, one :meth:`decoalesce_to` per level (the operators of a normal
        up-switch, with the pending snapshots); returns the levels passed through, ``[current, ..., 1]`` (``[1]``
        when the full model is in place already).

        Raises:
            NonFiniteWeightsError: a non-finite weight in the current module or a pending snapshot, found before
                anything changes (:meth:`check_finite`).
        """
        path = [self.level]
        self.check_finite(list(range(self.level - 1, 0, -1)), where)
        while self.level > 1:
            self.decoalesce_to(self.level - 1, alpha_original, where)
            path.append(self.level)
        return path

    def rebuild(self, level: int) -> nn.Module:
        """Fresh modules of levels 2..``level`` from the full model in place (random weights, global RNG untouched:
        the checkpoint's weights are loaded next); the module of ``level`` is put in the host and returned.

        Raises:
            ValueError: ``level`` outside 1..K.
            RuntimeError: a coarser level than 1 is in place and ``level`` is another one.
        """
        if not 1 <= level <= self.levels:
            raise ValueError(f"{self.owner}: the checkpoint's level {level} is outside 1..{self.levels}")
        if level == self.level:
            return self.model
        if self.level != 1:
            raise RuntimeError(f"{self.owner}: cannot restore level {level} from level {self.level}")
        model, self.parked = V.build_levels(self.model, self.adapter, self.plans, level)
        return self._put(model, level)

    def training_flops(self, fn: Callable[[Any], float], batch: Any) -> tuple[float, float]:
        """``(fn(batch), the same with the full model)``: a batch's training FLOPs with the current model and with the
        full one (held in place by :meth:`holding` below level 1, no forward runs).

        Raises:
            what ``fn`` raises (``NotImplementedError`` when the host cannot count a batch).
        """
        cur = base = float(fn(batch))
        if self.level != 1:
            with self.holding(1):
                base = float(fn(batch))
        return cur, base

    @contextmanager
    def holding(self, level: int) -> Iterator[nn.Module]:
        """Inside the block ``host.<attr>`` is the module of ``level`` (set in ``host._modules`` directly, nothing
        else changes; for counting FLOPs only: a parked module is on the CPU, run no forward); the current one is
        back after.

        Raises:
            KeyError: no module of ``level`` is parked.
        """
        modules = self.host._modules
        current = modules[self.attr]
        model = current if level == self.level else self.parked[level]
        modules[self.attr] = model
        try:
            yield model
        finally:
            modules[self.attr] = current

    @contextmanager
    def full_model(self) -> Iterator[nn.Module]:
        """Inside the block the host counts as the full model: ``host.<attr>`` is the module of level 1
        (:meth:`holding`: set in ``host._modules`` directly; for counting only, run no forward) and a host's integer
        ``effi_num_layers`` instance attribute is the full model's depth; both are back after. At level 1 nothing
        changes. Used as the V-cycle's ``Baseline(model=stack.full_model)`` for the
        :class:`~lightning_effi.core.accounting.EfficiencyMonitor` (the full model's ``effi_training_flops`` and
        layer-tokens on the batch).

        Raises:
            KeyError: below level 1, the full model is not parked (no :meth:`coalesce_to` or :meth:`rebuild` ran).
        """
        host = self.host
        before = vars(host).get("effi_num_layers")
        follows = is_int(before) and bool(self.plans)
        with self.holding(1) as model:
            if follows:
                host.effi_num_layers = self.num_layers(1)
            try:
                yield model
            finally:
                if follows:
                    host.effi_num_layers = before

    # ------------------------------------------------------------------------------------------------ checkpoints
    def full_state_dict(self, device: Any = None) -> dict[str, Tensor]:
        """The state dict of the current module de-coalesced level by level up to the full model's shapes
        (:func:`~lightning_effi.vcycle.operators.decoalesce` with the plans of levels ``level − 1``, ..., 1; no
        interpolation): what a checkpoint written below level 1 holds as the network's weights. De-coalescing widths
        with pairs preserves the function (GPT-2 under ``embedding_convention="exact"``, BERT, ViT: the method card's
        "What is and is not function-preserving"); de-coalescing depths does not (a duplicated block applied twice).
        At level 1, the module's own state dict. New tensors in the module's dtype, on its device (``device``: copied
        there first; the values are the same); tied keys share one tensor."""
        state: dict[str, Tensor] = dict(self.model.state_dict())
        if device is not None:
            state = _copy_to(state, device)
        for level in range(self.level, 1, -1):
            state = V.decoalesce(state, self.plans[level - 2])
        return state

    def restore_full_size(self) -> list[int]:
        """Put a full-size network back in the host from below level 1 without training it: the parked module of level
        1 gets :meth:`full_state_dict` (the current level's weights de-coalesced up to the full shapes, no
        interpolation: the weights a checkpoint written now holds; computed on the CPU) and goes in the host, on the
        CPU, in the current module's train / eval mode; the parked modules and pending snapshots are dropped. For a fit
        that ends abnormally at a coarse level (an exception), where the up-switch of :meth:`up_to_full` (which
        needs the snapshots and a fresh optimizer) does not apply. Returns the levels passed ``[current, ..., 1]``
        (``[1]`` at level 1: nothing changes).

        Raises:
            RuntimeError: below level 1 and the full model is not parked (a level change failed half-way).
        """
        if self.level == 1:
            return [1]
        if 1 not in self.parked:
            raise RuntimeError(
                f"{self.owner}: the full model is not parked at level {self.level} (a level change failed half-way), "
                "so no full-size network can be put back"
            )
        path = list(range(self.level, 0, -1))
        current = self.model
        full = self.parked[1]
        full.load_state_dict(self.full_state_dict(device="cpu"))
        full.train(current.training)
        self.parked, self.snapshots = {}, {}
        self._put(full, 1)
        return path

    def _replace_network(self, state_dict: MutableMapping[str, Tensor], network: Mapping[str, Tensor]) -> None:
        """Replace the entries ``<attr>.*`` of a host's state dict by ``network`` (keys relative to the network), in
        place (the mapping object and the position of the block are kept)."""
        prefix = self.attr + "."
        items = list(state_dict.items())
        state_dict.clear()
        placed = False
        for key, value in items:
            if not key.startswith(prefix):
                state_dict[key] = value
            elif not placed:
                state_dict.update({prefix + k: v for k, v in network.items()})
                placed = True
        if not placed:
            state_dict.update({prefix + k: v for k, v in network.items()})

    def write_full_size(self, state_dict: MutableMapping[str, Tensor]) -> None:
        """In a host's state dict about to be saved (``checkpoint["state_dict"]``, keys ``<attr>.<key>``), replace the
        current level's weights by :meth:`full_state_dict`, so the checkpoint loads into the full model without the
        V-cycle (``load_from_checkpoint``, ``trainer.validate(ckpt_path=...)``). Nothing changes at level 1.

        Raises:
            RuntimeError: the network's entries in ``state_dict`` are not the current module's state-dict keys.
        """
        if self.level == 1:
            return
        prefix = self.attr + "."
        saved = {k[len(prefix) :] for k in state_dict if k.startswith(prefix)}
        if saved != set(self.model.state_dict()):
            raise RuntimeError(
                f"{self.owner}: the checkpoint's entries {prefix}* are not the level-{self.level} network's state-dict "
                f"keys (differing: {sorted(saved ^ set(self.model.state_dict()))[:5]}); was the state dict changed "
                "before the V-cycle's on_save_checkpoint?"
            )
        self._replace_network(state_dict, self.full_state_dict())

    def put_weights(self, state_dict: MutableMapping[str, Tensor], weights: Mapping[str, Tensor]) -> None:
        """In a checkpoint's state dict about to be loaded, replace the network's (full-size) entries by ``weights``,
        the exact weights of the current level saved in the owner's state (:meth:`state_dict`), so the strict load
        that follows restores them.

        Raises:
            ValueError: ``weights`` do not fit the module in place (other keys or shapes: the checkpoint was written
                with another configuration of the levels, e.g. another ``depth_scheme``).
        """
        mine = {k: tuple(t.shape) for k, t in self.model.state_dict().items()}
        theirs = {k: tuple(t.shape) for k, t in weights.items()}
        if mine != theirs:
            diff = sorted(set(mine.items()) ^ set(theirs.items()))[:6]
            raise ValueError(
                f"{self.owner}: the checkpoint's level-{self.level} weights do not fit the level-{self.level} model of "
                f"this configuration (differing (key, shape) entries: {diff}); resume with the width_scheme, "
                "depth_scheme and model the checkpoint was written with"
            )
        self._replace_network(state_dict, weights)

    def _check_level_weights(self, state_dict: Mapping[str, Tensor]) -> None:
        """A coarse level's checkpoint without ``"weights"`` in the owner's state: its state dict must hold the level's
        own weights (written before the exact weights were saved beside the state). One whose network entries have
        other shapes (the full-size model of a current checkpoint whose ``"weights"`` were lost) failed with torch's
        size mismatch, naming nothing of the V-cycle (qa92-break 04).

        Raises:
            ValueError: naming the missing field and the first differing entries.
        """
        prefix = self.attr + "."
        mine = {k: tuple(t.shape) for k, t in self.model.state_dict().items()}
        theirs = {k[len(prefix) :]: tuple(t.shape) for k, t in state_dict.items() if k.startswith(prefix)}
        differ = sorted(k for k in mine.keys() & theirs.keys() if mine[k] != theirs[k])
        if differ:
            shown = [(k, theirs[k], mine[k]) for k in differ[:3]]
            raise ValueError(
                f"{self.owner}: checkpoint's V-cycle state at level {self.level} lacks 'weights' (the level's exact "
                f"weights, saved beside the state below level 1), and its state_dict holds other shapes than the "
                f"level-{self.level} model ((key, checkpoint's, level's): {shown}): the state was edited or written "
                "otherwise; resume from a checkpoint written by VCycleCallback"
            )

    def state_dict(self) -> dict[str, Any]:
        """The snapshots pending interpolation, ``{"snapshots": {"<level>": state dict}}``. The level itself is saved by
        the owner; the exact weights of a coarse level go into a checkpoint beside this state
        (:meth:`exact_weights`)."""
        return {"snapshots": {str(k): dict(v) for k, v in self.snapshots.items()}}

    def exact_weights(self, device: Any = None) -> dict[str, Any] | None:
        """Below level 1, the exact weights of the current module (keys relative to the network), which the owner
        writes into a checkpoint's callback state as ``"weights"`` (the checkpoint's own ``state_dict`` holds their
        full-size de-coalesced form, :meth:`write_full_size`); copies on ``device`` when given (tied keys share one
        copy); None at level 1."""
        if self.level == 1:
            return None
        weights = dict(self.model.state_dict())
        return _copy_to(weights, device) if device is not None else weights

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Check that the level saved in ``state_dict["level"]`` is in place (:meth:`rebuild` ran) and load the
        snapshots of :meth:`state_dict` (its ``"weights"`` were loaded into the module before, by the hook of
        :meth:`install_resume_hook`).

        Raises:
            RuntimeError: another level is in place.
        """
        if int(state_dict["level"]) != self.level:
            raise RuntimeError(
                f"{self.owner}: the checkpoint is at level {state_dict['level']} but the model "
                f"is at level {self.level}: the on_load_checkpoint wrapper installed in setup did not "
                "run (was the module's on_load_checkpoint replaced?)"
            )
        self.snapshots = {int(k): dict(v) for k, v in state_dict["snapshots"].items()}

    def install_resume_hook(
        self,
        state_key: str,
        before: Callable[[], None] | None = None,
        after: Callable[[], None] | None = None,
        check: Callable[[Mapping[str, Any]], None] | None = None,
    ) -> None:
        """Wrap ``host.on_load_checkpoint`` and ``host.on_save_checkpoint`` on the instance (Lightning looks the hooks
        up on the instance; installed once per host, :meth:`remove_resume_hook` takes them off).

        Load (Lightning calls this hook before the strict ``load_state_dict``): ``check(checkpoint)`` first (the
        owner refuses a checkpoint of another configuration), then :meth:`rebuild` the level saved in the
        checkpoint's ``callbacks[state_key]`` and :meth:`put_weights` its exact ``"weights"`` in place of the
        full-size ones; ``before()`` / ``after()`` run around the rebuild when it changes the module (the owner tells
        the techniques that follow model changes). A checkpoint without ``"weights"`` (written before they existed)
        holds the level's weights in its state dict and loads as it is.

        Save (called last when Lightning writes a checkpoint, also one of weights only): below level 1,
        :meth:`write_full_size` on ``checkpoint["state_dict"]`` before the host's own hook runs.
        """
        original_load = self.host.on_load_checkpoint
        original_save = getattr(self.host, "on_save_checkpoint", None)  # every LightningModule has one
        if getattr(original_load, "_vcycle_owner", None) is self:
            return

        def on_load_checkpoint(checkpoint: dict[str, Any]) -> None:
            if check is not None:
                check(checkpoint)
            state = (checkpoint.get("callbacks") or {}).get(state_key)
            if state:
                if int(state["level"]) != self.level:
                    if before is not None:
                        before()
                    self.rebuild(int(state["level"]))
                    if after is not None:
                        after()
                weights = state.get("weights")
                if weights is not None and "state_dict" in checkpoint:
                    self.put_weights(checkpoint["state_dict"], weights)
                elif self.level > 1 and "state_dict" in checkpoint:
                    self._check_level_weights(checkpoint["state_dict"])
            original_load(checkpoint)

        def on_save_checkpoint(checkpoint: dict[str, Any]) -> None:
            if "state_dict" in checkpoint:
                self.write_full_size(checkpoint["state_dict"])
            if original_save is not None:
                original_save(checkpoint)

        for hook in (on_load_checkpoint, on_save_checkpoint):
            hook._vcycle_owner = self  # type: ignore[attr-defined]
        self.host.on_load_checkpoint = on_load_checkpoint
        self.host.on_save_checkpoint = on_save_checkpoint

    def remove_resume_hook(self) -> None:
        """At the end of a fit: take the wrappers of :meth:`install_resume_hook` off the bound host (those that are
        there) and let the host go, so the stack keeps no reference to the LightningModule (:meth:`bind` binds it
        again)."""
        host, self.host = self.host, None
        if host is None:
            return
        for name in ("on_load_checkpoint", "on_save_checkpoint"):
            hook = vars(host).get(name)
            if getattr(hook, "_vcycle_owner", None) is self:
                del vars(host)[name]
