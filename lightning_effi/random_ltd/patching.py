"""Random-LTD model conversion: patch selected transformer layers to run on a random subset of tokens.

No Lightning here (the callback :class:`lightning_effi.callbacks.RandomLTDCallback` drives it); usable in any loop::

    ctl = LTDController(num_layers=12, layer_ids=range(1, 11), seed=0)
    patched = convert(model, find_adapter(model), ctl)     # state_dict keys unchanged
    ctl.begin(step=0, micro_batch=0, reserved_length=64)
    loss = model(**batch).loss                                # layers 1..10 see 64 random tokens per sample
    ctl.end()
    restore(patched)

Design (the method card ``README.md`` beside this file has the long story):

- **No wrapper modules.** Each selected layer gets an instance-level ``forward`` (:class:`LTDForward`) that wraps the
  bound method it replaces (for HF layers, the class-level ``forward`` that holds the activation-checkpointing
  logic), so ``state_dict`` keys and shapes are those of the plain model and checkpoints load either way.
- **Indices per forward.** The first LTD layer of a forward draws ``[L_ltd, B, r]`` indices for all LTD layers from a
  generator seeded with ``(seed, step, micro_batch, rank)``; every later lookup in the same context (including the
  recomputation of activation checkpointing) returns the same rows. The global RNGs are never used.
- **torch.compile.** The index lookup (:meth:`LTDForward.select`) and the shape recorder of a paused network run
  eagerly (``torch.compiler.disable``): compiled code never reads the controller's per-step state, and the reserved
  length is a dynamic axis of the indices, so neither a new step nor a new ``r`` recompiles the layers.
- **Pass-through** when the layer is in ``eval()`` mode, the controller is not armed (outside a training batch), or
  ``r >= S`` (e.g. after curriculum truncation). Hidden states on the ``meta`` device (FLOP counting on a meta copy)
  and nested tensors (PyTorch's padded fast path) also pass through.
- **Reserved length from the data.** :meth:`LTDController.begin` takes ``r``, or a function of the sequence length
  ``S`` that the first LTD layer of a forward calls with the ``S`` it sees (random-LTD's ``max_value`` derived from
  the data).
- **Attention weights** of a dropped layer (``output_attentions=True``: a layer's extra ``[B, H, r, r]`` output, or
  Hugging Face's captured ``attentions`` / ``cross_attentions``) are put back on the full sequence, ``[B, H, S, S]``
  with zeros in the dropped tokens' rows and columns
  (:func:`~lightning_effi.random_ltd.functional.expand_attention`); one of the layer's own arguments returned as it
  is is handed on at full length (as it was given); any other extra tensor output is an error.
- **Arguments.** The adapter declares, by name, which layer arguments have sequence axes (gathered per sample with
  the layer's indices, never sliced), which pass through, and which must be ``None`` (KV caches). Positional and
  keyword arguments are matched to names through the layer's signature. A signature argument the adapter does not
  know is rejected at :func:`convert`; an undeclared tensor with an axis of length S arriving through ``**kwargs`` is
  rejected at the call.
"""

from __future__ import annotations

import copy
import inspect
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_effi.core.checks import is_int
from lightning_effi.core.measure import (
    CallRecord,
    Recompute,
    _checkpoint_recompute,
    _in_backward,
    _reentrant_recompute,
    describe_call,
    tensor_leaves,
)
from lightning_effi.core.rng import hash64
from lightning_effi.models.base import MUST_BE_NONE, PASS, AttentionMask, SeqArg, TransformerAdapter
from lightning_effi.random_ltd import functional as F

__all__ = [
    "LTDController",
    "LTDForward",
    "PatchedLayers",
    "convert",
    "find_patches",
    "observe",
    "resolve_layer_ids",
    "restore",
    "restore_module",
    "strip_random_ltd_keys",
]

#: the most layer calls :attr:`LTDController.calls` keeps (a schedule of many reserved lengths over many shapes)
_MAX_CALLS = 4096


def _same(t: Tensor) -> Tensor:
    """Identity pack / unpack of :meth:`LTDForward._note_call`'s saved-tensor hooks."""
    return t


#: Purpose key mixed into every random-LTD seed (another technique with the same user seed gets another stream).
_PURPOSE = int.from_bytes(b"RandLTD", "little")


def resolve_layer_ids(layer_ids: Iterable[int] | None, num_layers: int) -> tuple[int, ...]:
    """The LTD layer ids: default ``1 .. L-2`` (all but the first and the last, the paper's setting).

    Raises:
        ValueError: an id that is not an int, out of ``[0, L)``, duplicated or unsorted; an empty selection.
    """
    if layer_ids is None:
        ids = tuple(range(1, num_layers - 1))
        if not ids:
            raise ValueError(
                f"layer_ids: the model has {num_layers} layers, so the default (all but the first and "
                f"the last) selects none; pass layer_ids explicitly: indices of the model's layers in [0, {num_layers})"
                + (
                    f" (the first is 0), e.g. layer_ids=[{num_layers - 1}] (the first and last layers are allowed; "
                    "the paper keeps them full)"
                    if num_layers > 0
                    else ""
                )
            )
        return ids
    ids = tuple(layer_ids)
    for i in ids:
        if not is_int(i):
            raise ValueError(f"layer_ids: ids must be ints, got {i!r}")
        if not 0 <= i < num_layers:
            raise ValueError(
                f"layer_ids: id {i} is out of range for a model with {num_layers} layers (valid: 0..{num_layers - 1})"
            )
    if len(set(ids)) != len(ids):
        raise ValueError(f"layer_ids: duplicate ids in {list(ids)}")
    if list(ids) != sorted(ids):
        raise ValueError(f"layer_ids: ids must be sorted ascending, got {list(ids)}")
    if not ids:
        raise ValueError("layer_ids: select at least one layer")
    return tuple(int(i) for i in ids)


