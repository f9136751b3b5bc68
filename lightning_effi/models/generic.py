"""Adapters declared without code: :class:`GenericAdapter` (any transformer whose layers live in one
``ModuleList``/``Sequential``, from a config) and :class:`TorchTransformerAdapter` (PyTorch's own
``nn.TransformerEncoder`` / ``nn.TransformerDecoder``, registered as ``torch_transformer`` so that ``adapter="auto"``
finds them).

PyTorch's ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` are known out of the box (their masks are
gathered by the layouts ``nn.MultiheadAttention`` takes, :class:`~lightning_effi.models.base.AttentionMask`; the
hidden-state order comes from ``batch_first``; the widths from ``self_attn`` and ``linear1``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn

from lightning_effi.models.base import (
    MUST_BE_NONE,
    PASS,
    ArgSpec,
    AttentionMask,
    HiddenStateOrder,
    SeqArg,
    TransformerAdapter,
    register_adapter,
)

__all__ = ["TORCH_LAYER_ARGUMENTS", "TORCH_LAYERS", "GenericAdapter", "TorchTransformerAdapter"]

#: PyTorch's transformer layers, whose arguments :data:`TORCH_LAYER_ARGUMENTS` declares
TORCH_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)

#: How random-LTD treats the arguments of ``nn.TransformerEncoderLayer.forward(src, src_mask, src_key_padding_mask,
#: is_causal)`` and ``nn.TransformerDecoderLayer.forward(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
#: memory_key_padding_mask, tgt_is_causal, memory_is_causal)``: the self-attention masks on both axes, the memory mask
#: on its query axis, the key-padding mask of the sequence on its key axis; the memory, its padding mask and the
#: causal flags pass (the kept tokens are sorted, so a gathered causal mask is still causal).
TORCH_LAYER_ARGUMENTS: dict[str, ArgSpec] = {
    "src_mask": AttentionMask("self"),
    "src_key_padding_mask": AttentionMask("key_padding"),
    "is_causal": PASS,
    "memory": PASS,
    "tgt_mask": AttentionMask("self"),
    "memory_mask": AttentionMask("cross"),
    "tgt_key_padding_mask": AttentionMask("key_padding"),
    "memory_key_padding_mask": PASS,
    "tgt_is_causal": PASS,
    "memory_is_causal": PASS,
}

_MASK_KINDS = ("self", "cross", "key_padding")


def _positive_int(key: str, value: Any, optional: bool = True) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GenericAdapter.{key} must be an int >= 1{' or None' if optional else ''}, got {value!r}")
    return int(value)


def _attention_of(layer: nn.Module) -> nn.MultiheadAttention | None:
    """The first ``nn.MultiheadAttention`` inside ``layer`` (``None`` if it has none)."""
    return next((m for m in layer.modules() if isinstance(m, nn.MultiheadAttention)), None)


class GenericAdapter(TransformerAdapter):
    """Adapter declared from a config (no code). Pass an instance as ``RandomLTDCallback(adapter=...)``.

    Args:
        layers: dotted path from the LightningModule (or from ``RandomLTDCallback(model_attr=...)``) to the layer
            list, e.g. ``"model.encoder.layers"``.
        max_sequence_length: longest sequence the model takes (tokens), or ``None`` (default: unknown; random-LTD
            reads the length from the sequences its layers see).
        hidden_size: ``H``, for the FLOPs figures; default: the ``embed_dim`` of the layers' ``nn.MultiheadAttention``
            (an error at bind time when they have none). intermediate_size: MLP width; default ``linear1``'s width
            for PyTorch's layers, else ``4H``.
        seq_args: ``{argument name: axes}`` for arguments with sequence axes (HF-style ``[B, 1, S, S]`` masks
            ``[-2, -1]``, positions ``[-1]``, rotary ``(cos, sin)`` ``[-2]``), batch axis 0.
        passthrough: argument names passed unchanged. must_be_none: arguments that must be ``None`` (caches).
        hidden_state_order: ``batch_seq`` (``[B, S, H]``), ``seq_batch`` (``[S, B, H]``) or ``None`` (default: from
            ``batch_first`` for PyTorch's layers, else ``batch_seq``).
        num_prefix_tokens: tokens before the content, always kept with ``keep_prefix_tokens="auto"`` (the default).
        root: the module ``layers`` starts from, when known now (else :meth:`bind` resolves it).
        masks: ``{argument name: kind}`` for PyTorch-style attention masks gathered by their layout
            (:class:`~lightning_effi.models.base.AttentionMask`): ``"self"`` (``[S, S]``, ``[B*num_heads, S, S]``,
            ``[B|1, S, S]``, ``[B|1, 1|H, S, S]``), ``"cross"`` (query axis only) or ``"key_padding"`` (``[B, S]``).

    ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` need none of the argument declarations
    (:data:`TORCH_LAYER_ARGUMENTS`; yours override them).

    Example (Hydra)::

        adapter:
          _target_: lightning_effi.adapters.GenericAdapter
          layers: model.blocks
          hidden_size: 128
          masks: {attn_mask: self, padding_mask: key_padding}

    Raises:
        ValueError: bad values (named); at bind time: ``layers`` not found / not a ``ModuleList``/``Sequential``,
            ``hidden_state_order`` contradicting the layers' ``batch_first`` (or layers that disagree), no
            ``hidden_size`` and no ``nn.MultiheadAttention`` to read it from.
    """

    name = "generic"

    def __init__(
        self,
        layers: str,
        max_sequence_length: int | None = None,
        hidden_size: int | None = None,
        intermediate_size: int | None = None,
        seq_args: Mapping[str, Sequence[int]] | None = None,
        passthrough: Iterable[str] = (),
        must_be_none: Iterable[str] = (),
        hidden_state_order: HiddenStateOrder | None = None,
        num_prefix_tokens: int = 0,
        root: nn.Module | None = None,
        masks: Mapping[str, str] | None = None,
    ):
        if not isinstance(layers, str) or not layers:
            raise ValueError(f"GenericAdapter.layers must be a dotted attribute path, got {layers!r}")
        self._max = _positive_int("max_sequence_length", max_sequence_length)
        self._hidden_arg = _positive_int("hidden_size", hidden_size)
        self._inter_arg = _positive_int("intermediate_size", intermediate_size)
        if hidden_state_order not in (None, "batch_seq", "seq_batch"):
            raise ValueError(
                "GenericAdapter.hidden_state_order must be 'batch_seq', 'seq_batch' or None (from the layers), got "
                f"{hidden_state_order!r}"
            )
        if isinstance(num_prefix_tokens, bool) or not isinstance(num_prefix_tokens, int) or num_prefix_tokens < 0:
            raise ValueError(f"GenericAdapter.num_prefix_tokens must be an int >= 0, got {num_prefix_tokens!r}")
        self.path = layers
        self._prefix = int(num_prefix_tokens)
        self._order_arg: HiddenStateOrder | None = hidden_state_order
        self.hidden_state_order = hidden_state_order or "batch_seq"
        args: dict[str, ArgSpec] = {}
        for name, axes in (seq_args or {}).items():
            axes = tuple(int(a) for a in (axes if isinstance(axes, Sequence) else [axes]))
            if not axes:
                raise ValueError(f"GenericAdapter.seq_args[{name!r}]: give at least one sequence axis")
            args[str(name)] = SeqArg(axes)
        for name, kind in (masks or {}).items():
            if kind not in _MASK_KINDS:
                raise ValueError(f"GenericAdapter.masks[{name!r}] must be one of {_MASK_KINDS}, got {kind!r}")
            args[str(name)] = AttentionMask(kind)  # type: ignore[arg-type]
        for name in passthrough:
            args[str(name)] = PASS
        for name in must_be_none:
            args[str(name)] = MUST_BE_NONE
        self._declared = args
        self._args = dict(args)
        self._hidden = self._hidden_arg
        self._inter = self._inter_arg
        self._layers: nn.ModuleList | nn.Sequential | None = None
        super().__init__(root if root is not None else nn.Module())
        self._bound = False
        if root is not None:
            self.bind(root)

    def bind(self, module: nn.Module) -> GenericAdapter:
        """Resolve :attr:`path` from ``module`` (the LightningModule) and read what PyTorch's layers declare (argument
        handling, ``batch_first``, widths). Returns ``self``; binding the same module again is a no-op.

        Raises:
            ValueError: see the class docstring.
        """
        if self._bound and self.root is module:
            return self
        target: Any = module
        for part in self.path.split("."):
            if not hasattr(target, part):
                raise ValueError(
                    f"GenericAdapter.layers: {type(target).__name__} has no attribute {part!r} (path {self.path!r})"
                )
            target = getattr(target, part)
        if not isinstance(target, (nn.ModuleList, nn.Sequential)):
            raise ValueError(
                f"GenericAdapter.layers: {self.path!r} is a {type(target).__name__}, expected a "
                "ModuleList or Sequential of layers"
            )
        self._read_layers(target)
        self.root, self._layers, self._bound = module, target, True
        return self

    def _read_layers(self, layers: nn.ModuleList | nn.Sequential) -> None:
        """Argument handling, hidden-state order and widths from the layers (PyTorch's layers declare them)."""
        torch_layers = [layer for layer in layers if isinstance(layer, TORCH_LAYERS)]
        self._args = {**TORCH_LAYER_ARGUMENTS, **self._declared} if torch_layers else dict(self._declared)
        order = self._order_arg or "batch_seq"
        if torch_layers:
            firsts = {bool(layer.self_attn.batch_first) for layer in torch_layers}
            if len(firsts) > 1:
                raise ValueError(f"GenericAdapter.layers {self.path!r}: the layers disagree on batch_first")
            found: HiddenStateOrder = "batch_seq" if firsts.pop() else "seq_batch"
            if self._order_arg is not None and self._order_arg != found:
                raise ValueError(
                    f"GenericAdapter.hidden_state_order={self._order_arg!r}, but the layers of {self.path!r} are "
                    f"{type(torch_layers[0]).__name__}(batch_first={found == 'batch_seq'}), i.e. {found!r}; leave "
                    "hidden_state_order=None"
                )
            order = found
        self.hidden_state_order = order
        attention = _attention_of(layers[0]) if len(layers) else None
        self._hidden = self._hidden_arg
        if self._hidden is None:
            if attention is None:
                kind = type(layers[0]).__name__ if len(layers) else "no layers"
                raise ValueError(
                    f"GenericAdapter.hidden_size: the layers of {self.path!r} ({kind}) hold no nn.MultiheadAttention "
                    "to read the width from; pass hidden_size (H, for the FLOPs figures)"
                )
            self._hidden = int(attention.embed_dim)
        self._inter = self._inter_arg
        if self._inter is None and len(layers) and isinstance(layers[0], TORCH_LAYERS):
            self._inter = int(layers[0].linear1.out_features)

    def rebind(self, module: nn.Module) -> GenericAdapter:
        """Resolve :attr:`path` from ``module`` again (the network behind it was replaced, e.g. by the V-cycle);
        returns ``self``. Declared sizes (``hidden_size``, ``intermediate_size``, ``max_sequence_length``) stay as
        given: random-LTD's FLOPs figures at a narrower level use them (its layer-token counts do not); sizes read from
        the layers are read again.

        Raises:
            ValueError: ``layers`` not found / not a ``ModuleList``/``Sequential`` in ``module``.
        """
        self._bound = False
        return self.bind(module)

    def layers(self) -> nn.ModuleList | nn.Sequential:
        if not self._bound or self._layers is None:
            raise RuntimeError("GenericAdapter is not bound to a model yet (call bind(module))")
        return self._layers

    @property
    def layer_arguments(self) -> dict[str, ArgSpec]:
        return dict(self._args)

    def max_sequence_length(self) -> int | None:
        return self._max

    def num_prefix_tokens(self) -> int:
        return self._prefix

    def hidden_size(self) -> int:
        if self._hidden is None:
            raise RuntimeError("GenericAdapter.hidden_size: not given and not read yet (bind the adapter first)")
        return self._hidden

    def intermediate_size(self) -> int:
        return self._inter if self._inter is not None else 4 * self.hidden_size()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layers={self.path!r})"


@register_adapter("torch_transformer")
class TorchTransformerAdapter(GenericAdapter):
    """PyTorch's ``nn.TransformerEncoder`` / ``nn.TransformerDecoder`` (layers ``layers``, of
    ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``), found by ``adapter="auto"`` anywhere inside the
    module. Masks (``mask`` / ``src_key_padding_mask``; ``tgt_mask``, ``memory_mask``, ``tgt_key_padding_mask``) are
    gathered by their ``nn.MultiheadAttention`` layouts, ``is_causal`` passes, ``batch_first`` sets the hidden-state
    order (:data:`TORCH_LAYER_ARGUMENTS`). A ``nn.Transformer`` holds both an encoder and a decoder: name one with
    ``RandomLTDCallback(model_attr=...)``."""

    name = "torch_transformer"

    def __init__(self, root: nn.Module):
        super().__init__("layers", root=root)

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        layers = getattr(module, "layers", None)
        return (
            isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder))
            and isinstance(layers, nn.ModuleList)
            and len(layers) > 0
            and all(isinstance(layer, TORCH_LAYERS) for layer in layers)
        )

    def bind(self, module: nn.Module) -> TorchTransformerAdapter:
        """Built around its ``nn.TransformerEncoder`` / ``nn.TransformerDecoder``: binding to the LightningModule
        changes nothing."""
        if not self._bound:
            super().bind(self.root)
        return self

    def rebind(self, module: nn.Module) -> GenericAdapter:
        """A new adapter around the first ``nn.TransformerEncoder`` / ``nn.TransformerDecoder`` inside ``module``
        (:meth:`TransformerAdapter.rebind <lightning_effi.models.base.TransformerAdapter.rebind>`)."""
        adapter = TransformerAdapter.rebind(self, module)
        assert isinstance(adapter, GenericAdapter)
        return adapter

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.root).__name__})"
