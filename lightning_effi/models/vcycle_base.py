"""What the V-cycle needs from any architecture family: the :class:`VCycleAdapter` base class, the parameter-table
helpers (:class:`ParamSpec`, :func:`linear`, :func:`conv1d`, :func:`vector`, :func:`input_only`), the builders of a
small HF model and :func:`find_vcycle_adapter`. The per-family maps live in the family files (``gpt2.py``,
``bert.py``, ``vit.py``); the method card is ``lightning_effi/vcycle/README.md``.

An adapter turns a live large model into a :class:`~lightning_effi.vcycle.operators.VCyclePlan` (one level: width
and depth halving) and builds the small model from the large model's own configuration::

    from lightning_effi.models.vcycle_base import find_vcycle_adapter
    from lightning_effi.vcycle import operators

    adapter = find_vcycle_adapter(model)                    # GPT2LMHeadModel, Bert*, timm VisionTransformer
    plan = adapter.plan(model, width_scheme="half", depth_scheme="adjacent", embedding_convention="official")
    small = adapter.build_small(model, plan)
    small.load_state_dict(operators.coalesce(model, plan))  # strict; in-place copies keep HF ties

Registered: ``hf_gpt2`` (:class:`~lightning_effi.models.gpt2.HFGPT2VCycleAdapter`), ``hf_bert``
(:class:`~lightning_effi.models.bert.HFBertVCycleAdapter`), ``timm_vit``
(:class:`~lightning_effi.models.vit.TimmViTVCycleAdapter`); the three names stay importable from here. To support
another architecture, subclass :class:`VCycleAdapter`, implement :meth:`~VCycleAdapter.matches`,
:meth:`~VCycleAdapter.sizes`, :meth:`~VCycleAdapter.param_table` and :meth:`~VCycleAdapter.build_small`, and decorate
it with :func:`register_vcycle_adapter` (a view over :mod:`lightning_effi.models.registry`).

Parameter tables use the map names ``E`` (hidden), ``QK``, ``V`` (attention outputs), ``QKV`` (fused ``[Q; K; V]``)
and ``I`` (FFN intermediate); every state-dict entry must be covered (strict loading, no parameter silently left
out): parameters outside the table (e.g. timm ``attn.gate``, ``attn.norm``, ``mlp.norm``, a MAP pooling head, GPT-2
cross-attention) raise a ``ValueError`` listing them.
"""

from __future__ import annotations

import copy
import importlib
import itertools
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from torch import nn

from lightning_effi.models import registry
from lightning_effi.vcycle.operators import (
    EMBEDDING_CONVENTIONS,
    DepthScheme,
    TensorRule,
    TransformerWidthMaps,
    VCyclePlan,
    WidthScheme,
    _storage_key,
    convention_scale,
    depth_groups,
    layer_key,
    transformer_width_maps,
)

__all__ = [
    "COPY",
    "ArchSizes",
    "ParamSpec",
    "TableContext",
    "VCycleAdapter",
    "conv1d",
    "find_vcycle_adapter",
    "find_vcycle_network",
    "held_in_containers",
    "hf_build_small",
    "hf_small_config",
    "input_only",
    "linear",
    "register_vcycle_adapter",
    "registered_vcycle_adapters",
    "vector",
]

#: the per-family maps that moved to the family files, still importable from here (resolved by ``__getattr__``)
_MOVED = {
    "HFGPT2VCycleAdapter": "lightning_effi.models.gpt2",
    "HFBertVCycleAdapter": "lightning_effi.models.bert",
    "TimmViTVCycleAdapter": "lightning_effi.models.vit",
}


class ParamSpec(NamedTuple):
    """One row of a parameter table: ``axes`` = ``(dim, map name, side)`` per mapped axis, ``scale`` (power of two)."""

    axes: tuple[tuple[int, str, str], ...] = ()
    scale: float = 1.0


def linear(out: str, inp: str, scale: float = 1.0) -> ParamSpec:
    """``nn.Linear.weight`` (out × in)."""
    return ParamSpec(((0, out, "out"), (1, inp, "in")), scale)


def conv1d(out: str, inp: str) -> ParamSpec:
    """HF ``Conv1D.weight`` (in × out: the Linear rule transposed)."""
    return ParamSpec(((0, inp, "in"), (1, out, "out")))