@dataclass
class BatchRecord:
    """Shapes seen by the LTD layers in one forward context: ``B``, ``S`` and the effective reserved length; and the
    grad mode of each forward of that shape in the context (a step may run the network twice on its batch: an
    R-Drop / consistency loss, a ``no_grad`` target pass, a GAN's two passes), each of which drops its tokens.
    Empty: one forward with grad."""

    batch_size: int
    seq_len: int
    reserved_length: int
    grads: list[bool] = field(default_factory=list)
    #: the LTD layers (ordinals) that ran on this shape: a forward stopped early (timm's forward_intermediates with
    #: stop_early) runs some of them only (the others' saving was counted, qa114-dense 02)
    layers: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class LayerCalls:
    """An LTD layer's recorded call on the full sequence and on its kept tokens (shapes only, for replaying), the
    shapes of all its tensor arguments (``shapes``: a new one, the same ``B, S, r``, is recorded again), and their
    sizes on the axes that are neither the gathered sequence nor the batch (``fixed``: the FLOPs of a layer on ``T``
    tokens follow ``B (a T + c T²)`` for one such set of sizes only, e.g. one encoder length of a cross-attention)."""

    full: CallRecord
    kept: CallRecord
    shapes: tuple[tuple[int, ...], ...]
    fixed: tuple[tuple[int, ...], ...]


