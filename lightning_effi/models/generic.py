"""Adapters declared without code: :class:`GenericAdapter` (any transformer whose layers live in one
``ModuleList``/``Sequential``, from a config) and :class:`TorchTransformerAdapter` (PyTorch's own
``nn.TransformerEncoder`` / ``nn.TransformerDecoder``, registered as ``torch_transformer`` so that ``adapter="auto"``
finds them).

PyTorch's ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` are known out of the box (their masks are
gathered by the layouts ``nn.MultiheadAttention`` takes, :class:`~lightning_effi.models.base.AttentionMask`; the
hidden-state order comes from ``batch_first``; the widths from ``self_attn`` and ``linear1``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn

from lightning_effi.core.checks import check_int, is_int, plain
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
    """``value`` as a Python int >= 1 (Python or numpy integer; ``None`` when ``optional``)."""
    if value is None and optional:
        return None
    if not is_int(value) or value < 1:
        raise ValueError(f"GenericAdapter.{key} must be an int >= 1{' or None' if optional else ''}, got {value!r}")
    return int(value)


def _names(key: str, value: Any) -> list[str]:
    """``passthrough`` / ``must_be_none``: a list or tuple (an OmegaConf ``ListConfig`` too) of argument names. A bare
    string is refused (it would be read as its characters), and so is any other single value."""
    value = plain(value)
    if isinstance(value, (set, frozenset)):
        value = sorted(value, key=str)
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(
            f"GenericAdapter.{key} must be a list of argument names (strings), e.g. [{value!r}] for one, got {value!r}"
            if isinstance(value, str)
            else f"GenericAdapter.{key} must be a list of argument names (strings), got {value!r}"
        )
    return list(value)


def _mapping(key: str, value: Any, what: str) -> dict[str, Any]:
    """``seq_args`` / ``masks``: a mapping (an OmegaConf ``DictConfig`` too) of argument name -> ``what``."""
    value = plain(value)
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and k for k in value):
        raise ValueError(f"GenericAdapter.{key} must be a mapping of argument name -> {what}, got {value!r}")
    return dict(value)


def _axes(name: str, axes: Any) -> tuple[int, ...]:
    """The sequence axes of ``seq_args[name]``: an int or a list of ints (Python or numpy)."""
    listed = [axes] if is_int(axes) else axes
    if not isinstance(listed, list) or not all(is_int(a) for a in listed):
        raise ValueError(
            f"GenericAdapter.seq_args[{name!r}] must be an int axis or a list of int axes (negative allowed, e.g. "
            f"[-2, -1] for a [B, 1, S, S] mask), got {axes!r}"
        )
    if not listed:
        raise ValueError(f"GenericAdapter.seq_args[{name!r}]: give at least one sequence axis, got {axes!r}")
    return tuple(int(a) for a in listed)


def _attention_of(layer: nn.Module) -> nn.MultiheadAttention | None:
    """The first ``nn.MultiheadAttention`` inside ``layer`` (``None`` if it has none)."""
    return next((m for m in layer.modules() if isinstance(m, nn.MultiheadAttention)), None)


def _mlp_width(layer: nn.Module, hidden: int) -> int | None:
    """The MLP width of a transformer layer of width ``hidden``, as the FLOPs formula's ``I`` (two ``H x I``
    matrices): the ``in_features`` of its ``nn.Linear`` layers that project back to ``hidden`` from another width
    (the MLP's down-projection ``I -> H``; attention's output projection is ``H -> H``), when they all agree; a gated
    MLP (SwiGLU / GeGLU: two ``H -> I`` projections, gate and up, beside the down one) has three such matrices and
    counts as ``3 I / 2``. None when there is no such projection, or they disagree."""
    linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
    widths = {int(m.in_features) for m in linears if int(m.out_features) == hidden and int(m.in_features) != hidden}
    if len(widths) != 1:
        return None
    width = widths.pop()
    ups = sum(int(m.in_features) == hidden and int(m.out_features) == width for m in linears)
    return width * 3 // 2 if ups == 2 else width


class GenericAdapter(TransformerAdapter):
    """Adapter declared from a config (no code). Pass an instance as ``RandomLTDCallback(adapter=...)``.

    Args:
        layers: dotted path from the LightningModule (or from ``RandomLTDCallback(model_attr=...)``) to the layer
            list, e.g. ``"model.encoder.layers"``.
        max_sequence_length: longest sequence the model takes (tokens), or ``None`` (default: unknown; random-LTD
            reads the length from the sequences its layers see).
        hidden_size: ``H``, for the FLOPs figures; default: the ``embed_dim`` of the layers' ``nn.MultiheadAttention``
            (an error at bind time when they have none). intermediate_size: MLP width; default ``linear1``'s width
            for PyTorch's layers, else the input width of the layer's ``nn.Linear(I, H)`` (its MLP's
            down-projection; ``3I/2`` for a gated MLP with two ``nn.Linear(H, I)``: three matrices), else ``4H`` with
            a warning.
        seq_args: ``{argument name: axes}`` for arguments with sequence axes (HF-style ``[B, 1, S, S]`` masks
            ``[-2, -1]``, positions ``[-1]``, rotary ``(cos, sin)`` ``[-2]``), batch axis 0.
        passthrough: argument names passed unchanged. must_be_none: arguments that must be ``None`` (caches).
        hidden_state_order: ``batch_seq`` (``[B, S, H]``), ``seq_batch`` (``[S, B, H]``; DeepSpeed's spellings
            ``batch_seq_dim`` / ``seq_batch_dim`` are taken for them) or ``None`` (default: from
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

    Integers may be Python or numpy ints; ``seq_args`` / ``masks`` are mappings (an OmegaConf ``DictConfig`` too),
    ``passthrough`` / ``must_be_none`` lists of names (a ``ListConfig`` too; a bare string is refused, not split into
    its characters).

    Raises:
        ValueError: bad values, naming the parameter and what is allowed (an int below its minimum or not an int;
            ``seq_args`` not a mapping of name -> int axis or list of int axes; ``masks`` not a mapping of name ->
            kind; ``passthrough`` / ``must_be_none`` not a list of strings; one argument named in two of
            ``seq_args``, ``masks``, ``passthrough`` and ``must_be_none``; ``root`` not an ``nn.Module``); at bind
            time (``RandomLTDCallback.setup``): ``layers`` not found / not a ``ModuleList``/``Sequential``,
            ``hidden_state_order`` contradicting the layers' ``batch_first`` (or layers that disagree), no
            ``hidden_size`` and no ``nn.MultiheadAttention`` to read it from, a declared ``hidden_size`` the layers
            contradict (their ``nn.MultiheadAttention``'s ``embed_dim``; without one, a width no normalisation or
            linear layer of the first layer has), a declared ``intermediate_size`` other than PyTorch's layers'
            ``linear1`` width (or the layer's ``nn.Linear(I, H)`` width). ``RandomLTDCallback`` refuses a
            ``max_sequence_length`` below its ``max_value`` or the data's length, and ``num_prefix_tokens`` above
            its ``min_value``, naming them.
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
        if root is not None and not isinstance(root, nn.Module):
            raise ValueError(
                f"{type(self).__name__}.root must be the nn.Module that layers starts from (or None: bound to the "
                f"LightningModule at setup), got {type(root).__name__} {root!r}"
            )
        self._max = _positive_int("max_sequence_length", max_sequence_length)
        self._hidden_arg = _positive_int("hidden_size", hidden_size)
        self._inter_arg = _positive_int("intermediate_size", intermediate_size)
        # DeepSpeed's spellings (data_routing.random_ltd.hidden_state_order) name the same layouts
        hidden_state_order = {"batch_seq_dim": "batch_seq", "seq_batch_dim": "seq_batch"}.get(  # type: ignore[assignment]
            hidden_state_order,
            hidden_state_order,  # type: ignore[arg-type]
        )
        if hidden_state_order not in (None, "batch_seq", "seq_batch"):
            raise ValueError(
                "GenericAdapter.hidden_state_order must be 'batch_seq', 'seq_batch' or None (from the layers), got "
                f"{hidden_state_order!r}"
            )
        self.path = layers
        self._prefix = check_int("GenericAdapter", "num_prefix_tokens", num_prefix_tokens, minimum=0)
        self._order_arg: HiddenStateOrder | None = hidden_state_order
        self.hidden_state_order = hidden_state_order or "batch_seq"
        args: dict[str, ArgSpec] = {}
        declared_in: dict[str, str] = {}

        def declare(parameter: str, name: str, handling: ArgSpec) -> None:
            # one argument, one handling: the later declaration overwrote the earlier one (qa102-nlp 03)
            if declared_in.get(name, parameter) != parameter:  # a repeat within one list is one declaration
                raise ValueError(
                    f"GenericAdapter: the layer argument {name!r} is declared in both {declared_in[name]} and "
                    f"{parameter}; declare each argument once (seq_args: gathered along its sequence axes, masks: an "
                    "attention mask gathered to the kept tokens, passthrough: passed unchanged, must_be_none: refused "
                    "unless None)"
                )
            declared_in[name] = parameter
            args[name] = handling

        for name, axes in _mapping("seq_args", seq_args, "sequence axes (an int or a list of ints)").items():
            declare("seq_args", name, SeqArg(_axes(name, axes)))
        for name, kind in _mapping("masks", masks, f"mask kind (one of {_MASK_KINDS})").items():
            if kind not in _MASK_KINDS:
                raise ValueError(f"GenericAdapter.masks[{name!r}] must be one of {_MASK_KINDS}, got {kind!r}")
            declare("masks", name, AttentionMask(kind))
        for name in _names("passthrough", passthrough):
            declare("passthrough", name, PASS)
        for name in _names("must_be_none", must_be_none):
            declare("must_be_none", name, MUST_BE_NONE)
        self._declared = args
        self._args = dict(args)
        self._hidden = self._hidden_arg
        self._inter = self._inter_arg
        self._layers: nn.ModuleList | nn.Sequential | None = None
        super().__init__(root if root is not None else nn.Module())
        self._bound = False
        self._rebinding = False  # rebind(): the declared widths are not compared with a (narrower) level's layers
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
        self._read_layers(target, check=not self._rebinding)
        self.root, self._layers, self._bound = module, target, True
        return self

    def _read_layers(self, layers: nn.ModuleList | nn.Sequential, check: bool = True) -> None:
        """Argument handling, hidden-state order and widths from the layers (PyTorch's layers declare them);
        ``check``: the declared widths are compared with the layers' (not after :meth:`rebind`: a V-cycle level is
        narrower, and the declared sizes stay as given)."""
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
        elif check and len(layers):
            self._check_hidden_size(layers[0], attention)
        read_before = self._inter if self._inter_arg is None else None
        self._inter = self._inter_arg
        if not check and self._hidden_arg is not None and read_before is not None:
            # a rebind (a narrower V-cycle level) with hidden_size declared: the declared width stays, and so does the
            # MLP width read with it (the narrow layers' widths do not fit the declared hidden_size)
            self._inter = read_before
        elif len(layers) and isinstance(layers[0], TORCH_LAYERS):
            width = int(layers[0].linear1.out_features)
            if self._inter is None:
                self._inter = width
            elif check and self._inter != width:
                raise ValueError(
                    f"GenericAdapter.intermediate_size={self._inter}, but the layers of {self.path!r} are "
                    f"{type(layers[0]).__name__} with an MLP of width {width} (linear1.out_features); pass "
                    f"intermediate_size={width} or leave it None (read from the layers)"
                )
        elif len(layers):
            width = _mlp_width(layers[0], self._hidden)
            if self._inter is None and width is not None:
                self._inter = width
            elif self._inter is None:
                warnings.warn(
                    f"GenericAdapter.intermediate_size: not given, and the layers of {self.path!r} "
                    f"({type(layers[0]).__name__}) have no single nn.Linear projecting a wider (or narrower) MLP back "
                    f"to the width {self._hidden}: the FLOPs figures take the MLP as 4H = {4 * self._hidden} wide; "
                    "pass intermediate_size (the MLP's width) to count it",
                    UserWarning,
                    stacklevel=2,
                )
            elif check and width is not None and self._inter != width and self._inter * 3 // 2 != width:
                raise ValueError(
                    f"GenericAdapter.intermediate_size={self._inter}, but the layers of {self.path!r} project an MLP "
                    f"of width {width} back to {self._hidden} (an nn.Linear({width}, {self._hidden})); pass "
                    f"intermediate_size={width} or leave it None (read from the layers)"
                )

    def _check_hidden_size(self, layer: nn.Module, attention: nn.MultiheadAttention | None) -> None:
        """A declared ``hidden_size`` against what the first layer's modules say about its width: the
        ``embed_dim`` of its ``nn.MultiheadAttention``; else its normalisation layers (``normalized_shape``: a
        layer of width ``H`` normalises ``H``-wide vectors, pre- or post-norm), or without any its linear layers
        (``in_features``: one of them projects the ``H``-wide input), so a declared width that none of them has is
        wrong. A layer with neither says nothing (no check).

        Raises:
            ValueError: naming ``hidden_size``, the declared value and the width found.
        """
        declared = self._hidden_arg
        if attention is not None:
            if int(attention.embed_dim) != declared:
                raise ValueError(
                    f"GenericAdapter.hidden_size={declared}, but the layers of {self.path!r} are "
                    f"{int(attention.embed_dim)} wide (their nn.MultiheadAttention's embed_dim); pass "
                    f"hidden_size={int(attention.embed_dim)} or leave it None (read from the layers)"
                )
            return
        norms: set[int] = set()
        for m in layer.modules():
            shape: Any = getattr(m, "normalized_shape", None)
            if isinstance(shape, (tuple, list)) and shape:
                shape = shape[-1]
            if is_int(shape):
                norms.add(int(shape))
        inputs = {int(m.in_features) for m in layer.modules() if isinstance(m, nn.Linear)}
        widths, what = (norms, "normalisation layers normalise") if norms else (inputs, "linear layers take")
        if widths and declared not in widths:
            raise ValueError(
                f"GenericAdapter.hidden_size={declared}, but no module of the first layer of {self.path!r} "
                f"({type(layer).__name__}) is that wide: its {what} {sorted(widths)} features; pass the width of the "
                "hidden states (H of [B, S, H])"
            )

    def on_setup(self) -> None:
        """A Hugging Face model on the path to ``layers`` whose ``config.use_cache`` is on builds a KV cache in every
        training forward, which a layer dropping tokens refuses at the first step (``must_be_none``): switched off
        for the fit, announced once, and restored by :meth:`on_teardown`, as the ``hf_gpt2`` adapter does (a Llama
        built from its default config passed setup and failed at the first step, qa93-user 01)."""
        self._caches: list[Any] = []
        target: Any = self.root
        for part in ["", *self.path.split(".")[:-1]]:
            target = getattr(target, part, None) if part else target
            config = getattr(target, "config", None)
            if getattr(config, "use_cache", None) is True and all(c is not config for c in self._caches):
                self._caches.append(config)
                config.use_cache = False
        if self._caches and not getattr(self, "_cache_told", False):
            from lightning.pytorch.utilities import rank_zero_info

            self._cache_told = True
            rank_zero_info(
                f"GenericAdapter: the KV cache of {type(self.root).__name__}'s model is switched off for the fit "
                "(config.use_cache = False, restored at its end): random-LTD's layers see fewer tokens than a cache "
                "would hold"
            )

    def on_teardown(self) -> None:
        """Undo :meth:`on_setup`: the ``use_cache`` it switched off is on again."""
        for config in getattr(self, "_caches", []):
            config.use_cache = True
        self._caches = []

    def rebind(self, module: nn.Module) -> GenericAdapter:
        """Resolve :attr:`path` from ``module`` again (the network behind it was replaced, e.g. by the V-cycle);
        returns ``self``. Declared sizes (``hidden_size``, ``intermediate_size``, ``max_sequence_length``) stay as
        given: random-LTD's FLOPs figures at a narrower level use them (its layer-token counts do not); sizes read from
        the layers are read again, but for the MLP width read beside a declared ``hidden_size``, which stays too.

        Raises:
            ValueError: ``layers`` not found / not a ``ModuleList``/``Sequential`` in ``module``.
        """
        self._bound, self._rebinding = False, True
        try:
            return self.bind(module)
        finally:
            self._rebinding = False

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
    expects = (
        "a PyTorch nn.TransformerEncoder / nn.TransformerDecoder (layers .layers of nn.TransformerEncoderLayer / "
        "nn.TransformerDecoderLayer)"
    )

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