def vector(m: str, dim: int = 0, scale: float = 1.0) -> ParamSpec:
    """Bias, LayerNorm γ/β, LayerScale γ, embedding table / token parameter on axis ``dim``: output rule."""
    return ParamSpec(((dim, m, "out"),), scale)


def input_only(m: str = "E") -> ParamSpec:
    """A head whose input is the hidden state (classifier, untied LM head): input rule on axis 1."""
    return ParamSpec(((1, m, "in"),))


#: a parameter copied unchanged (no mapped axis)
COPY = ParamSpec()


@dataclass(frozen=True)
class ArchSizes:
    """Sizes of a transformer and the configuration keys that hold them (named in error messages)."""

    hidden: int
    heads: int
    ffn: int
    layers: int
    keys: tuple[str, str, str, str]  # hidden, heads, ffn, layers


@dataclass(frozen=True)
class TableContext:
    """What a parameter table may depend on: the level's maps, the tie structure and the convention scales."""

    maps: TransformerWidthMaps
    convention: str
    aliases: Mapping[str, str]
    #: scale of embedding tables under ``official`` (``c``; 1 under ``exact`` or for depth-only levels)
    embedding_scale: float
    #: ``c`` under ``exact``: applied by adapters to the LayerNorm feeding a tied output head
    exact_scale: float

    def tied(self, key: str) -> bool:
        return key in self.aliases


