"""random-LTD's adapter protocol: what token dropping needs to know about a transformer family.

An adapter wraps one *model root* (e.g. an HF ``GPT2Model``, a timm ``VisionTransformer``) found inside a
LightningModule, and answers: where the layer list is, how long a sequence can be, the hidden and MLP sizes, how many
prefix tokens precede the patches/tokens, and which arguments of a layer's ``forward`` carry a sequence axis (see
"Models" in ``lightning_effi/random_ltd/README.md``). Adapters are registered by family name
(:func:`register_adapter`, a view over :mod:`lightning_effi.models.registry`) and found by :func:`find_adapter`
(``"auto"``: the first registered adapter that matches a submodule, in module order).

To support another transformer, subclass :class:`TransformerAdapter`, implement :meth:`~TransformerAdapter.matches`
and :meth:`~TransformerAdapter.layers`, declare :attr:`~TransformerAdapter.layer_arguments`, and register it — or
use :class:`lightning_effi.adapters.GenericAdapter` from a config without code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from torch import nn

from lightning_effi.models import registry

HiddenStateOrder = Literal["batch_seq", "seq_batch"]


@dataclass(frozen=True)
class SeqArg:
    """A layer argument with sequence axes, gathered per sample with the layer's token indices (never sliced).

    Attributes:
        axes: the axes that index the sequence (negative allowed), e.g. ``(-2, -1)`` for a ``[B, 1, S, S]`` mask,
            ``(-1,)`` for ``position_ids [B, S]``, ``(-2,)`` for rotary ``(cos, sin)`` of shape ``[B, S, D]``.
        batch_axis: the axis that indexes samples (size ``B`` or 1).
        only_matching: gather an axis only when its size equals the sequence length (e.g. the query axis of a
            cross-attention mask whose key axis is the encoder's); otherwise every listed axis must have size S or 1.

    A tuple/list value (e.g. rotary ``(cos, sin)``) is gathered element-wise; ``None`` passes through.
    """

    axes: tuple[int, ...]
    batch_axis: int = 0
    only_matching: bool = False


#: The argument passes through unchanged (no sequence axis, or an axis that is not this sequence's).
PASS = "pass"
#: The argument must be ``None`` while tokens are dropped (e.g. a KV cache that would store r-length keys).
MUST_BE_NONE = "must_be_none"

ArgSpec = SeqArg | Literal["pass", "must_be_none"]


class TransformerAdapter:
    """Base class of model adapters. Subclasses set :attr:`name` and implement the methods marked below."""

    #: registry name (``hf_gpt2``, ...)
    name: ClassVar[str] = ""
    #: ``batch_seq`` = hidden states ``[B, S, H]`` (HF, timm); ``seq_batch`` = ``[S, B, H]`` (Megatron)
    hidden_state_order: HiddenStateOrder = "batch_seq"

    def __init__(self, root: nn.Module):
        self.root = root

    def bind(self, module: nn.Module) -> TransformerAdapter:
        """Attach the adapter to ``module`` (the LightningModule, or the model passed to ``convert``); returns
        ``self``. Registered adapters are built around their model root and need nothing; config-declared ones
        (:class:`~lightning_effi.adapters.GenericAdapter`) resolve their layer path here. Idempotent."""
        return self

    def rebind(self, module: nn.Module) -> TransformerAdapter:
        """The adapter for the network now inside ``module`` (the LightningModule), after a technique replaced the one
        this adapter was built around (the V-cycle's level changes; random-LTD calls this after each). Registered
        adapters, built around their model root, return a new adapter of their class around the first submodule of
        ``module`` that :meth:`matches` (a subclass whose constructor takes more than the root overrides this).

        Raises:
            ValueError: no submodule of ``module`` matches.
        """
        for sub in module.modules():
            if type(self).matches(sub):
                return type(self)(sub)
        raise ValueError(
            f"adapter {self.name or type(self).__name__}: no model inside {type(module).__name__} matches it any more "
            "(the network was replaced by another kind)"
        )

    @classmethod
    def matches(cls, module: nn.Module) -> bool:  # pragma: no cover - abstract
        """True if ``module`` is a model root this adapter handles."""
        raise NotImplementedError

    def layers(self) -> nn.ModuleList | nn.Sequential:  # pragma: no cover - abstract
        """The transformer layer list; layers are identified by their exact index in it."""
        raise NotImplementedError

    @property
    def layer_arguments(self) -> dict[str, ArgSpec]:
        """Every ``forward`` argument of a layer except the hidden states: how random-LTD treats it. An argument a
        layer's signature names that is missing here is rejected at setup; an undeclared tensor that arrives through
        ``**kwargs`` with an axis of the sequence's length is rejected at the call."""
        return {}

    def max_sequence_length(self) -> int:  # pragma: no cover - abstract
        """Longest sequence the model takes (tokens, prefix tokens included)."""
        raise NotImplementedError

    def num_prefix_tokens(self) -> int:
        """Tokens before the content tokens (class/distillation/register tokens); 0 for language models."""
        return 0

    def hidden_size(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def intermediate_size(self) -> int:
        """MLP width (default 4H)."""
        return 4 * self.hidden_size()

    def check(self) -> None:
        """Raise ``ValueError`` for a configuration random-LTD does not support (e.g. an attention implementation)."""

    def on_setup(self) -> None:
        """Prepare the model for token dropping (e.g. switch a KV cache off); undone by :meth:`on_teardown`."""

    def on_teardown(self) -> None:
        """Undo :meth:`on_setup`."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.root).__name__})"


def register_adapter(name: str, factory: Callable[..., TransformerAdapter] | None = None) -> Any:
    """Register a random-LTD adapter class (or factory) for the model family ``name``; usable as a decorator.

    Raises:
        ValueError: ``name`` is already registered to another class.
    """

    def deco(f: Callable[..., TransformerAdapter]) -> Callable[..., TransformerAdapter]:
        registry.register("random_ltd", name, f, what="adapter")
        return f

    return deco(factory) if factory is not None else deco


def registered_adapters() -> list[str]:
    """The family names with a random-LTD adapter, sorted."""
    return registry.names("random_ltd")


def find_adapter(
    module: nn.Module, adapter: str | TransformerAdapter = "auto", candidates: Iterable[str] | None = None
) -> TransformerAdapter:
    """The adapter for the first matching model root inside ``module`` (``module`` itself included).

    Args:
        module: usually the LightningModule. adapter: ``"auto"``, a registered name, or an adapter instance
            (returned bound to ``module``). candidates: names tried by ``"auto"`` (default: all registered).

    Raises:
        ValueError: unknown adapter name, or no submodule matches (the message lists the registered adapters).
    """
    if isinstance(adapter, TransformerAdapter):
        return adapter.bind(module)
    if not isinstance(adapter, str):
        raise ValueError(f"adapter must be 'auto', a registered name or a TransformerAdapter, got {adapter!r}")
    known: dict[str, Callable[..., TransformerAdapter]] = registry.adapters("random_ltd")
    if adapter != "auto":
        registry.lookup("random_ltd", adapter, "adapter", hint="(or pass a lightning_effi.models.GenericAdapter)")
    names = [adapter] if adapter != "auto" else list(candidates or known)
    for sub in module.modules():
        for name in names:
            cls = known[name]
            matches = getattr(cls, "matches", None)
            if matches is not None and matches(sub):
                return cls(sub)
    raise ValueError(
        f"adapter: no model inside {type(module).__name__} matches "
        f"{'any registered adapter' if adapter == 'auto' else repr(adapter)} "
        f"({', '.join(registered_adapters())}); register one with lightning_effi.models.register_adapter or pass "
        "a lightning_effi.models.GenericAdapter(layers=..., ...)"
    )