@dataclass
class LTDController:
    """Per-forward state shared by the patched layers: the reserved length, the armed context and its indices.

    Args:
        num_layers: ``L``, layers in the adapter's list. layer_ids: the LTD layers (exact indices, sorted).
        seed: user seed. rank: data-parallel rank (ranks draw different tokens).
        keep_prefix_tokens: positions ``0..k-1`` always kept.

    Attributes:
        reserved_length: ``r`` of the current context (``None`` before a schedule function resolved it).
    """

    num_layers: int
    layer_ids: tuple[int, ...]
    seed: int = 0
    rank: int = 0
    keep_prefix_tokens: int = 0
    reserved_length: int | None = None
    key: tuple[int, int] | None = None
    records: list[BatchRecord] = field(default_factory=list)
    #: with ``record_calls``: each LTD layer's call on the full sequence and on its kept tokens, without values, the
    #: last one per ``(layer index, B, S, r, grad mode)`` (for measuring the FLOPs the layer skipped, random-LTD's
    #: accounting), with the shapes of its arguments and the sizes of their axes that are neither the sequence nor
    #: the batch (a decoder layer's encoder output: the cross-attention's cost follows its length;
    #: :meth:`LTDForward._note_call`)
    record_calls: bool = False
    calls: dict[tuple[int, int, int, int, bool], LayerCalls] = field(default_factory=dict, repr=False)
    draws: int = 0
    lookups: int = 0
    #: the ids of the parameters the Trainer's optimizers hold (set by the callback at every batch; None: unknown), by
    #: which a copy of the converted network that is not trained is told (:class:`LTDForward`)
    optimized: set[int] | None = field(default=None, repr=False)
    _indices: dict[tuple, Tensor] = field(default_factory=dict, repr=False)
    _records: dict[tuple, BatchRecord] = field(default_factory=dict, repr=False)  # the record of each shape
    _schedule: Callable[[int], int] | None = field(default=None, repr=False)

    @property
    def num_ltd_layers(self) -> int:
        return len(self.layer_ids)

    def begin(self, step: int, micro_batch: int, reserved_length: int | Callable[[int], int]) -> None:
        """Arm the controller for the forward(s) of one training micro-batch.

        Args:
            reserved_length: ``r``, or a function ``S -> r`` called with the sequence length of the first forward the
                LTD layers see in this context (once per shape; the last value is :attr:`reserved_length`).
        """
        self.key = (int(step), int(micro_batch))
        if callable(reserved_length):
            self._schedule, self.reserved_length = reserved_length, None
        else:
            self._schedule, self.reserved_length = None, int(reserved_length)
        self._indices.clear()
        self._records.clear()
        self.records = []

    def mark(self) -> tuple[int, dict[tuple, int], frozenset[tuple]]:
        """What the current context has recorded so far, for :meth:`rollback`: the number of records, each record's
        forwards, and the shapes drawn for."""
        return len(self.records), {k: len(r.grads) for k, r in self._records.items()}, frozenset(self._indices)

    def rollback(self, mark: tuple[int, dict[tuple, int], frozenset[tuple]]) -> None:
        """Forget the forwards recorded since :meth:`mark`: a forward that raised, caught by the step and run again (an
        out-of-memory fallback rerunning the batch in halves) trained none of the tokens it dropped. The indices drawn
        for a shape first seen since are forgotten too; the next forward of that shape draws them again from the
        context's generator (the same indices)."""
        count, grads, drawn = mark
        del self.records[count:]
        for key in [k for k in self._records if k not in grads]:
            del self._records[key]
        for key, n in grads.items():
            del self._records[key].grads[n:]
        for key in [k for k in self._indices if k not in drawn]:
            del self._indices[key]

    def _resolve(self, seq_len: int) -> int:
        """``r`` for a forward of ``seq_len`` tokens (calls the schedule function of :meth:`begin`, if any)."""
        if self._schedule is not None:
            self.reserved_length = int(self._schedule(seq_len))
        assert self.reserved_length is not None
        return self.reserved_length

    def end(self) -> None:
        """Disarm (the records and indices of the last context stay readable until the next :meth:`begin`)."""
        self.key = None

    @property
    def armed(self) -> bool:
        return self.key is not None and (self.reserved_length is not None or self._schedule is not None)

    def generator(self, device: torch.device) -> torch.Generator:
        """The private generator of the current context on ``device``."""
        assert self.key is not None
        g = torch.Generator(device=device)
        g.manual_seed(hash64(int(self.seed), _PURPOSE, self.key[0], self.key[1], int(self.rank)))
        return g

    def indices(self, ordinal: int, batch_size: int, seq_len: int, device: torch.device) -> Tensor | None:
        """Token indices ``int64 [B, r]`` of LTD layer ``ordinal`` in the current context, or ``None`` (pass-through:
        not armed, or ``r >= S``). Drawn once per context and shape; a repeated lookup never redraws."""
        if not self.armed:
            return None
        self.lookups += 1
        shape_key = (batch_size, seq_len, str(device))
        grad = torch.is_grad_enabled()
        if shape_key in self._indices and ordinal == 0 and (not _in_backward() or _reentrant_recompute()):
            # another forward of this shape in the context (its first LTD layer): it drops the same tokens, and
            # its skipped FLOPs count too; a recompute in the backward is one only for a reentrant
            # torch.utils.checkpoint around the layer (its forward ran without grad): the recompute of other
            # activation checkpointing is part of the first forward's measured call
            self._records[shape_key].grads.append(grad)
        if shape_key not in self._indices:
            r = min(self._resolve(seq_len), seq_len)
            self._records[shape_key] = BatchRecord(batch_size, seq_len, r, [grad])
            self.records.append(self._records[shape_key])
            if r >= seq_len:
                self._indices[shape_key] = torch.empty(0)
            else:
                if r < self.keep_prefix_tokens:
                    raise ValueError(
                        f"reserved length {r} is smaller than keep_prefix_tokens ({self.keep_prefix_tokens})"
                    )
                self.draws += 1
                # drawn outside inference mode: indices first drawn for a target pass under torch.inference_mode()
                # would be inference tensors, which the training forward of the same batch cannot save for backward
                with torch.inference_mode(False):
                    self._indices[shape_key] = F.sample_token_indices(
                        self.num_ltd_layers,
                        batch_size,
                        seq_len,
                        r,
                        self.generator(device),
                        keep_prefix_tokens=self.keep_prefix_tokens,
                        device=device,
                    )
        idx = self._indices[shape_key]
        self._records[shape_key].layers.add(int(ordinal))
        return None if idx.numel() == 0 else idx[ordinal]

    def observe(self, batch_size: int, seq_len: int, device: torch.device) -> None:
        """Record the shapes of the current context's forward on a network without LTD layers (random-LTD paused
        there, :func:`observe`): ``(B, S, r = S)``, once per shape, nothing drawn. A no-op when not armed."""
        if not self.armed:
            return
        shape_key = (batch_size, seq_len, str(device))
        if shape_key not in self._indices:
            self._resolve(seq_len)  # a schedule function follows the data even where nothing is dropped
            self.records.append(BatchRecord(batch_size, seq_len, seq_len))
            self._indices[shape_key] = torch.empty(0)

    def last_indices(self) -> Tensor | None:
        """The ``[L_ltd, B, r]`` indices drawn last in the current context (``None`` if nothing was dropped)."""
        drawn = [t for t in self._indices.values() if t.numel()]
        return drawn[-1] if drawn else None


def _hidden_name(sig: inspect.Signature) -> str:
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return p.name
    raise ValueError("layer forward takes no positional hidden-states argument")


def _check_signature(layer: nn.Module, index: int, sig: inspect.Signature, adapter: TransformerAdapter) -> str:
    known = adapter.layer_arguments
    hidden = _hidden_name(sig)
    for p in sig.parameters.values():
        if p.name == hidden or p.kind == p.VAR_KEYWORD:
            continue
        if p.kind == p.VAR_POSITIONAL:
            raise ValueError(
                f"layer {index} ({type(layer).__name__}) takes *{p.name}: random-LTD cannot tell which "
                f"extra positional arguments have a sequence axis; adapter {adapter.name or adapter!r} "
                "must name them (use GenericAdapter(seq_args=..., passthrough=...) or a registered "
                "adapter)"
            )
        if p.name not in known:
            raise ValueError(
                f"layer {index} ({type(layer).__name__}) takes an argument {p.name!r} that adapter "
                f"{adapter.name or adapter!r} does not know; declare how to treat it: an attention mask by its "
                f"layout (GenericAdapter(masks={{{p.name!r}: 'self'}}) for [S, S] / [B, S, S] / [B, 1, S, S], "
                "'cross' for the query axis only, 'key_padding' for [B, S]), another tensor with sequence axes "
                f"(seq_args={{{p.name!r}: [axes]}}, batch axis 0), or an argument passed unchanged "
                f"(passthrough=[{p.name!r}]) or that must be None (must_be_none=[...]); or use a registered adapter"
            )
    return hidden


