"""A configurable adapter for any transformer whose layers live in one ``ModuleList``/``Sequential``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn

from lightning_effi.models.base import MUST_BE_NONE, PASS, ArgSpec, HiddenStateOrder, SeqArg, TransformerAdapter


class GenericAdapter(TransformerAdapter):
    """Adapter declared from a config (no code). Pass an instance as ``RandomLTDCallback(adapter=...)``.

    Args:
        layers: dotted path from the LightningModule to the layer list, e.g. ``"model.encoder.layers"``.
        max_sequence_length: longest sequence (tokens); hidden_size: H; intermediate_size: MLP width (default 4H).
        seq_args: ``{argument name: axes}`` for arguments with sequence axes (masks ``[-2, -1]``, positions
            ``[-1]``, rotary ``(cos, sin)`` ``[-2]``), batch axis 0.
        passthrough: argument names passed unchanged. must_be_none: arguments that must be ``None`` (caches).
        hidden_state_order: ``batch_seq`` (``[B, S, H]``) or ``seq_batch`` (``[S, B, H]``).
        num_prefix_tokens: tokens before the content (used by ``keep_prefix_tokens="auto"``).

    Example (Hydra)::

        adapter:
          _target_: lightning_effi.adapters.GenericAdapter
          layers: model.blocks
          max_sequence_length: 256
          hidden_size: 128
          seq_args: {attention_mask: [-2, -1]}

    Raises:
        ValueError: bad values (named), or ``layers`` not found / not a ``ModuleList``/``Sequential`` (at bind time).
    """

    name = "generic"

    def __init__(
        self,
        layers: str,
        max_sequence_length: int,
        hidden_size: int,
        intermediate_size: int | None = None,
        seq_args: Mapping[str, Sequence[int]] | None = None,
        passthrough: Iterable[str] = (),
        must_be_none: Iterable[str] = (),
        hidden_state_order: HiddenStateOrder = "batch_seq",
        num_prefix_tokens: int = 0,
        root: nn.Module | None = None,
    ):
        if not isinstance(layers, str) or not layers:
            raise ValueError(f"GenericAdapter.layers must be a dotted attribute path, got {layers!r}")
        for key, v in (("max_sequence_length", max_sequence_length), ("hidden_size", hidden_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"GenericAdapter.{key} must be an int >= 1, got {v!r}")
        if hidden_state_order not in ("batch_seq", "seq_batch"):
            raise ValueError(
                f"GenericAdapter.hidden_state_order must be 'batch_seq' or 'seq_batch', got {hidden_state_order!r}"
            )
        self.path = layers
        self._max = max_sequence_length
        self._hidden = hidden_size
        self._inter = intermediate_size
        self._prefix = int(num_prefix_tokens)
        self.hidden_state_order = hidden_state_order
        args: dict[str, ArgSpec] = {}
        for name, axes in (seq_args or {}).items():
            axes = tuple(int(a) for a in (axes if isinstance(axes, Sequence) else [axes]))
            if not axes:
                raise ValueError(f"GenericAdapter.seq_args[{name!r}]: give at least one sequence axis")
            args[str(name)] = SeqArg(axes)
        for name in passthrough:
            args[str(name)] = PASS
        for name in must_be_none:
            args[str(name)] = MUST_BE_NONE
        self._args = args
        super().__init__(root if root is not None else nn.Module())
        self._bound = root is not None

    def bind(self, module: nn.Module) -> GenericAdapter:
        """Resolve :attr:`path` from ``module`` (the LightningModule). Returns ``self``; binding the same module
        again is a no-op."""
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
        self.root, self._layers, self._bound = module, target, True
        return self

    def rebind(self, module: nn.Module) -> GenericAdapter:
        """Resolve :attr:`path` from ``module`` again (the network behind it was replaced, e.g. by the V-cycle);
        returns ``self``. The declared sizes (``hidden_size``, ``intermediate_size``, ``max_sequence_length``) stay
        as given: random-LTD's FLOPs figures at a narrower level use them (its layer-token counts do not).

        Raises:
            ValueError: ``layers`` not found / not a ``ModuleList``/``Sequential`` in ``module``.
        """
        self._bound = False
        return self.bind(module)

    def layers(self) -> nn.ModuleList | nn.Sequential:
        if not self._bound:
            raise RuntimeError("GenericAdapter is not bound to a model yet (call bind(module))")
        return self._layers

    @property
    def layer_arguments(self) -> dict[str, ArgSpec]:
        return dict(self._args)

    def max_sequence_length(self) -> int:
        return self._max

    def num_prefix_tokens(self) -> int:
        return self._prefix

    def hidden_size(self) -> int:
        return self._hidden

    def intermediate_size(self) -> int:
        return self._inter if self._inter is not None else 4 * self._hidden