class VCycleAdapter:
    """Base class of V-cycle adapters (one architecture family each). Subclasses set :attr:`name`,
    :attr:`default_alpha_original` and :attr:`models`, and implement the four methods below."""

    name: ClassVar[str] = ""
    #: weight of the saved original model when interpolating (Zou et al. 2024 defaults: BERT 0.5, GPT-2, ViT/DeiT 0.25)
    default_alpha_original: ClassVar[float] = 0.25
    #: human-readable list of supported model classes (for error messages)
    models: ClassVar[str] = ""

    @classmethod
    def matches(cls, model: nn.Module) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def sizes(self, model: nn.Module) -> ArchSizes:  # pragma: no cover - abstract
        raise NotImplementedError

    def layer_prefix(self, model: nn.Module) -> str:  # pragma: no cover - abstract
        """State-dict prefix of the block list, ending in ``.`` (``"transformer.h."``)."""
        raise NotImplementedError

    def param_table(self, model: nn.Module, ctx: TableContext) -> tuple[dict[str, ParamSpec], dict[str, ParamSpec]]:
        """``(global table keyed by full state-dict key, per-block table keyed by the key after
        "<layer_prefix><i>.")``. Keys absent from the model are ignored; model keys absent from both raise."""
        raise NotImplementedError  # pragma: no cover - abstract

    def build_small(self, model: nn.Module, plan: VCyclePlan) -> nn.Module:  # pragma: no cover - abstract
        """A freshly initialised model with the plan's small shapes, same dtype, device and train/eval mode."""
        raise NotImplementedError

    # -- concrete ----------------------------------------------------------------------------------------------------

    def plan(
        self,
        model: nn.Module,
        width_scheme: WidthScheme | None = "half",
        depth_scheme: DepthScheme | None = "adjacent",
        embedding_convention: str = "official",
    ) -> VCyclePlan:
        """The plan of one level for ``model``: width and depth maps, embedding convention, the parameter table.

        Args:
            width_scheme: ``"half"``, explicit head groups (a partition of the heads; groups of 3 allowed), or
                ``None`` (width unchanged). depth_scheme: ``"adjacent"``, ``"half"``, explicit layer groups or ``None``
                (depth unchanged). embedding_convention: ``"official"`` (embedding tables ×2 on coalesce / ×½ on
                de-coalesce) or ``"exact"`` (no embedding scaling; the LayerNorm feeding a tied output head ×2 / ×½).

        Raises:
            ValueError: unknown convention; sizes that cannot be halved by the scheme (naming the config key, e.g.
                ``n_head``); odd depth with a default depth scheme (naming e.g. ``n_layer``); groups that are not a
                partition; parameters the adapter does not map (listed).
        """
        if embedding_convention not in EMBEDDING_CONVENTIONS:
            raise ValueError(
                f"embedding_convention must be one of {EMBEDDING_CONVENTIONS}, got {embedding_convention!r}"
            )
        s = self.sizes(model)
        kh, kn, kf, kl = s.keys
        maps = transformer_width_maps(s.hidden, s.heads, s.ffn, width_scheme, names=(kh, kn, kf))
        depth = None if depth_scheme is None else depth_groups(s.layers, depth_scheme, name=kl)
        sd = model.state_dict()
        named = {k for k, _ in model.named_parameters()} | {k for k, _ in model.named_buffers()}
        by_storage: dict[tuple, list[str]] = {}
        for k, t in sd.items():
            by_storage.setdefault(_storage_key(t), []).append(k)
        aliases: dict[str, str] = {}
        for keys in by_storage.values():
            if len(keys) > 1:
                canon = next((k for k in keys if k in named), keys[0])
                aliases.update({k: canon for k in keys if k != canon})
        c = convention_scale(maps.hidden)
        if aliases and maps.hidden.large != c * maps.hidden.small:
            # the power-of-two factor keeps the round trip exact but is not the group size: a tied head's logits are
            # c_exact / c of the small model's after de-coalescing (3/4 for triples of heads, qa79-vcycle 02)
            warnings.warn(
                f"{self.name}: width groups of {maps.hidden.large}/{maps.hidden.small} = "
                f"{maps.hidden.large / maps.hidden.small:g} features per coalesced one with a tied output head: the "
                f"{embedding_convention!r} convention scales by the power of two {c:g} (for an exact round trip), so "
                "the de-coalesced model's logits differ from the small model's (by the ratio of the two); use pairs "
                "(width_scheme='half') for a function-preserving de-coalescing",
                UserWarning,
                stacklevel=2,
            )
        ctx = TableContext(
            maps,
            embedding_convention,
            aliases,
            embedding_scale=c if embedding_convention == "official" else 1.0,
            exact_scale=c if embedding_convention == "exact" else 1.0,
        )
        global_table, block_table = self.param_table(model, ctx)
        named_maps = {"E": maps.hidden, "QK": maps.qk, "V": maps.v, "QKV": maps.qkv, "I": maps.ffn}
        prefix = self.layer_prefix(model)
        rules: dict[str, TensorRule] = {}
        unmapped: list[str] = []
        for k in sd:
            if k in aliases:
                continue
            lk = layer_key(k, prefix)
            if lk is not None:
                row = block_table.get(k[len(prefix) + len(str(lk[0])) + 1 :])
            else:
                row = global_table.get(k)
            if row is None:
                unmapped.append(k)
                continue
            axes = tuple((d, named_maps[m], side) for d, m, side in row.axes)
            rules[k] = TensorRule(axes, row.scale, *(lk if lk is not None else (None, "")))
        if unmapped:
            raise ValueError(
                f"{self.name}: the V-cycle adapter does not map {len(unmapped)} parameter(s) of "
                f"{type(model).__name__}: {_by_layer(unmapped)} (a module of your own inside the network, such as a "
                "replaced head, or an option of the model the adapter's table does not cover); it coalesces a model "
                "it can rebuild from the model's configuration, so every parameter must be in its table, in depth-only "
                "coalescing too. Keep the model's own modules (a timm model's head: create_model(num_classes=...) "
                "or reset_classifier), or move your module onto the LightningModule outside the network (then "
                "width_scheme=None if it reads the hidden size), or subclass "
                f"{type(self).__module__}.{type(self).__name__} to map them (param_table, build_small; "
                "lightning_effi/models/vcycle_base.py says how) and pass it as VCycleCallback(adapter=...)"
            )
        info = {
            "adapter": self.name,
            "model": type(model).__name__,
            "width_scheme": width_scheme,
            "depth_scheme": depth_scheme,
            "embedding_convention": embedding_convention,
            "large": {"hidden": s.hidden, "heads": s.heads, "ffn": s.ffn, "layers": s.layers},
            "small": {
                "hidden": maps.hidden.small,
                "heads": maps.small_heads,
                "ffn": maps.ffn.small,
                "layers": len(depth) if depth is not None else s.layers,
            },
        }
        return VCyclePlan.create({k: tuple(t.shape) for k, t in sd.items()}, rules, aliases, depth, info)

    @staticmethod
    def _finish(model: nn.Module, small: nn.Module, plan: VCyclePlan) -> nn.Module:
        p = next(model.parameters(), None)
        if p is not None:
            small = small.to(device=p.device, dtype=p.dtype)
        small.train(model.training)
        got = {k: tuple(t.shape) for k, t in small.state_dict().items()}
        if got != dict(plan.small_shapes):
            diff = sorted(set(got.items()) ^ set(plan.small_shapes.items()))
            raise RuntimeError(
                f"build_small: the rebuilt {type(small).__name__} does not match the plan's small "
                f"shapes; differing (key, shape) entries: {diff[:20]}"
            )
        return small

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def register_vcycle_adapter(cls: type[VCycleAdapter]) -> type[VCycleAdapter]:
    """Class decorator: register a :class:`VCycleAdapter` as the V-cycle adapter of the model family ``cls.name``
    (tried by :func:`find_vcycle_adapter`).

    Raises:
        ValueError: empty name, or the name is registered to another class.
    """
    if not cls.name:
        raise ValueError(f"{cls.__name__}: set the class attribute `name` before registering")
    registry.register("vcycle", cls.name, cls, what="V-cycle adapter")
    return cls