def trained(module: nn.Module, optimized: set[int] | None) -> bool:
    """Whether an optimizer trains a parameter of ``module`` (``optimized``: the ids of the optimizers' parameters;
    None when unknown: a parameter with ``requires_grad``). Lightning's ``toggle_optimizer`` turns ``requires_grad`` off
    for the parameters of the other optimizers within a step: they are trained all the same."""
    if optimized is None:
        return any(p.requires_grad for p in module.parameters())
    return any(id(p) in optimized for p in module.parameters())


class LTDForward:
    """The patched ``forward`` of one LTD layer (an instance attribute; the module's parameters are untouched).
    ``drops_tokens`` tells :class:`~lightning_effi.core.measure.FlopsMeter` that the calls inside it run on the kept
    tokens.

    Call semantics: ``original(*args, **kwargs)`` when passing through; otherwise the hidden states and every
    declared sequence argument are gathered with this layer's ``[B, r]`` indices, the original forward runs on the
    subset, and its output (a tensor, or the first element of a tuple) is scattered back into the full sequence.
    """

    drops_tokens = True

    def __init__(
        self,
        layer: nn.Module,
        original: Any,
        controller: LTDController,
        ordinal: int,
        index: int,
        adapter: TransformerAdapter,
    ):
        self.original = original
        self.controller = controller
        #: the :class:`PatchedLayers` this forward belongs to (set by :func:`convert`; None in a deep copy)
        self.patch: PatchedLayers | None = None
        self.ordinal = ordinal
        self.index = index
        self.arguments = adapter.layer_arguments
        self.seq_dim = 1 if adapter.hidden_state_order == "batch_seq" else 0
        self.signature = inspect.signature(original)
        self.hidden = _check_signature(layer, index, self.signature, adapter)
        self.layer_type = type(layer).__name__
        self.adapter_name = adapter.name or repr(adapter)
        # masks in nn.MultiheadAttention layouts ([B*num_heads, S, S]) when the layer attends with one
        attention = next((m for m in layer.modules() if isinstance(m, nn.MultiheadAttention)), None)
        self.num_heads: int | None = None if attention is None else int(attention.num_heads)

    def __deepcopy__(self, memo: dict) -> LTDForward:
        # a deep copy of the model (e.g. FLOP counting on a meta copy) patches the copied layer, sharing the controller
        new = copy.copy(self)
        new.original = copy.deepcopy(self.original, memo)
        new.patch = None  # the record of what convert changed is the original model's
        return new

    def _owner(self) -> nn.Module:
        return self.original.__self__

    def _gather_arg(self, name: str, value: Any, idx: Tensor, seq_len: int) -> Any:
        decl = self.arguments.get(name)
        if value is None or decl == PASS:
            return value
        if isinstance(decl, AttentionMask):
            if not isinstance(value, Tensor):
                return value
            try:
                return F.gather_attention_mask(value, idx, seq_len, decl.kind, self.num_heads)
            except F.MaskLayoutError as err:
                raise F.MaskLayoutError(
                    f"random-LTD layer {self.index} ({self.layer_type}), adapter {self.adapter_name}: argument "
                    f"{name!r}: {err}"
                ) from None
        if decl == MUST_BE_NONE:
            raise RuntimeError(
                f"random-LTD layer {self.index} ({self.layer_type}) received "
                f"{name}={type(value).__name__} while dropping tokens; it must be None in training "
                "(turn the KV cache off: use_cache=False)"
                + (
                    "; a generate() or decoding loop in training_step (a rollout) builds a cache whatever the "
                    "config says: run it in eval mode (self.model.eval(), then .train() again), where random-LTD's "
                    "layers run the full sequence, so the rollout comes from the whole network"
                    if not torch.is_grad_enabled()
                    else ""
                )
            )
        if isinstance(decl, SeqArg):
            if isinstance(value, (tuple, list)):
                return type(value)(self._gather_arg(name, v, idx, seq_len) for v in value)
            if not isinstance(value, Tensor):
                return value
            axes = decl.axes
            if decl.only_matching:
                axes = tuple(a for a in axes if value.shape[a] == seq_len)
            nd = value.dim()
            for a in axes:
                if value.shape[a] not in (1, seq_len):
                    raise RuntimeError(
                        f"random-LTD layer {self.index}: argument {name!r} of shape "
                        f"{tuple(value.shape)} has size {value.shape[a]} on sequence axis {a}, "
                        f"expected {seq_len} or 1"
                    )
            if decl.batch_axis % nd in {a % nd for a in axes}:
                raise RuntimeError(
                    f"random-LTD layer {self.index}: argument {name!r} of shape {tuple(value.shape)} "
                    f"has fewer axes than the adapter declares (seq_args axes {list(decl.axes)} and batch axis "
                    f"{decl.batch_axis}); an attention mask without a batch axis (e.g. a shared [S, S] causal mask) "
                    f"is declared by its layout: GenericAdapter(masks={{{name!r}: 'self'}})"
                )
            return F.gather_seq_tensor(value, idx, axes, decl.batch_axis, seq_len)
        # undeclared (only reachable through **kwargs): reject tensors that carry this sequence
        if isinstance(value, Tensor) and seq_len > 1 and seq_len in value.shape[1:]:
            raise RuntimeError(
                f"random-LTD layer {self.index} ({self.layer_type}) received a tensor argument "
                f"{name!r} of shape {tuple(value.shape)} that the adapter does not declare; it may "
                "have a sequence axis, so it cannot be passed unchanged (declare it in the adapter)"
            )
        return value

    @torch.compiler.disable
    def select(self, hidden: Tensor, args: tuple = (), kwargs: dict | None = None) -> Tensor | None:
        """This layer's kept-token indices ``int64 [B, r]`` for ``hidden`` (``[B, S, ...]``; ``[S, B, ...]`` for an
        adapter whose ``hidden_state_order`` is ``"seq_batch"``) in the controller's current context
        (:meth:`LTDController.indices`: drawn once per context and shape, recorded for the accounting), or ``None``
        (pass through: the controller is not armed, or ``r >= S``).

        Under ``torch.compile`` this runs eagerly (``torch.compiler.disable``: one graph break per LTD layer), so the
        compiled code never reads the controller's per-step state (step, micro-batch, draw counts, records), which
        would otherwise be guarded and recompiled at every step; the reserved-length axis of the returned indices is
        marked dynamic (``torch._dynamo.maybe_mark_dynamic``), so a new ``r`` of the schedule reuses the compiled
        layer (``tests/compat/test_runtime.py``: ``test_random_ltd_compiles_once_for_every_reserved_length``,
        ``test_torch_compile``).

        Raises:
            ValueError: the reserved length is below ``keep_prefix_tokens``.
        """
        if not self.controller.armed:
            return None
        check_hidden_layout(hidden, self.seq_dim)
        seq_len = hidden.shape[self.seq_dim]
        batch = hidden.shape[1 - self.seq_dim]
        idx = self.controller.indices(self.ordinal, batch, seq_len, hidden.device)
        if idx is not None:
            if self.controller.record_calls and (args or kwargs):
                self._note_call(args, kwargs or {}, idx, seq_len)
            torch._dynamo.maybe_mark_dynamic(idx, 1)
        return idx

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else kwargs.get(self.hidden)
        owner = self._owner()
        if not owner.training or not isinstance(hidden, Tensor) or hidden.device.type == "meta" or hidden.is_nested:
            return self.original(*args, **kwargs)
        if self.patch is None and not torch.is_grad_enabled() and not trained(owner, self.controller.optimized):
            # a deep copy of a converted model that is not trained, called under no_grad: a momentum target or an EMA
            # copy (one the module holds is restored at the next batch start; this one may sit elsewhere, or be made
            # inside the step): an untrained network is no candidate (qa43-break 02, 03; qa44-break 05). A trained
            # copy under no_grad (a peer's pass in mutual learning, its requires_grad toggled off) drops tokens
            # as the original does (qa44-break 10)
            return self.original(*args, **kwargs)
        idx = self.select(hidden, args, kwargs)
        if idx is None:
            return self.original(*args, **kwargs)
        seq_len = hidden.shape[self.seq_dim]
        handed: list[tuple[Tensor, Tensor]] = []
        bound = self._gathered(args, kwargs, idx, seq_len, handed)
        captured = _hf_collector()
        before = {k: len(v) for k, v in captured.items() if isinstance(v, list)} if captured is not None else {}
        out = self.original(*bound.args, **bound.kwargs)
        if captured is not None:
            self._expand_captured(captured, before, idx, seq_len)
        if isinstance(out, Tensor):
            return F.scatter_tokens(hidden, idx, out, self.seq_dim)
        if isinstance(out, tuple) and out and isinstance(out[0], Tensor):
            extras = tuple(self._expand_extra(extra, idx, seq_len, handed) for extra in out[1:])
            return (F.scatter_tokens(hidden, idx, out[0], self.seq_dim), *extras)
        raise RuntimeError(
            f"random-LTD layer {self.index} ({self.layer_type}) returned {type(out).__name__}; "
            "expected a tensor or a tuple whose first element is the hidden states"
        )

    def _gathered(
        self, args: tuple, kwargs: dict, idx: Tensor, seq_len: int, handed: list[tuple[Tensor, Tensor]] | None = None
    ) -> inspect.BoundArguments:
        """The layer's arguments with the hidden states and every declared sequence argument gathered to ``idx``.
        ``handed``: filled with ``(gathered tensor, the argument it was gathered from)`` pairs, a pass-through
        argument paired with itself (the full-length tensor to hand on when the layer returns an argument as it is:
        :meth:`_expand_extra`; compared by identity, ``is``, which ``torch.compile`` resolves while tracing)."""
        bound = self.signature.bind(*args, **kwargs)

        def gather(name: str, value: Any) -> Any:
            out = self._gather_arg(name, value, idx, seq_len)
            # a pass-through argument (given unchanged: out is value) is handed on as it is too
            if handed is not None and isinstance(value, Tensor) and isinstance(out, Tensor):
                handed.append((out, value))
            return out

        for name, value in list(bound.arguments.items()):
            param = self.signature.parameters[name]
            if name == self.hidden:
                bound.arguments[name] = F.gather_tokens(value, idx, self.seq_dim)
            elif param.kind == param.VAR_KEYWORD:
                bound.arguments[name] = {k: gather(k, v) for k, v in value.items()}
            else:
                bound.arguments[name] = gather(name, value)
        return bound

    def _note_call(self, args: tuple, kwargs: dict, idx: Tensor, seq_len: int) -> None:
        """Keep this layer's call on the full sequence and on the kept tokens (shapes only) in the controller, the last
        one per ``(layer, B, S, r, grad mode)`` (:class:`LayerCalls`), for measuring what dropping skips. Runs inside
        :meth:`select`, outside a compiled graph (a note after the layer's call would break the graph where the kept
        tokens' length is not marked dynamic: a recompilation per reserved length). The backward's recompute of an
        activation-checkpointed layer is noted only under a reentrant ``torch.utils.checkpoint`` around the layer (a
        forward with grad of its own, :meth:`LTDController.indices`); a non-reentrant one around it is noted with the
        forward's call, whose replay runs inside such a checkpoint (``CallRecord.recompute``). The gather is run once
        more here, only for new shapes of the arguments."""
        recompute = None
        if _in_backward():
            if not _reentrant_recompute():
                return
        else:
            recompute = _checkpoint_recompute(self._owner())
        batch, kept = int(idx.shape[0]), int(idx.shape[1])
        key = (self.index, batch, int(seq_len), kept, torch.is_grad_enabled())
        # every tensor argument's shape: a batch of the same B, S, r whose other arguments differ (a decoder layer's
        # encoder output of another length) is recorded again, not measured on the last one's (0.84x of the step's
        # FLOPs for a 4-token source after a 64-token one, qa110-seq2seq 02)
        shapes = tuple(tuple(t.shape) for _, t in tensor_leaves((args, kwargs)))
        calls = self.controller.calls
        known = calls.get(key)
        if known is not None and known.shapes == shapes:
            return
        if known is None and len(calls) >= _MAX_CALLS:
            calls.clear()
        # with grad (the kept tensors' requires_grad as in training), under saved-tensor hooks of its own: inside a
        # non-reentrant activation checkpoint (timm's set_grad_checkpointing) the checkpoint counts every tensor the
        # forward saves, and this extra gather, not run again in the recompute, would make the counts differ
        # (torch's CheckpointError "a different number of tensors was saved")
        handed: list[tuple[Tensor, Tensor]] = []
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):
            bound = self._gathered(args, kwargs, idx, seq_len, handed)
        grad = torch.is_grad_enabled()
        used: set[tuple[Any, ...]] = {(), (0,)}  # the hidden states: the output itself, or a tuple's first element
        # the sizes a layer's cost may follow besides B, S and r: an argument's axes that are not gathered, not the
        # batch's (its axis, or the first) and above 1; an argument with none (a mask) adds nothing, so a batch
        # with a mask and one without, or another batch size, share one FLOPs model (qa110-regress 03)
        batch_axes = (0, 1 - self.seq_dim)
        fixed = tuple(
            sizes
            for out, given in handed
            if (
                sizes := tuple(
                    int(n)
                    for axis, (n, m) in enumerate(zip(given.shape, out.shape, strict=False))
                    if n == m and n > 1 and not (axis in batch_axes and n == batch)
                )
            )
        )
        calls[key] = LayerCalls(
            describe_call("layer", args, kwargs, grad, used, recompute),
            # the kept tokens' forward is followed by the scatter back, which saves tensors too: an early-stopping
            # recompute runs all of it
            describe_call(
                "layer", bound.args, bound.kwargs, grad, used, recompute and Recompute("full", recompute.context_fn)
            ),
            shapes,
            fixed,
        )

    def _is_attention(self, t: Any, idx: Tensor, keys: bool = True) -> bool:
        b, r = idx.shape
        return (
            isinstance(t, Tensor)
            and t.dim() >= 3
            and t.shape[0] == b
            and t.shape[-2] == r
            and (not keys or t.shape[-1] == r)
        )

    def _expand_extra(self, extra: Any, idx: Tensor, seq_len: int, handed: Sequence[tuple[Tensor, Tensor]]) -> Any:
        """An extra output of the layer (inside tuples, lists and dicts too). One of its own arguments returned as it
        is (a tensor the layers hand on to the next one, as T5's blocks hand on the relative position bias they were
        given, or a pass-through argument such as a per-sample conditioning vector): the full-length argument it was
        gathered from (a pass-through one as it was given), so the next layer gets what it would get without
        random-LTD. Attention weights ``[B, ..., r, r]`` (no negative value: probabilities, after
        dropout too): back on the full sequence (zeros for the dropped tokens). Any other tensor (a cache, scores or
        a bias the layer computed on its kept tokens for the next one) is an error."""
        if isinstance(extra, list | tuple):
            return type(extra)(self._expand_extra(e, idx, seq_len, handed) for e in extra)
        if isinstance(extra, dict):
            return {k: self._expand_extra(v, idx, seq_len, handed) for k, v in extra.items()}
        if not isinstance(extra, Tensor):
            return extra
        for gathered, given in handed:
            if extra is gathered:
                return given
        if self._is_attention(extra, idx) and not bool((extra.detach() < 0).any()):
            return F.expand_attention(extra, idx, seq_len)
        raise RuntimeError(
            f"random-LTD layer {self.index} ({self.layer_type}) returned an extra tensor output of shape "
            f"{list(extra.shape)} computed on the kept tokens only: not attention weights [B, ..., r, r] (values "
            ">= 0), which random-LTD puts back on the full sequence, nor one of the layer's own arguments returned as "
            "it is, which it hands on at full length. If it is a cache, turn it off in training (use_cache=False). "
            "If the layer computes it for the next layer (e.g. T5's first block, which computes the position biases "
            "the later blocks share, or residual attention scores), random-LTD cannot drop tokens in this layer: "
            "leave it out of layer_ids (the default, layer_ids=None, keeps the first and the last layer whole)"
        )

    def _expand_captured(self, captured: dict, before: dict[str, int], idx: Tensor, seq_len: int) -> None:
        """Hugging Face models (transformers 5) collect ``output_attentions`` with forward hooks on the attention
        modules, inside this layer's call: the entries it added to ``attentions`` (``[B, H, r, r]``) and
        ``cross_attentions`` (``[B, H, r, M]``, rows only) are put back on the full sequence."""
        for key, values in captured.items():
            if not isinstance(values, list) or "attentions" not in key:
                continue
            keys = not key.startswith("cross")
            for i in range(before.get(key, 0), len(values)):
                if self._is_attention(values[i], idx, keys):
                    values[i] = F.expand_attention(values[i], idx, seq_len, keys=keys)


