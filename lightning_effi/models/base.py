"""random-LTD's adapter protocol: what token dropping needs to know about a transformer family.

An adapter wraps one *model root* (e.g. an HF ``GPT2Model``, a timm ``VisionTransformer``) found inside a
LightningModule, and answers: where the layer list is, how long a sequence can be, the hidden and MLP sizes, how many
prefix tokens precede the patches/tokens, and which arguments of a layer's ``forward`` carry a sequence axis (see
"Models" in ``lightning_effi/random_ltd/README.md``). Adapters are registered by family name
(:func:`register_adapter`, a view over :mod:`lightning_effi.models.registry`) and found by :func:`find_adapter`
(``"auto"``: the one trainable model root inside the module that a registered adapter matches; frozen roots are
skipped, and two trainable ones are an error that asks which, :func:`find_candidates`).

To support another transformer, subclass :class:`TransformerAdapter`, implement :meth:`~TransformerAdapter.matches`
and :meth:`~TransformerAdapter.layers`, declare :attr:`~TransformerAdapter.layer_arguments`, and register it — or
use :class:`lightning_effi.adapters.GenericAdapter` from a config without code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from torch import Tensor, nn

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


@dataclass(frozen=True)
class AttentionMask:
    """A PyTorch attention-mask argument, gathered by the layout it arrives in (read at every call):

    - ``kind="self"``: a self-attention mask, query and key axes the sequence: ``[S, S]``, ``[B*num_heads, S, S]``
      (``torch.nn.MultiheadAttention``), ``[B|1, S, S]`` or ``[B|1, 1|H, S, S]`` (broadcast against the scores);
    - ``kind="cross"``: a cross-attention mask, query axis the sequence, key axis another one (a decoder's memory):
      the same layouts with ``M`` keys, only the query axis is gathered;
    - ``kind="key_padding"``: ``[B, S]`` (``True`` / ``-inf`` = ignored key).

    Boolean and additive float masks alike; a layer holding a ``torch.nn.MultiheadAttention`` gets its layouts back
    (``[B*num_heads, r, r]``; a shared ``[S, S]`` mask becomes per-sample). Another layout is an error naming the
    adapter, the shape and the layouts allowed (:func:`lightning_effi.random_ltd.functional.gather_attention_mask`).
    """

    kind: Literal["self", "cross", "key_padding"] = "self"

    def __post_init__(self) -> None:
        if self.kind not in ("self", "cross", "key_padding"):
            raise ValueError(f"AttentionMask.kind must be 'self', 'cross' or 'key_padding', got {self.kind!r}")


#: The argument passes through unchanged (no sequence axis, or an axis that is not this sequence's).
PASS: Literal["pass"] = "pass"
#: The argument must be ``None`` while tokens are dropped (e.g. a KV cache that would store r-length keys).
MUST_BE_NONE: Literal["must_be_none"] = "must_be_none"

ArgSpec = SeqArg | AttentionMask | Literal["pass", "must_be_none"]


def _overrides_matches(cls: type[TransformerAdapter]) -> bool:
    """Whether ``cls`` implements :meth:`TransformerAdapter.matches` (config-declared adapters do not)."""
    return getattr(cls.matches, "__func__", None) is not getattr(TransformerAdapter.matches, "__func__", None)


class TransformerAdapter:
    """Base class of model adapters. Subclasses set :attr:`name` and implement the methods marked below.

    Args:
        root: the model root the adapter serves (e.g. a ``transformers`` ``GPT2Model``). An adapter that implements
            :meth:`matches` checks it at construction.

    Raises:
        ValueError: ``root`` is not an ``nn.Module``, or (an adapter implementing :meth:`matches`) a model it does
            not serve: the message names the adapter, what it expects (:attr:`expects`), the model given and, when
            one is inside it, the submodule to pass instead (e.g. ``HFBertAdapter(model.bert)``).
    """

    #: registry name (``hf_gpt2``, ...)
    name: ClassVar[str] = ""
    #: what model root the adapter serves, for messages (e.g. "a BERT-style model with .encoder.layer")
    expects: ClassVar[str] = ""
    #: ``batch_seq`` = hidden states ``[B, S, H]`` (HF, timm); ``seq_batch`` = ``[S, B, H]`` (Megatron)
    hidden_state_order: HiddenStateOrder = "batch_seq"

    def __init__(self, root: nn.Module):
        cls = type(self)
        if not isinstance(root, nn.Module):
            raise ValueError(f"{cls.__name__}.root must be an nn.Module (the model), got {type(root).__name__}")
        if _overrides_matches(cls) and not cls.matches(root):
            expects = cls.expects or f"a model its matches() accepts (registered as {cls.name or cls.__name__!r})"
            inside = next((path for path, sub in root.named_modules() if path and cls.matches(sub)), None)
            hint = f"; pass the one inside it: {cls.__name__}(model.{inside})" if inside else ""
            raise ValueError(f"{cls.__name__} expects {expects}; got {type(root).__name__}{hint}")
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

    def max_sequence_length(self) -> int | None:  # pragma: no cover - abstract
        """Longest sequence the model takes (tokens, prefix tokens included), or ``None`` when the model has no such
        bound (random-LTD then only checks an explicit ``max_value`` against the sequences the layers see)."""
        raise NotImplementedError

    def num_prefix_tokens(self) -> int:
        """Tokens before the content tokens (class/distillation/register tokens); 0 for language models."""
        return 0

    def hidden_size(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def sequence_length(self, batch: Any) -> int | None:
        """The sequence length (tokens, prefix tokens included) the layers see for a training ``batch`` as the user's
        collate function makes it, or ``None`` when the adapter cannot tell from the batch alone (the default: a
        module may embed, prepend or cut tokens before its layers). Random-LTD reads it at ``on_train_start`` from a
        peek at the training data, to refuse a ``min_value`` that would never drop a token before the first batch."""
        return None

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


def input_ids_length(batch: Any) -> int | None:
    """``S`` of a Hugging Face style batch: a mapping with ``input_ids [B, S]`` (or ``inputs_embeds [B, S, H]``);
    ``None`` for any other structure. The models of ``hf_gpt2`` / ``hf_bert`` run their layers on exactly these
    ``S`` tokens."""
    if not isinstance(batch, Mapping):
        return None
    ids, embeds = batch.get("input_ids"), batch.get("inputs_embeds")
    if isinstance(ids, Tensor) and ids.dim() >= 1:
        return int(ids.shape[-1])
    if isinstance(embeds, Tensor) and embeds.dim() >= 2:
        return int(embeds.shape[-2])
    return None


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


def _is_frozen(module: nn.Module) -> bool:
    """Every parameter has ``requires_grad=False`` (a module without parameters is not frozen)."""
    params = list(module.parameters())
    return bool(params) and not any(p.requires_grad for p in params)


def resolve_attr(module: nn.Module, path: str, what: str = "model_attr") -> nn.Module:
    """The submodule at the dotted attribute ``path`` of ``module`` (e.g. ``"student"``, ``"model.encoder"``).

    Raises:
        ValueError: ``path`` is empty or not a string, an attribute is missing, or the target is not an ``nn.Module``
            (``what`` names the parameter in the message).
    """
    if not isinstance(path, str) or not path:
        raise ValueError(f"{what} must be a dotted attribute path such as 'student' or 'model.encoder', got {path!r}")
    target: Any = module
    for part in path.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{what}={path!r}: {type(target).__name__} has no attribute {part!r}")
        target = getattr(target, part)
    if not isinstance(target, nn.Module):
        raise ValueError(f"{what}={path!r} is a {type(target).__name__}, not an nn.Module")
    return target


#: the LightningModule hooks Lightning runs after the callbacks' ``setup`` in which a network may be built
_DEFERRED_HOOKS = ("setup", "configure_model", "configure_sharded_model")


def deferred_network_hint(module: nn.Module, owner: str, why: str) -> str:
    """The cause to report when a callback finds no network in ``module`` in its ``setup`` and ``module`` is a
    LightningModule that overrides ``setup`` or ``configure_model`` (``configure_sharded_model``): Lightning runs those
    after every callback's ``setup``, so a network built there does not exist yet. Empty when ``module`` overrides
    neither.

    Args:
        module: the LightningModule. owner: the callback's class name. why: why the callback needs the network in
            its ``setup`` (a clause, e.g. "it patches the layers before the checkpoint's state is restored").
    """
    try:
        from lightning.pytorch import LightningModule
    except ImportError:  # pragma: no cover - lightning is a dependency
        return ""
    if not isinstance(module, LightningModule):
        return ""
    hooks = [h for h in _DEFERRED_HOOKS if getattr(type(module), h, None) is not getattr(LightningModule, h, None)]
    if not hooks:
        return ""
    host = type(module).__name__
    named = " / ".join(f"{host}.{h}()" for h in hooks)
    return (
        f"{owner}: no network in {host} at the callback's setup, and {host} overrides {named}: Lightning runs every "
        f"callback's setup before LightningModule.setup and configure_model, so a network built there does not exist "
        f"yet when {owner} looks for it ({owner} needs it in its setup: {why}). Build the network in {host}.__init__"
    )


def find_candidates(
    module: nn.Module, names: Iterable[str] | None = None, include_frozen: bool = False
) -> list[tuple[str, str, nn.Module]]:
    """The model roots inside ``module`` (itself included) that a registered adapter matches, outermost first:
    ``(dotted name, adapter name, root)``; a root inside another one is not listed again, nor (unless
    ``include_frozen``) a root whose parameters all have ``requires_grad=False`` (a frozen teacher, an EMA copy:
    random-LTD trains nothing there).

    Args:
        names: the adapter names tried (default: all registered, in registration order).
    """
    known: dict[str, Callable[..., TransformerAdapter]] = registry.adapters("random_ltd")
    tried = list(names) if names is not None else list(known)
    found: list[tuple[str, str, nn.Module]] = []
    inside: list[str] = []
    for path, sub in module.named_modules():
        if any(path == p or path.startswith(p + ".") for p in inside):
            continue
        for name in tried:
            matches = getattr(known[name], "matches", None)
            if matches is not None and matches(sub):
                inside.append(path)
                if include_frozen or not _is_frozen(sub):
                    found.append((path, name, sub))
                break
    return found


def find_adapter(
    module: nn.Module,
    adapter: str | TransformerAdapter = "auto",
    candidates: Iterable[str] | None = None,
    include_frozen: bool = False,
) -> TransformerAdapter:
    """The adapter for the one model root inside ``module`` (``module`` itself included) that a registered adapter
    matches (:func:`find_candidates`: frozen roots are skipped unless ``include_frozen``).

    Args:
        module: usually the LightningModule (or the submodule random-LTD's ``model_attr`` names). adapter:
            ``"auto"``, a registered name, or an adapter instance (returned bound to ``module``). candidates: names
            tried by ``"auto"`` (default: all registered). include_frozen: frozen roots are candidates too.

    Raises:
        ValueError: unknown adapter name; no submodule matches (the message lists the registered adapters, and any
            frozen roots that were skipped); more than one root matches (a teacher and a student, two towers, an EMA
            copy that trains): the message names them and asks which one (random-LTD's ``model_attr``, or an adapter
            instance).
    """
    if isinstance(adapter, TransformerAdapter):
        return adapter.bind(module)
    if not isinstance(adapter, str):
        raise ValueError(f"adapter must be 'auto', a registered name or a TransformerAdapter, got {adapter!r}")
    known: dict[str, Callable[..., TransformerAdapter]] = registry.adapters("random_ltd")
    if adapter != "auto":
        registry.lookup("random_ltd", adapter, "adapter", hint="(or pass a lightning_effi.models.GenericAdapter)")
    names = [adapter] if adapter != "auto" else list(candidates or known)
    found = find_candidates(module, names, include_frozen)
    label = "any registered adapter" if adapter == "auto" else repr(adapter)
    if len(found) > 1:
        listing = ", ".join(
            f"{path or '<the module itself>'!r} ({name}: {type(sub).__name__}"
            + ("" if sub.training else ", in eval mode: an EMA copy?")
            + ")"
            for path, name, sub in found
        )
        # the example names a network in training mode (timm's ModelEmaV3 keeps its copy trainable, in eval mode)
        example = next((path for path, _, sub in found if sub.training), found[-1][0])
        raise ValueError(
            f"adapter: {type(module).__name__} holds {len(found)} trainable transformers that {label} matches: "
            f"{listing}; random-LTD patches one: say which with RandomLTDCallback(model_attr={example!r}) (a "
            "dotted attribute path from the LightningModule: the network training_step trains), or pass an adapter "
            "instance (lightning_effi.adapters.GenericAdapter(layers=...)); freeze the other one "
            "(requires_grad=False) if it does not train"
        )
    if found:
        _, name, sub = found[0]
        return known[name](sub)
    frozen = [] if include_frozen else find_candidates(module, names, include_frozen=True)
    skipped = (
        " except frozen ones (all parameters requires_grad=False, skipped: "
        f"{', '.join(repr(p) for p, _, _ in frozen)}; name one with RandomLTDCallback(model_attr=...) to patch it "
        "anyway)"
        if frozen
        else ""
    )
    stacks = block_stacks(module)
    # a stack of blocks that may run on tokens (transformer or MLP blocks on [B, T, H]); stacks of image convolutions
    # (a ResNet's stages, ConvNeXt) or of windowed attention over a grid (Swin) led to two more refusals
    # (qa51-vision 02)
    attentive = [stack for stack in stacks if _token_blocks(module.get_submodule(stack[0]))]
    if attentive:
        suggestion = (
            f" (here, e.g. GenericAdapter(layers={attentive[0][0]!r}, hidden_size=<the blocks' width>): the "
            f"{attentive[0][1]} {attentive[0][2]} there; hidden_size is read from an nn.MultiheadAttention in the "
            "blocks, else it is needed)"
        )
    elif stacks:
        suggestion = (
            f". Its stacks of blocks ({', '.join(repr(path) for path, _, _ in stacks[:3])}) run image convolutions, "
            "windowed attention over a grid or single layers: random-LTD drops tokens of a transformer's [B, T, H] "
            "hidden states, which such blocks do not have"
        )
    else:
        suggestion = ""
    raise ValueError(
        f"adapter: no model inside {type(module).__name__} matches {label}{skipped} "
        f"({', '.join(registered_adapters())}); register one with lightning_effi.models.register_adapter "
        f"or pass a lightning_effi.models.GenericAdapter(layers=...){suggestion}"
    )


def _token_blocks(stack: nn.Module) -> bool:
    """Whether a stack of blocks may run on a sequence of tokens: not single layers (``nn.Linear`` modules without
    submodules), nor image convolutions (``nn.Conv2d`` / ``nn.Conv3d``) without attention, nor attention within
    windows of a grid (Swin's ``WindowAttention``)."""
    if not any(True for child in stack.children() for _ in child.children()):
        return False  # single layers (a GNN's nn.Linear per hop on [N, H] node features), no blocks (qa54-domains 06)
    modules = list(stack.modules())
    kinds = [type(m).__name__.lower() for m in modules]
    if any("window" in k for k in kinds):
        return False
    attention = any(isinstance(m, nn.MultiheadAttention) or "attention" in k for m, k in zip(modules, kinds))
    return attention or not any(isinstance(m, (nn.Conv2d, nn.Conv3d)) for m in modules)


def block_stacks(module: nn.Module) -> list[tuple[str, int, str]]:
    """The ``nn.ModuleList`` / ``nn.Sequential`` inside ``module`` that hold >= 2 modules of one class, each with
    parameters (a stack of transformer blocks, the layers a ``GenericAdapter`` names), outermost first, as ``(dotted
    path from module, count, class name)``; for the hint of :func:`find_adapter`'s error."""
    out = []
    for path, sub in module.named_modules():
        if not path or not isinstance(sub, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(sub.children())
        kinds = {type(c) for c in children}
        if len(children) >= 2 and len(kinds) == 1 and all(any(True for _ in c.parameters()) for c in children):
            out.append((path, len(children), children[0].__class__.__name__))
    return sorted(out, key=lambda item: item[0].count("."))