def registered_vcycle_adapters() -> list[str]:
    """The family names with a V-cycle adapter, sorted."""
    return registry.names("vcycle")


def _supported(known: Mapping[str, type[VCycleAdapter]]) -> str:
    return "; ".join(f"{n} ({known[n].models})" for n in sorted(known))


def find_vcycle_adapter(model: nn.Module, adapter: str | VCycleAdapter = "auto") -> VCycleAdapter:
    """The V-cycle adapter for ``model`` (the model root whose state dict is mapped, e.g. ``pl_module.model``).

    Args:
        adapter: ``"auto"`` (the first registered adapter whose :meth:`~VCycleAdapter.matches` accepts ``model``),
            a registered name, or an adapter instance (returned as is).

    Raises:
        ValueError: unknown name, or no adapter matches (the message names the supported architectures and, when a
            submodule would match, the attribute to pass instead).
    """
    if isinstance(adapter, VCycleAdapter):
        return adapter
    known: dict[str, type[VCycleAdapter]] = registry.adapters("vcycle")
    if adapter != "auto":
        registry.lookup("vcycle", adapter, "V-cycle adapter", registered=_supported(known))
        if not known[adapter].matches(model):
            raise ValueError(
                f"adapter: {adapter!r} does not handle {type(model).__name__} (supports {known[adapter].models})"
            )
        return known[adapter]()
    for cls in known.values():
        if cls.matches(model):
            return cls()
    hint = ""
    for name, sub in model.named_modules():
        if name and any(cls.matches(sub) for cls in known.values()):
            hint = f" Its submodule {name!r} ({type(sub).__name__}) is supported: pass that module instead."
            break
    raise ValueError(
        f"no V-cycle adapter for {type(model).__name__}; supported architectures: {_supported(known)}."
        f"{hint} Other architectures: subclass lightning_effi.models.vcycle_base.VCycleAdapter and "
        "register it with register_vcycle_adapter."
    )


def _handles(adapter: str | VCycleAdapter, known: Mapping[str, type[VCycleAdapter]], model: nn.Module) -> bool:
    """Whether ``adapter`` (``"auto"``: any registered one, a registered name, or an instance) handles ``model``."""
    if isinstance(adapter, VCycleAdapter):
        return bool(adapter.matches(model))
    classes = known.values() if adapter == "auto" else [known[adapter]] if adapter in known else []
    return any(cls.matches(model) for cls in classes)


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _within(module: nn.Module, network: nn.Module) -> bool:
    """Whether ``module`` is ``network`` or one of its submodules."""
    return any(m is module for m in network.modules())