def _hf_collector() -> dict | None:
    """The output collector of a Hugging Face forward in progress (``transformers.utils.output_capturing``), if
    transformers is loaded and one is active."""
    module = sys.modules.get("transformers.utils.output_capturing")
    var = getattr(module, "_active_collector", None) if module is not None else None
    if var is None:
        return None
    collected = var.get()
    return collected if isinstance(collected, dict) else None


@dataclass
class PatchedLayers:
    """What :func:`convert` (or :func:`observe`) changed, for :func:`restore`.

    Attributes:
        running: set by the owner of a patch made for a fit (the callback,
            :func:`~lightning_effi.core.wrapping.live_fit`): ``running(trainer)`` tells whether that fit is still
            going, seen from a fit on ``trainer``; None for a patch made outside a fit (by hand).
    """

    adapter: TransformerAdapter
    layers: list[nn.Module]
    previous: list[Any]  # the instance-level forward each layer had before (None: the class method)
    controller: LTDController
    hooks: list[Any] = field(default_factory=list)  # forward pre-hook handles of :func:`observe`
    set_up: bool = True  # the adapter's on_setup ran (convert), so restore runs its on_teardown
    running: Callable[[Any], bool] | None = None


def check_hidden_layout(hidden: Tensor, seq_dim: int) -> None:
    """Refuse hidden states that are not ``[B, S, H]`` (``seq_dim`` 1) or ``[S, B, H]`` (``seq_dim`` 0).

    Raises:
        ValueError: ``hidden`` has other than 3 dimensions: of ``[B, C, N, H]`` (HF PatchTST's channels beside its
            patches) axis 1, the channels, was taken for the sequence, and whole channels were dropped while a
            16.6% saving was reported (qa48-ts 01).
    """
    if hidden.dim() == 3:
        return
    layout = "[B, S, H]" if seq_dim == 1 else "[S, B, H]"
    raise ValueError(
        f"random-LTD: the patched layers' hidden states have shape {list(hidden.shape)}; random-LTD drops tokens of "
        f"{layout} hidden states (3 dimensions, the adapter's hidden_state_order) and would take axis {seq_dim} for "
        "the sequence. Layers that take [B, C, N, H] (channels beside the patches, HF PatchTST) would lose whole "
        "channels: reshape to [B*C, N, H] before the layers (a channel-independent encoder), or leave random-LTD out"
    )


class _ObserveHook:
    """The forward pre-hook of :func:`observe`: records the shapes of each armed training forward; ``patch`` tells
    :func:`find_patches` which :class:`PatchedLayers` it belongs to."""

    def __init__(self, controller: LTDController, seq_dim: int, hidden_name: str) -> None:
        self.controller, self.seq_dim, self.hidden_name = controller, seq_dim, hidden_name
        self.patch: PatchedLayers | None = None

    def __deepcopy__(self, memo: dict) -> _ObserveHook:
        # a deep copy of the model (e.g. FLOP counting) keeps the hook, sharing the controller, as LTDForward does
        new = copy.copy(self)
        new.patch = None
        return new

    @torch.compiler.disable  # the controller's per-step state stays out of compiled code (see LTDForward.select)
    def __call__(self, layer: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.get(self.hidden_name)
        if layer.training and isinstance(hidden, Tensor) and hidden.device.type != "meta" and self.controller.armed:
            check_hidden_layout(hidden, self.seq_dim)
            self.controller.observe(hidden.shape[1 - self.seq_dim], hidden.shape[self.seq_dim], hidden.device)


def convert(module: nn.Module, adapter: TransformerAdapter, controller: LTDController) -> PatchedLayers:
    """Patch ``controller.layer_ids`` of ``adapter.layers()`` with :class:`LTDForward` (no wrapper modules, so
    ``state_dict`` keys are unchanged). ``module`` is the object a :class:`GenericAdapter` path starts from.

    Raises:
        ValueError: the adapter rejects the model (:meth:`TransformerAdapter.check`), bad ``layer_ids`` (see
            :func:`resolve_layer_ids`), a layer whose signature has arguments the adapter does not know, or a layer
            that is already patched.
    """
    adapter.bind(module)
    adapter.check()
    layers = adapter.layers()
    ids = resolve_layer_ids(controller.layer_ids, len(layers))
    if len(layers) != controller.num_layers:
        raise ValueError(f"the controller expects {controller.num_layers} layers, the model has {len(layers)}")
    selected = [layers[i] for i in ids]
    for i, layer in zip(ids, selected):
        if isinstance(layer.__dict__.get("forward"), LTDForward):
            raise ValueError(f"layer {i} ({type(layer).__name__}) is already converted to random-LTD")
    forwards = [
        LTDForward(layer, layer.forward, controller, ordinal, i, adapter)
        for ordinal, (i, layer) in enumerate(zip(ids, selected))
    ]  # validate every layer before patching
    previous = [layer.__dict__.get("forward") for layer in selected]
    for layer, fwd in zip(selected, forwards):
        layer.forward = fwd
    adapter.on_setup()
    patched = PatchedLayers(adapter, selected, previous, controller)
    for fwd in forwards:
        fwd.patch = patched
    return patched


def observe(module: nn.Module, adapter: TransformerAdapter, controller: LTDController) -> PatchedLayers:
    """Random-LTD paused on a network without LTD layers (``controller.layer_ids`` empty: the default ids at a depth
    of <= 2 layers): nothing is patched; a forward pre-hook on the first layer records the shapes ``(B, S)`` of each
    armed training forward (:meth:`LTDController.observe`), so that the steps trained there are counted at their full
    layer-tokens and FLOPs. :func:`restore` removes the hook.

    Raises:
        ValueError: ``controller.layer_ids`` is not empty, or the network's layer count is not the controller's.
    """
    if controller.layer_ids:
        raise ValueError(f"observe: the controller has LTD layers {list(controller.layer_ids)}; use convert")
    adapter.bind(module)
    layers = adapter.layers()
    if len(layers) != controller.num_layers:
        raise ValueError(f"the controller expects {controller.num_layers} layers, the model has {len(layers)}")
    patched = PatchedLayers(adapter, [], [], controller, set_up=False)
    if len(layers):
        first = layers[0]
        seq_dim = 1 if adapter.hidden_state_order == "batch_seq" else 0
        record = _ObserveHook(controller, seq_dim, _hidden_name(inspect.signature(first.forward)))
        record.patch = patched
        patched.hooks.append(first.register_forward_pre_hook(record, with_kwargs=True))
    return patched


def restore(patched: PatchedLayers) -> None:
    """Undo :func:`convert` (the layers get back the ``forward`` they had) or :func:`observe` (its hook is removed);
    idempotent."""
    for layer, prev in zip(patched.layers, patched.previous):
        if isinstance(layer.__dict__.get("forward"), LTDForward):
            if prev is None:
                del layer.forward
            else:
                layer.forward = prev
    for hook in patched.hooks:
        hook.remove()
    if patched.set_up:
        patched.adapter.on_teardown()
        patched.set_up = False
    patched.layers, patched.previous, patched.hooks = [], [], []


def is_converted(module: nn.Module) -> bool:
    """True if any submodule of ``module`` has a random-LTD ``forward``."""
    return any(isinstance(m.__dict__.get("forward"), LTDForward) for m in module.modules())


def _observe_hooks(module: nn.Module) -> list[tuple[int, _ObserveHook]]:
    return [(key, hook) for key, hook in module._forward_pre_hooks.items() if isinstance(hook, _ObserveHook)]


def find_patches(module: nn.Module) -> list[tuple[str, PatchedLayers | None]]:
    """Every submodule of ``module`` (``module`` included, named as in ``named_modules``; ``""`` for ``module``)
    that random-LTD changed: a layer with an :class:`LTDForward` (:func:`convert`) or with the shape-recording hook
    of :func:`observe`, with the :class:`PatchedLayers` it belongs to (None when not known: a deep copy)."""
    found: list[tuple[str, PatchedLayers | None]] = []
    for name, sub in module.named_modules():
        fwd = sub.__dict__.get("forward")
        if isinstance(fwd, LTDForward):
            found.append((name, fwd.patch))
        found.extend((name, hook.patch) for _, hook in _observe_hooks(sub))
    return found


def restore_module(module: nn.Module) -> list[str]:
    """Undo every random-LTD change found in ``module`` (:func:`find_patches`), whoever made it: each
    :class:`PatchedLayers` is restored whole (:func:`restore`: every layer it patched, its hooks, the adapter's
    ``on_teardown``); a patched layer whose record is not known gets back the ``forward`` its :class:`LTDForward`
    wraps. For a module that a fit left patched without undoing it (a fit whose ``on_exception`` did not run), or one
    patched by hand with :func:`convert`. Returns the names of the submodules found (empty: nothing to undo)."""
    found = find_patches(module)
    for patch in {id(p): p for _, p in found if p is not None}.values():
        restore(patch)
    for sub in module.modules():  # what no record restored
        fwd = sub.__dict__.get("forward")
        if isinstance(fwd, LTDForward):
            original = fwd.original
            bound_to_class = getattr(original, "__self__", None) is sub and getattr(
                original, "__func__", None
            ) is getattr(type(sub), "forward", None)
            if bound_to_class:
                del sub.forward
            else:
                sub.forward = original
        for key, _ in _observe_hooks(sub):
            sub._forward_pre_hooks.pop(key, None)
            sub._forward_pre_hooks_with_kwargs.pop(key, None)
    return list(dict.fromkeys(name for name, _ in found))


def strip_random_ltd_keys(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Import a DeepSpeed-converted checkpoint: remove the ``.random_ltd_layer`` infix its wrapper modules add to
    every key of a converted layer (``h.3.random_ltd_layer.attn.c_attn.weight`` -> ``h.3.attn.c_attn.weight``)."""
    return {k.replace(".random_ltd_layer.", ".").replace("random_ltd_layer.", ""): v for k, v in state_dict.items()}