def _children(host: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every direct submodule of ``host`` under every name (``named_children`` yields a module held twice once)."""
    return [(n, m) for n, m in host._modules.items() if m is not None]


def holds_vcycle_network(host: nn.Module, adapter: str | VCycleAdapter = "auto") -> bool:
    """Whether any module inside ``host`` (itself included, frozen or not, at any depth) is a network ``adapter``
    (``"auto"``: any registered V-cycle adapter) handles."""
    known: dict[str, type[VCycleAdapter]] = registry.adapters("vcycle")
    return any(_handles(adapter, known, m) for m in host.modules())


def find_vcycle_network(
    host: nn.Module,
    model_attr: str | None = None,
    adapter: str | VCycleAdapter = "auto",
    owner: str = "VCycleCallback",
) -> tuple[str, VCycleAdapter]:
    """The attribute of ``host`` (a LightningModule) holding the network the V-cycle coalesces, and its adapter.

    With ``model_attr`` None the attribute is found: the direct submodules of ``host`` that ``adapter`` handles
    (:func:`find_vcycle_adapter`; ``"auto"``: any registered adapter) and that have a trainable parameter (a frozen
    module, every parameter ``requires_grad=False``, such as a distillation teacher, is not a candidate); a module held
    under two names counts once per name. Exactly one candidate is taken; several or none raise. With ``model_attr``
    given, ``host.<model_attr>`` is taken (its adapter must exist and it must have a trainable parameter: a frozen
    module is not trained, so a V-cycle on it is meaningless). Either way no other direct submodule of ``host`` may
    share a parameter with the network: the V-cycle replaces ``host.<model_attr>`` at every level change, and a second
    reference (e.g. ``self.head = self.net.lm_head``) would keep the old model's layers.

    Returns:
        ``(attribute name, adapter instance)``.

    Raises:
        ValueError (naming ``owner.model_attr``): several candidates (listed; pass ``model_attr``), none (the message
            names the supported architectures, the submodules seen and a deeper submodule an adapter would handle),
            one network (or one of its parameters) held under two names (make the alias a property),
            ``host.<model_attr>`` missing, not an ``nn.Module`` or frozen (no parameter with ``requires_grad``), no
            adapter for it, another attribute sharing its parameters, an attribute holding its modules or parameters in
            a plain Python container (:func:`held_in_containers`); an unknown adapter name.
    """
    name = f"{owner}.model_attr"
    known: dict[str, type[VCycleAdapter]] = registry.adapters("vcycle")
    if isinstance(adapter, str) and adapter != "auto":
        registry.lookup("vcycle", adapter, "V-cycle adapter", registered=_supported(known))
    host_name = type(host).__name__
    if model_attr is None:
        handled = [(n, m) for n, m in _children(host) if _handles(adapter, known, m)]
        candidates = [(n, m) for n, m in handled if _trainable(m)]
        if len(candidates) > 1 and len({id(m) for _, m in candidates}) == 1:
            names = " and ".join(f"{host_name}.{n}" for n, _ in candidates)
            raise ValueError(
                f"{name}: {names} are the same {type(candidates[0][1]).__name__}, held under two names; the V-cycle "
                "replaces the network at every level change and can update one attribute only, so the other would "
                "keep the old model. Hold it once and make the alias a property (e.g. "
                f"@property def {candidates[1][0]}(self): return self.{candidates[0][0]})"
            )
        outer = next((c for c in candidates if all(_within(m, c[1]) for _, m in candidates)), None)
        if len(candidates) > 1 and outer is not None:
            # an alias of a part of the network (self.blocks = self.encoder.layers) read as a second network; following
            # the model_attr advice only led to the shared-parameters error (qa67-user 03)
            alias, part = next((n, m) for n, m in candidates if m is not outer[1])
            path = next(p for p, m in outer[1].named_modules() if m is part)
            raise ValueError(
                f"{name}: {host_name}.{alias} is part of {host_name}.{outer[0]} ({type(outer[1]).__name__}), held "
                "under a second name; the V-cycle replaces the network at every level change and can update one "
                "attribute only, so the alias would keep the old model's layers. Reach it through the network and make "
                f"the alias a property (e.g. @property def {alias}(self): return self.{outer[0]}.{path})"
            )
        if len(candidates) > 1:
            listed = ", ".join(f"{n!r} ({type(m).__name__})" for n, m in candidates)
            raise ValueError(
                f"{name}: {host_name} holds several networks the V-cycle can coalesce: {listed}; pass "
                f"model_attr='<attribute>' to say which one changes size (frozen modules, every parameter "
                "requires_grad=False, are not candidates)"
            )
        if not candidates:
            seen = "; ".join(
                f"{n!r}: {type(m).__name__}, every parameter frozen"
                if _handles(adapter, known, m)
                else f"{n!r}: no V-cycle adapter for {type(m).__name__}" + _why_unhandled(m)
                for n, m in _children(host)
            )
            deeper = next(
                (
                    f"{n!r} ({type(m).__name__})"
                    for n, m in host.named_modules()
                    if "." in n and _handles(adapter, known, m) and _trainable(m)
                ),
                None,
            )
            hint = (
                f" The submodule {deeper} is supported: hold it as an attribute of {host_name} (the V-cycle replaces "
                "one attribute)."
                if deeper
                else ""
            )
            which = "a registered V-cycle adapter" if adapter == "auto" else f"the V-cycle adapter {adapter!r}"
            raise ValueError(
                f"{name}: no attribute of {host_name} holds a trainable network {which} handles "
                f"({seen or 'it has no submodule'}).{hint} Supported: {_supported(known)}. Pass "
                "model_attr='<attribute>' if the network is held elsewhere, or subclass "
                "lightning_effi.models.vcycle_base.VCycleAdapter and register it with register_vcycle_adapter"
            )
        attr, model = candidates[0]
        chosen = adapter if isinstance(adapter, VCycleAdapter) else find_vcycle_adapter(model, adapter)
    else:
        model = getattr(host, model_attr, None)
        if not isinstance(model, nn.Module):
            raise ValueError(f"{name}: {host_name} has no nn.Module attribute {model_attr!r}")
        if not _trainable(model):
            raise ValueError(
                f"{name}: {host_name}.{model_attr} ({type(model).__name__}) has no trainable parameter (every "
                "parameter requires_grad=False): a frozen module is not trained, so a V-cycle on it is meaningless "
                "(and coalescing would change its weights); name the network that trains, or unfreeze it"
            )
        attr, chosen = model_attr, find_vcycle_adapter(model, adapter)
    own = {id(p) for p in model.parameters()}
    sharing = [n for n, m in _children(host) if n != attr and any(id(p) in own for p in m.parameters())]
    if sharing:
        raise ValueError(
            f"{name}: {host_name}.{', '.join(sharing)} share(s) parameters with {host_name}.{attr}, the network the "
            f"V-cycle replaces at every level change; the other reference would keep the old model's layers. Reach "
            f"the network through self.{attr} only (e.g. self.{attr}.lm_head, not a second attribute)"
        )
    # a parameter of the network registered on the module under a second name (self.out = self.net.wte.weight, a
    # tied head in training_step): named_parameters() lists it once, so the checks above never saw a second holder,
    # and it kept the full network's tensor at the coarse levels (a shape error there, or a regularizer on the stale
    # tensor: qa83-compat 05)
    aliased = [(n, p) for n, p in host._parameters.items() if p is not None and id(p) in own]
    if aliased:
        alias, param = aliased[0]
        path = next(n for n, q in model.named_parameters(remove_duplicate=False) if q is param)
        # as Python reaches it: layers[0].linear1.weight
        attribute = "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in path.split("."))
        raise ValueError(
            f"{name}: {host_name}.{alias} is the parameter {host_name}.{attr}.{path}, held under a second name; the "
            "V-cycle replaces the network at every level change and can update one attribute only, so the alias "
            "would keep the full network's tensor at the coarse levels. Reach it through the network and make the "
            f"alias a property (e.g. @property def {alias}(self): return self.{attr}{attribute})"
        )
    held = held_in_containers(host, model)
    if held:
        listed = ", ".join(f"self.{h}" for h in held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise ValueError(
            f"{name}: {listed} of {host_name} hold(s) modules or parameters of {host_name}.{attr} in a plain Python "
            f"container (a list, tuple, dict or set, which nn.Module does not register); the V-cycle replaces "
            f"self.{attr} at every level change, so these would keep the full network's layers (run outside the "
            f"optimizer at the coarse levels, or fail on their shapes). Reach them through self.{attr} where they are "
            "used (e.g. a property returning the blocks of the current network)"
        )
    return attr, chosen


#: the containers :func:`held_in_containers` looks into (exact types: ``AttributeDict``, ``nn.ModuleList`` are not)
_PLAIN_CONTAINERS = (list, tuple, dict, set, frozenset)
#: ``nn.Module``'s own bookkeeping (``_modules``, ``_parameters``, hook dicts, ...) and Lightning's hyperparameters
#: (``save_hyperparameters()`` keeps the arguments, a model among them, for logging; they are never run)
_NOT_ATTRIBUTES = frozenset(vars(nn.Module())) | {"_hparams", "_hparams_initial"}


#: items of one container :func:`held_in_containers` reads at most (a module holding a large list of data)
_MOST_ITEMS = 10_000


def held_in_containers(host: nn.Module, network: nn.Module, depth: int = 3) -> list[str]:
    """The attributes of ``host`` that hold a module or parameter of ``network`` (``network`` itself included) inside
    a plain Python container (list, tuple, dict, set: ``nn.Module`` registers none of them), as paths such as
    ``blocks[0]`` or ``groups['decay'][3]``, first hit per attribute; containers nested up to ``depth`` deep are
    searched, the first 10,000 items of each. ``save_hyperparameters``' record and ``nn.Module``'s own dictionaries
    are not attributes of the user's.

    >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    >>> host = nn.Module()
    >>> host.net, host.blocks, host.names = net, list(net), ["a"]
    >>> held_in_containers(host, net)
    ['blocks[0]']
    """
    ids = {id(m) for m in network.modules()} | {id(p) for p in network.parameters()}

    def first(value: Any, path: str, left: int) -> str | None:
        if id(value) in ids:
            return path
        if left == 0 or type(value) not in _PLAIN_CONTAINERS:
            return None
        items = value.items() if type(value) is dict else enumerate(value)
        for key, item in itertools.islice(items, _MOST_ITEMS):
            where = f"{path}[{key!r}]" if type(value) is dict else f"{path}[{key}]"
            found = first(item, where, left - 1)
            if found:
                return found
        return None

    hits = []
    for attr, value in vars(host).items():
        if attr in _NOT_ATTRIBUTES or type(value) not in _PLAIN_CONTAINERS:
            continue
        found = first(value, attr, depth)
        if found:
            hits.append(found)
    return hits


def hf_small_config(model: nn.Module, plan: VCyclePlan, keys: tuple[str, str, str, str]) -> Any:
    """A copy of the HF ``model.config`` with the plan's small sizes under ``keys`` (hidden, heads, FFN, layers)."""
    small = plan.info["small"]
    cfg = copy.deepcopy(model.config)
    kh, kn, kf, kl = keys
    setattr(cfg, kh, small["hidden"])
    setattr(cfg, kn, small["heads"])
    setattr(cfg, kl, small["layers"])
    if kf == "n_inner" and cfg.n_inner is None and small["ffn"] == 4 * small["hidden"]:
        pass  # None means 4 × n_embd, still true for the small model
    else:
        setattr(cfg, kf, small["ffn"])
    return cfg


def hf_build_small(model: nn.Module, plan: VCyclePlan, keys: tuple[str, str, str, str]) -> nn.Module:
    """A freshly initialised HF model of ``type(model)`` built from :func:`hf_small_config` (output head tied as the
    configuration says)."""
    small = type(model)(hf_small_config(model, plan, keys))
    small.tie_weights()
    return small


def __getattr__(name: str) -> Any:
    # the per-family maps moved to the family files; ``from lightning_effi.models.vcycle_base import ...`` still works
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _why_unhandled(model: nn.Module) -> str:
    """Why a network with a list of blocks of one class is still not handled (its blocks differ, or they are single
    layers), for the refusal."""
    from lightning_effi.models.torch_transformer import single_layer_list, unequal_block_list

    why = unequal_block_list(model) or single_layer_list(model)
    return f" ({why})" if why else ""


def _by_layer(names: list[str]) -> list[str]:
    """``names`` with those that differ only in a layer index (``h.0.attn.lora_A``, ``h.1.attn.lora_A``, ...) given
    once: the first, then how many more and their pattern (``h.*.attn.lora_A``), so that a message lists an adapter
    inserted in every layer in a line, not one name per layer."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(re.sub(r"(?<=\.)\d+(?=\.)", "*", name), []).append(name)
    return [
        group[0] if len(group) == 1 else f"{group[0]} (+{len(group) - 1} more: {pattern})"
        for pattern, group in groups.items()
    ]
