"""Hand-written transformers: the V-cycle adapter :class:`TorchBlocksVCycleAdapter`, registered as the family
``torch_blocks``, for any network that holds one list of identical blocks (``nn.TransformerEncoder.layers``,
``nn.TransformerDecoder.layers``, or an ``nn.ModuleList`` / ``nn.Sequential`` of blocks of one class). The method
(Zou, Zhang, Deng, "A Multi-Level Framework for Accelerating Training Transformer Models", ICLR 2024; official code
``Photooon/Multi-Level-Training-Framework``, ``map_tools/mapper.py``) and its operators are described in the method
card, ``lightning_effi/vcycle/README.md``.

Which list (:func:`find_block_list`): among the ``nn.ModuleList`` / ``nn.Sequential`` modules of the network holding
at least 2 blocks of one class (distinct modules, each with a parameter, either composite or of a class defined outside
PyTorch, so a list of ``nn.Linear`` is not one) with the same state-dict names, shapes and dtypes, and not nested inside
a block of another such list (the list of heads inside every block is part of the block), the longest. Several equally
long lists raise a ``ValueError`` naming them (pick one with a subclass overriding
:meth:`TorchBlocksVCycleAdapter.block_list`).

Depth (any blocks): the paper's depth operator on the list (adjacent blocks averaged, parameter by parameter; the
schemes of :func:`~lightning_effi.vcycle.operators.depth_groups`); every tensor outside the list is kept as it is
(identity maps), so any embedding, head or custom parameter works. ``build_small`` deep-copies the network and drops
the blocks past the small depth (``nn.TransformerEncoder`` / ``nn.TransformerDecoder`` get ``num_layers`` updated); the
network's ``forward`` must iterate the list (not a stored count of blocks).

Width (``width_scheme`` other than None) only where every tensor can be mapped with certainty, otherwise a
``ValueError`` at plan time (the callback's ``setup``) that lists the tensors and says to pass ``width_scheme=None``:

- the network makes its own hidden stream and reads it (:func:`stream_ends`): it holds an input projection to
  ``d_model`` (an ``nn.Embedding`` of width ``d_model``, an ``nn.Linear`` or ``groups=1`` convolution writing
  ``d_model`` features from another number) and a head reading it (an ``nn.Linear`` from ``d_model`` to another
  number of features), outside the block list. A network whose ``forward`` takes ``d_model``-wide hidden states from
  outside or returns them to code outside it (a bare ``nn.TransformerEncoder`` / ``nn.TransformerDecoder`` or list of
  blocks held by a LightningModule that owns the embedding and the head) is refused: the small network would be fed,
  or would feed, tensors of the full width;
- the blocks are exactly ``nn.TransformerEncoderLayer`` or ``nn.TransformerDecoderLayer`` (:data:`TORCH_LAYER_TABLE`:
  packed ``in_proj_weight [3·d_model, d_model]`` = ``[Q; K; V]``, ``out_proj``, ``linear1`` / ``linear2``,
  ``norm1`` / ``norm2`` / ``norm3``; heads of ``d_model / nhead`` merged whole, the head size kept);
- every tensor outside the list is one of (``H`` = ``d_model``): an ``nn.Embedding`` table (its output is the
  hidden stream when its width is ``H``), an ``nn.Linear`` reading ``H`` features (a head: input rule) or writing
  them (an input projection: output rule), an ``nn.LayerNorm`` / ``nn.RMSNorm`` over ``H``, an ``nn.Conv1d/2d/3d``
  writing ``H`` channels (patch embedding), a token-shaped parameter ``[1, ..., N, H]`` (position embedding, class
  token: output rule on the last axis), or a tensor with no axis of size ``H`` (copied). Refused as ambiguous: an
  ``nn.Linear`` or convolution with ``H`` on both sides, a ``[N, H]`` or ``[H]`` parameter (a table added to the
  stream, or a weight read from it?), a buffer with an axis of ``H`` (a fixed tensor, e.g. a sinusoidal position
  table, that coalescing would change), an integer attribute equal to ``H`` on a module class defined outside PyTorch
  (a size the small network would keep), any other module with an axis of ``H`` (e.g. an ``nn.MultiheadAttention``
  pooling head), a tensor shared by modules of different roles (but a tied embedding / output head);
- the de-coalesced network has the original shapes; width de-coalescing with pairs is function-preserving (the
  hidden stream is duplicated, every LayerNorm, attention head and FFN neuron sees copies).
  ``nn.TransformerDecoderLayer`` cross-attention reads ``memory`` with the hidden map: the memory must be computed
  inside the network (e.g. by embeddings of the same width); a memory passed in from outside at full width does not
  fit the small network (use ``width_scheme=None``).

Embedding conventions: an untied ``nn.Embedding`` table is mapped by the plain embedding rule under both conventions
(the paper's code doubles every table because its BERT's embedding LayerNorm cancels the factor; a hand-written
network has no such guarantee, and without the factor width de-coalescing is exact). A table tied to an output head
(an ``nn.Linear`` holding the same weight) gets ``×2`` under ``"official"`` (the sum the head needs; the embedding
output is doubled, as in the paper's code); ``"exact"`` with a tie raises (the LayerNorm that feeds the head is
unknown).

Example::

    from lightning_effi import VCycleCallback

    class EncoderClassifier(pl.LightningModule):     # self.net: embedding, nn.TransformerEncoder, a linear head
        ...

    trainer = pl.Trainer(callbacks=[VCycleCallback(e_a="0.2dur", e_small="0.4dur")])  # width and depth halved
    # a network with custom blocks: VCycleCallback(..., width_scheme=None) (depth only)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_effi.models import registry
from lightning_effi.models.vcycle_base import (
    COPY,
    ArchSizes,
    ParamSpec,
    TableContext,
    VCycleAdapter,
    input_only,
    linear,
    register_vcycle_adapter,
    vector,
)
from lightning_effi.vcycle.operators import DepthScheme, VCyclePlan, WidthScheme, layer_key

__all__ = [
    "FAMILY",
    "TORCH_LAYERS",
    "TORCH_LAYER_TABLE",
    "BlockList",
    "TorchBlocksVCycleAdapter",
    "block_lists",
    "find_block_list",
    "stream_ends",
]

#: the registered family name
FAMILY = "torch_blocks"

#: PyTorch's transformer layers, the blocks whose width the adapter maps
TORCH_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)

_ATTENTION = {
    "in_proj_weight": linear("QKV", "E"),
    "in_proj_bias": vector("QKV"),
    "out_proj.weight": linear("E", "V"),
    "out_proj.bias": vector("E"),
}

#: per-block table of ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` (state-dict keys inside a block;
#: ``multihead_attn`` and ``norm3`` are the decoder's cross-attention): ``Linear.weight`` is out × in, the packed
#: ``in_proj_weight`` is ``[Q; K; V]`` with heads of ``d_model / nhead`` rows in order (``nn.MultiheadAttention``)
TORCH_LAYER_TABLE: dict[str, ParamSpec] = {
    **{f"self_attn.{k}": v for k, v in _ATTENTION.items()},
    **{f"multihead_attn.{k}": v for k, v in _ATTENTION.items()},
    "linear1.weight": linear("I", "E"),
    "linear1.bias": vector("I"),
    "linear2.weight": linear("E", "I"),
    "linear2.bias": vector("E"),
    **{f"norm{i}.{k}": vector("E") for i in (1, 2, 3) for k in ("weight", "bias")},
}

_EMBEDDING = vector("E", 1)
_HEAD = input_only("E")
_LINEAR_OUT = ParamSpec(((0, "E", "out"),))
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NORMS = (nn.LayerNorm, nn.RMSNorm)


# ---------------------------------------------------------------------------------------------------------------------
# the block list


@dataclass(frozen=True)
class BlockList:
    """One ``nn.ModuleList`` / ``nn.Sequential`` of identical blocks inside a network.

    Attributes:
        name: its dotted path in the network (``"encoder.layers"``; ``""`` when the network is the list).
        container: the list module. blocks: its blocks, in order.
    """

    name: str
    container: nn.Module
    blocks: tuple[nn.Module, ...]

    @classmethod
    def at(cls, model: nn.Module, name: str) -> BlockList:
        """The list at ``name`` in ``model`` (for a subclass's :meth:`TorchBlocksVCycleAdapter.block_list`).

        Raises:
            ValueError: no such submodule, not an ``nn.ModuleList`` / ``nn.Sequential``, or not a list of at least 2
                identical blocks (the conditions of :func:`block_lists`).
        """
        try:
            container = model.get_submodule(name) if name else model
        except AttributeError as err:
            raise ValueError(f"{FAMILY}: {type(model).__name__} has no submodule {name!r} ({err})") from None
        why = _not_a_block_list(container)
        if why:
            raise ValueError(f"{FAMILY}: {type(model).__name__}.{name or '<root>'} is not a list of blocks: {why}")
        return cls(name, container, tuple(container.children()))

    @property
    def prefix(self) -> str:
        """State-dict prefix of the blocks (``"encoder.layers."``; ``""`` for the network itself)."""
        return f"{self.name}." if self.name else ""

    def describe(self) -> str:
        where = repr(self.name) if self.name else "the network itself"
        return f"{where} ({len(self.blocks)} x {type(self.blocks[0]).__name__})"

    def owns(self, path: str) -> bool:
        """Whether the module path ``path`` is the list or inside it."""
        return not self.name or path == self.name or path.startswith(self.prefix)


def _is_block(module: nn.Module) -> bool:
    """A module with a parameter that is composite or of a class defined outside PyTorch (not a bare ``nn.Linear``)."""
    if next(module.parameters(), None) is None:
        return False
    return bool(module._modules) or type(module).__module__.split(".")[0] != "torch"


def _signature(module: nn.Module) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
    return tuple((k, tuple(t.shape), t.dtype) for k, t in module.state_dict().items())


def _not_a_block_list(container: nn.Module) -> str:
    """Why ``container`` is not a list of identical blocks (``""`` when it is one)."""
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        return f"a {type(container).__name__}, not an nn.ModuleList / nn.Sequential"
    blocks = list(container.children())
    if len(blocks) < 2 or len(blocks) != len(container._modules):
        return f"{len(blocks)} distinct block(s), at least 2 needed"
    if len({type(b) for b in blocks}) != 1:
        return f"blocks of several classes {sorted({type(b).__name__ for b in blocks})}"
    if not _is_block(blocks[0]):
        return f"{type(blocks[0]).__name__} is a single PyTorch layer or has no parameter"
    sig = _signature(blocks[0])
    if any(_signature(b) != sig for b in blocks[1:]):
        return "the blocks' state-dict names, shapes or dtypes differ"
    return ""


def _longest_list_of_one_class(model: nn.Module, reason: Callable[[str], bool]) -> tuple[str, list[nn.Module]] | None:
    """The longest ``nn.ModuleList`` / ``nn.Sequential`` of ``model`` holding at least 2 modules of one class that is
    no list of blocks for a reason (:func:`_not_a_block_list`) ``reason`` accepts, as ``(name, its modules)``."""
    near = [
        (name, list(m.children()))
        for name, m in model.named_modules()
        if isinstance(m, (nn.ModuleList, nn.Sequential))
        and len(list(m.children())) >= 2
        and len({type(b) for b in m.children()}) == 1
        and reason(_not_a_block_list(m))
    ]
    return max(near, key=lambda item: len(item[1])) if near else None


def single_layer_list(model: nn.Module) -> str | None:
    """For a network with no list of identical blocks: the longest ``nn.ModuleList`` / ``nn.Sequential`` of at least
    2 single PyTorch layers of one class (a GNN's ``nn.Linear`` per hop), as a phrase for an error message naming the
    remedy; None when there is none (the refusal named no reason, qa54-domains 05)."""
    found = _longest_list_of_one_class(model, lambda why: "single PyTorch layer" in why)
    if found is None:
        return None
    name, layers = found
    return (
        f"its list {name!r} holds {len(layers)} single {type(layers[0]).__name__} layers, not blocks: the V-cycle "
        "coalesces a list of blocks, each a module of your own around its layers (wrap each layer, with its "
        "activation or norm, in one)"
    )


def unequal_block_list(model: nn.Module) -> str | None:
    """For a network with no list of identical blocks: the longest ``nn.ModuleList`` / ``nn.Sequential`` of at least
    2 blocks of one class whose blocks differ, with the first difference (e.g. T5's first block alone holds the
    relative position bias table), as a phrase for an error message; None when there is none."""
    found = _longest_list_of_one_class(
        model, lambda why: why == "the blocks' state-dict names, shapes or dtypes differ"
    )
    if found is None:
        return None
    name, blocks = found
    first = {k: (tuple(t.shape), t.dtype) for k, t in blocks[0].state_dict().items()}
    for i, block in enumerate(blocks[1:], start=1):
        other = {k: (tuple(t.shape), t.dtype) for k, t in block.state_dict().items()}
        if other == first:
            continue
        only = sorted(set(first) - set(other)) or sorted(set(other) - set(first))
        where = "block 0" if set(first) - set(other) else f"block {i}"
        diff = (
            f"{where} alone holds {only[0]}"
            if only
            else f"{next(k for k in first if first[k] != other[k])} differs between block 0 and block {i}"
        )
        return (
            f"its list {name!r} ({len(blocks)} x {type(blocks[0]).__name__}) is not of identical blocks ({diff}), so "
            "its depth cannot be coalesced by averaging blocks"
        )
    return None


def block_lists(model: nn.Module) -> list[BlockList]:
    """Every list of identical blocks in ``model`` that is not nested inside a block of another one, longest first
    (see the module docstring for what counts as a list of identical blocks)."""
    found = [
        BlockList(name, m, tuple(m.children()))
        for name, m in model.named_modules()
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and not _not_a_block_list(m)
    ]
    outer = [c for c in found if not any(o is not c and o.owns(c.name) for o in found)]
    return sorted(outer, key=lambda c: -len(c.blocks))


def find_block_list(model: nn.Module) -> BlockList:
    """The one list of identical blocks the V-cycle coalesces: the longest of :func:`block_lists`.

    Raises:
        ValueError: no such list; several equally long ones (named, with what to do).
    """
    lists = block_lists(model)
    if not lists:
        raise ValueError(
            f"{FAMILY}: {type(model).__name__} holds no nn.ModuleList / nn.Sequential of at least 2 identical blocks "
            "(one class, distinct modules with the same parameter names and shapes): the V-cycle coalesces the depth "
            "of such a list"
        )
    longest = [c for c in lists if len(c.blocks) == len(lists[0].blocks)]
    if len(longest) > 1:
        raise ValueError(
            f"{FAMILY}: {type(model).__name__} holds {len(longest)} equally long lists of identical blocks: "
            f"{', '.join(c.describe() for c in longest)}; the V-cycle coalesces one list and cannot tell which. "
            "Subclass lightning_effi.models.torch_transformer.TorchBlocksVCycleAdapter with "
            "block_list = lambda self, model: BlockList.at(model, '<path>') and pass an instance as "
            "VCycleCallback(adapter=...)"
        )
    return longest[0]


# ---------------------------------------------------------------------------------------------------------------------
# the adapter


@register_vcycle_adapter
class TorchBlocksVCycleAdapter(VCycleAdapter):
    """V-cycle map of a hand-written network with one list of identical blocks (module docstring): depth for any
    blocks, width for ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` blocks when every other tensor
    can be mapped with certainty.

    It does not match a network that holds a module another registered V-cycle adapter handles (HF GPT-2 / BERT,
    timm ViT keep their own maps, whatever the registration order).
    """

    name = FAMILY
    default_alpha_original = 0.25
    models = (
        "any network with one nn.ModuleList / nn.Sequential of >= 2 identical blocks, e.g. nn.TransformerEncoder."
        "layers (depth; width for nn.TransformerEncoderLayer / nn.TransformerDecoderLayer blocks)"
    )

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        """A list of identical blocks (:func:`block_lists`; several equally long ones match too and are refused by
        :meth:`plan` with their names), and no module of ``model`` handled by another registered V-cycle adapter."""
        if not block_lists(model):
            return False
        others: list[type[VCycleAdapter]] = [
            c
            for c in registry.adapters("vcycle").values()
            if isinstance(c, type) and issubclass(c, VCycleAdapter) and not (issubclass(c, cls) or issubclass(cls, c))
        ]
        return not any(o.matches(m) for _, m in model.named_modules() for o in others)

    def block_list(self, model: nn.Module) -> BlockList:
        """The list the V-cycle coalesces (:func:`find_block_list`); override to choose another one."""
        return find_block_list(model)

    def sizes(self, model: nn.Module) -> ArchSizes:
        """``d_model``, ``nhead``, ``dim_feedforward`` of PyTorch's layers (1, 1, 1 for other blocks: depth only) and
        the number of blocks; the depth key in messages is ``len(<list path>)``."""
        found = self.block_list(model)
        depth_key = f"len({found.name or type(model).__name__})"
        b0 = found.blocks[0]
        if isinstance(b0, TORCH_LAYERS):
            keys = ("d_model", "nhead", "dim_feedforward", depth_key)
            attn = b0.self_attn
            return ArchSizes(
                int(attn.embed_dim), int(attn.num_heads), int(b0.linear1.out_features), len(found.blocks), keys
            )
        return ArchSizes(1, 1, 1, len(found.blocks), ("hidden", "heads", "ffn", depth_key))

    def layer_prefix(self, model: nn.Module) -> str:
        return self.block_list(model).prefix

    def plan(
        self,
        model: nn.Module,
        width_scheme: WidthScheme | None = "half",
        depth_scheme: DepthScheme | None = "adjacent",
        embedding_convention: str = "official",
    ) -> VCyclePlan:
        """:meth:`VCycleAdapter.plan` for the block list of ``model``; ``info`` also holds ``"blocks"`` (the list's
        path) and ``"width"`` (whether the width changes).

        Raises:
            ValueError: no block list or several equally long ones; width coalescing (``width_scheme`` not None) of
                blocks other than PyTorch's layers, of layers with different head counts, of a network without an
                input projection to ``d_model`` or a head reading it (:func:`stream_ends`: its hidden states come from
                or go to code outside it), or of a network with tensors that cannot be mapped with certainty (listed;
                the messages say to pass ``width_scheme=None``); ``embedding_convention="exact"`` with a tied
                embedding / head under width coalescing; tensors shared between blocks or between a block and the
                rest; the errors of :meth:`VCycleAdapter.plan` (sizes a scheme cannot halve, named ``nhead``,
                ``d_model``, ``dim_feedforward`` or ``len(<list>)``); a depth change of blocks whose kinds differ
                along a group (a Hugging Face ``config.layer_types``, e.g. sliding-window and full attention,
                :func:`_check_layer_kinds`).
        """
        found = self.block_list(model)
        torch_layers = type(found.blocks[0]) in TORCH_LAYERS
        if width_scheme is not None:
            if not torch_layers:
                raise ValueError(
                    f"{FAMILY}: width_scheme={width_scheme!r}: width coalescing maps nn.TransformerEncoderLayer / "
                    f"nn.TransformerDecoderLayer blocks only (their parameters are known); the blocks of "
                    f"{found.describe()} in {type(model).__name__} cannot be mapped with certainty. Pass "
                    "width_scheme=None to coalesce the depth only (VCycleCallback(width_scheme=None)), or write a "
                    "V-cycle adapter for your network, which maps the width of any block whose parameters it "
                    "names: subclass lightning_effi.models.vcycle_base.VCycleAdapter (matches, sizes, layer_prefix, "
                    "param_table, build_small; that module's docstring says how) and pass it as "
                    "VCycleCallback(adapter=...)"
                )
            heads = {
                int(m.num_heads) for b in found.blocks for m in b.modules() if isinstance(m, nn.MultiheadAttention)
            }
            if len(heads) > 1:
                raise ValueError(
                    f"{FAMILY}: the blocks of {found.describe()} have different head counts {sorted(heads)}; width "
                    "coalescing needs one; pass width_scheme=None to coalesce the depth only"
                )
        plan = super().plan(model, width_scheme, depth_scheme, embedding_convention)
        _check_layer_kinds(model, found, plan.depth)
        info: dict[str, Any] = dict(plan.info)
        large, small = dict(info["large"]), dict(info["small"])
        info["width"] = large["hidden"] != small["hidden"]
        if not isinstance(found.blocks[0], TORCH_LAYERS):  # no sizes to report
            for sizes in (large, small):
                sizes.update(hidden=None, heads=None, ffn=None)
        info.update(large=large, small=small, blocks=found.name)
        return dataclasses.replace(plan, info=info)

    def param_table(self, model: nn.Module, ctx: TableContext) -> tuple[dict[str, ParamSpec], dict[str, ParamSpec]]:
        """Depth only (identity width maps): every tensor copied (the depth step averages the blocks). Width:
        :data:`TORCH_LAYER_TABLE` for the blocks, :meth:`outside_rows` for the rest."""
        found = self.block_list(model)
        _check_sharing(model, found, ctx.aliases)
        keys = list(model.state_dict())
        outside = [k for k in keys if layer_key(k, found.prefix) is None]
        if ctx.maps.hidden.is_identity:
            return {k: COPY for k in outside}, {k: COPY for k in found.blocks[0].state_dict()}
        return self.outside_rows(model, found, ctx), dict(TORCH_LAYER_TABLE)

    def outside_rows(self, model: nn.Module, found: BlockList, ctx: TableContext) -> dict[str, ParamSpec]:
        """The width rules of the tensors outside the block list (module docstring), keyed by state-dict key.

        Raises:
            ValueError: no input projection to ``d_model`` or no head reading it outside the blocks
                (:func:`stream_ends`); tensors that cannot be mapped with certainty (listed), ``"exact"`` with a tied
                embedding / head; the messages say to pass ``width_scheme=None``.
        """
        hidden = ctx.maps.hidden.large
        inputs, heads = stream_ends(model, found, hidden)
        if not inputs or not heads:
            missing = []
            if not inputs:
                missing.append(
                    f"no input projection to d_model={hidden} (an nn.Embedding of width {hidden}, an nn.Linear or "
                    f"convolution writing {hidden} features), so its forward takes {hidden}-wide hidden states from "
                    "outside it"
                )
            if not heads:
                embeddings = [
                    n for n in inputs if isinstance(model.get_submodule(n.replace("<root>", "")), nn.Embedding)
                ]
                tying = (
                    f" (a head written as F.linear(h, self.{embeddings[0]}.weight), weight tying by hand, is not "
                    "seen: hold it as a tied nn.Linear, head = nn.Linear(d_model, vocab_size, bias=False) with "
                    f"head.weight = self.{embeddings[0]}.weight, and width coalescing maps it as the embedding)"
                    if embeddings and inputs
                    else ""
                )
                # a Linear(d_model, d_model) outside the blocks (a CLIP tower's projection into a joint space of
                # its width): a head or not cannot be told; it was not named (qa111-multimodal 03)
                inside = {id(m) for m in found.container.modules()}
                square = [
                    n
                    for n, m in model.named_modules()
                    if isinstance(m, nn.Linear) and m.in_features == m.out_features == hidden and id(m) not in inside
                ]
                ambiguous = (
                    f" (its nn.Linear({hidden}, {hidden}) {', '.join(square)} reads and writes d_model features: "
                    "whether its output is the coalesced stream or a width of its own that must stay cannot be told; "
                    "an output width other than d_model, or width_scheme=None, tells it)"
                    if square
                    else ""
                )
                missing.append(
                    f"no head reading d_model={hidden} (an nn.Linear with in_features={hidden} and another "
                    f"out_features), so its {hidden}-wide output is read by code outside it{tying}{ambiguous}"
                )
            raise ValueError(
                f"{FAMILY}: width coalescing of {type(model).__name__} (the network the V-cycle coalesces, blocks "
                f"{found.describe()}) is refused: it has {'; and it has '.join(missing)}. The small network (d_model="
                f"{ctx.maps.hidden.small}) would be fed or would feed tensors of the full width (PyTorch's 'was "
                "expecting embedding dimension' error at the first coarse step), e.g. a LightningModule holding the "
                "embedding and the head around self.encoder = nn.TransformerEncoder(...). Pass width_scheme=None "
                "(VCycleCallback(width_scheme=None)) to coalesce the depth only, or move the embedding and the head "
                "into one nn.Module with the blocks and let the V-cycle coalesce that one (VCycleCallback(model_attr="
                "'<its attribute>'))"
            )
        rows, problems = _outside_rows(model, found, ctx)
        if problems:
            listed = "".join(f"\n  - {p}" for p in problems)
            raise ValueError(
                f"{FAMILY}: width coalescing of {type(model).__name__} maps every tensor outside {found.describe()} "
                f"with certainty or not at all; these cannot be mapped (d_model={ctx.maps.hidden.large}):{listed}\n"
                "Pass width_scheme=None to coalesce the depth only (every tensor outside the blocks is then kept as "
                "it is), or subclass TorchBlocksVCycleAdapter and extend outside_rows()"
            )
        return rows

    def build_small(self, model: nn.Module, plan: VCyclePlan) -> nn.Module:
        """A deep copy of ``model`` with the plan's small depth (the blocks past it dropped, ``num_layers`` of an
        ``nn.TransformerEncoder`` / ``nn.TransformerDecoder`` updated) and, when the width changes, fresh PyTorch
        layers of the small width (same activation, dropout, eps, ``batch_first``, ``norm_first``, bias) and the
        outside tensors with a hidden axis resized (zeros; module sizes such as ``in_features`` and
        ``normalized_shape`` updated). Values are meaningless until the coalesced state dict is loaded. Same dtype,
        device and train/eval mode as ``model``; the large tensors are not copied where they are replaced.

        Raises:
            ValueError: the plan was made for another depth. RuntimeError: the result's shapes differ from the plan's.
        """
        found = self.block_list(model)
        large_depth, small_depth = plan.num_layers
        if large_depth != len(found.blocks):
            raise ValueError(f"{FAMILY}.build_small: the plan is for {large_depth} blocks, not for {found.describe()}")
        width = bool(plan.info.get("width"))
        small_sizes: Mapping[str, Any] = plan.info["small"]  # type: ignore[assignment]
        memo: dict[int, Any] = {}
        for i, block in enumerate(found.blocks):
            if i >= small_depth:
                memo[id(block)] = None  # not copied; removed from the list below
            elif width:
                memo[id(block)] = _small_layer(block, small_sizes["hidden"], small_sizes["heads"], small_sizes["ffn"])
        if width:
            for key, t in _named_tensors(model).items():
                shape = plan.small_shapes.get(key)
                if layer_key(key, found.prefix) is None and shape is not None and tuple(t.shape) != shape:
                    memo.setdefault(id(t), _resized(t, shape))
        for module in model.modules():
            # a tensor of the last step's graph kept as an attribute (an MoE layer's self.aux_loss), in a dict or
            # list attribute (fairseq's l_aux) or in a buffer slot: torch's deepcopy refuses non-leaf tensors, and the
            # level change failed with its bare error (qa49-moe 03, qa51-break 06)
            for value in (*vars(module).values(), *module._buffers.values()):
                _memo_graph_tensors(value, memo)
        small = copy.deepcopy(model, memo)
        container = small.get_submodule(found.name) if found.name else small
        for key in [k for k, v in container._modules.items() if v is None]:
            del container._modules[key]
        parent = small.get_submodule(found.name.rpartition(".")[0]) if "." in found.name else small
        if isinstance(parent, (nn.TransformerEncoder, nn.TransformerDecoder)) and parent.layers is container:
            parent.num_layers = small_depth
            if width and isinstance(parent, nn.TransformerEncoder) and small_sizes["heads"] % 2:
                parent.use_nested_tensor = False  # as its constructor decides for an odd number of heads
        if width:
            _resize_modules(small, found, int(plan.info["large"]["hidden"]), int(small_sizes["hidden"]))  # type: ignore[index]
        return self._finish(model, small, plan)


# ---------------------------------------------------------------------------------------------------------------------
# helpers


#: how deep :func:`_memo_graph_tensors` looks into an attribute's dicts, lists and tuples
_MEMO_DEPTH = 3


def _memo_graph_tensors(value: Any, memo: dict[int, Any], depth: int = 0) -> None:
    """Put a detached copy in ``memo`` (``copy.deepcopy``'s) of every tensor of an autograd graph in ``value``, itself
    or inside its dicts, lists and tuples (:data:`_MEMO_DEPTH` levels): a copy of the module gets the values without
    the graph."""
    if isinstance(value, torch.Tensor):
        if value.grad_fn is not None:
            memo.setdefault(id(value), value.detach())
    elif depth < _MEMO_DEPTH and isinstance(value, dict):
        for item in value.values():
            _memo_graph_tensors(item, memo, depth + 1)
    elif depth < _MEMO_DEPTH and isinstance(value, (list, tuple)):
        for item in value:
            _memo_graph_tensors(item, memo, depth + 1)


def _check_layer_kinds(model: nn.Module, found: BlockList, depth: Sequence[Sequence[int]]) -> None:
    """Refuse a depth change the network's per-layer kinds contradict: a Hugging Face config's ``layer_types``
    (``"full_attention"`` / ``"sliding_attention"``: Qwen2, Mistral, Gemma 2/3, ...) is read by position, by the model
    (block ``i``'s mask) and by each block (made from block ``i``), so coarse block ``i`` runs the kind of block ``i``
    whatever its group (``depth[i]``) held. A coarse block of sliding-window layers ran with full attention, in silence
    (qa102-nlp 06). Nothing is refused when every group's blocks are of block ``i``'s kind, or the depth is kept.

    Raises:
        ValueError: naming ``config.layer_types`` and the first coarse block whose group holds another kind.
    """
    if len(depth) == len(found.blocks):
        return
    kinds = next(
        (
            list(k)
            for m in model.modules()
            if isinstance(k := getattr(getattr(m, "config", None), "layer_types", None), (list, tuple))
            and len(k) >= len(found.blocks)
        ),
        None,
    )
    if kinds is None:
        return
    for i, group in enumerate(depth):
        held = [kinds[j] for j in group]
        if any(kind != kinds[i] for kind in held):
            raise ValueError(
                f"{FAMILY}: depth coalescing of {type(model).__name__} is refused: its config gives each layer a kind "
                f"(config.layer_types = {kinds[: len(found.blocks)]}), read by position, so coarse block {i} would run "
                f"as a {kinds[i]!r} layer where its group, blocks {list(group)} of {found.describe()}, holds "
                f"{held}. Train a model whose layers are all of one kind (e.g. use_sliding_window=False), or write a "
                "V-cycle adapter for this architecture that rebuilds the coarse model's config (subclass "
                "lightning_effi.models.torch_transformer.TorchBlocksVCycleAdapter and extend build_small)"
            )


def _check_sharing(model: nn.Module, found: BlockList, aliases: Mapping[str, str]) -> None:
    """Raises ValueError: tensors shared between two blocks or between a block and the rest of the network."""
    bad = []
    for alias, canon in aliases.items():
        la, lc = layer_key(alias, found.prefix), layer_key(canon, found.prefix)
        if (la is None) != (lc is None) or (la is not None and lc is not None and la[0] != lc[0]):
            bad.append(f"{alias} = {canon}")
    if bad:
        raise ValueError(
            f"{FAMILY}: {type(model).__name__} shares tensors between blocks of {found.describe()} or between a block "
            f"and the rest of the network: {bad}; the V-cycle averages and drops blocks, so every block must own its "
            "tensors"
        )


def _named_tensors(model: nn.Module) -> dict[str, Tensor]:
    out: dict[str, Tensor] = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    return out


def stream_ends(model: nn.Module, found: BlockList, hidden: int) -> tuple[list[str], list[str]]:
    """Where the network's hidden stream of width ``hidden`` (``d_model``) starts and ends, outside the block list
    ``found``: ``(inputs, heads)``, the module paths of

    - inputs: an ``nn.Embedding`` with ``embedding_dim == hidden``, an ``nn.Linear`` with ``out_features == hidden !=
      in_features``, an ``nn.Conv1d/2d/3d`` with ``out_channels == hidden != in_channels`` and ``groups == 1``;
    - heads: an ``nn.Linear`` with ``in_features == hidden != out_features``.

    Width coalescing needs both (module docstring): without an input the network's ``forward`` reads ``hidden``-wide
    states made outside it, without a head its ``hidden``-wide output is read outside it, and neither side is resized.
    Module paths are relative to ``model`` (``"<root>"`` for the network itself)."""
    inputs: list[str] = []
    heads: list[str] = []
    for path, module in model.named_modules():
        if found.owns(path):
            continue
        name = path or "<root>"
        if isinstance(module, nn.Embedding) and module.embedding_dim == hidden:
            inputs.append(name)
        elif isinstance(module, nn.Linear):
            if module.out_features == hidden != module.in_features:
                inputs.append(name)
            elif module.in_features == hidden != module.out_features:
                heads.append(name)
        elif type(module) in _CONVS:
            conv: Any = module
            if conv.out_channels == hidden != conv.in_channels and conv.groups == 1:
                inputs.append(name)
    return inputs, heads


def _token_shaped(shape: tuple[int, ...], hidden: int) -> bool:
    """``[1, ..., N, H]``: a batch of token vectors (position embedding, class token), ``H`` on the last axis only."""
    return len(shape) >= 3 and shape[-1] == hidden and hidden not in shape[:-1] and all(s == 1 for s in shape[:-2])


def _outside_rows(model: nn.Module, found: BlockList, ctx: TableContext) -> tuple[dict[str, ParamSpec], list[str]]:
    """Width rules of the tensors outside ``found`` and the list of tensors that cannot be mapped with certainty."""
    hidden = ctx.maps.hidden.large
    rows: dict[str, ParamSpec] = {}
    problems: list[str] = []
    for path, module in model.named_modules(remove_duplicate=False):
        if found.owns(path):
            continue
        pre, kind = (f"{path}." if path else ""), type(module).__name__
        params = {n: p for n, p in module._parameters.items() if p is not None}
        done: set[str] = set()
        if isinstance(module, nn.Embedding) and "weight" in params:
            rows[pre + "weight"] = _EMBEDDING if module.embedding_dim == hidden else COPY
            done.add("weight")
        elif isinstance(module, nn.Linear):
            out_f, in_f = module.out_features, module.in_features
            if in_f == hidden and out_f == hidden:
                problems.append(
                    f"{pre}weight (Linear {in_f} -> {out_f}): reads and writes d_model features (a map of the hidden "
                    f"stream, or a projection of another input of {hidden} features?)"
                )
            elif in_f == hidden:  # a head reading the hidden stream
                rows.update({pre + "weight": _HEAD, pre + "bias": COPY})
            elif out_f == hidden:  # an input projection writing it
                rows.update({pre + "weight": _LINEAR_OUT, pre + "bias": vector("E")})
            else:
                rows.update({pre + "weight": COPY, pre + "bias": COPY})
            done.update(("weight", "bias"))
        elif isinstance(module, _NORMS):
            shape = tuple(module.normalized_shape)
            if shape == (hidden,):
                rows.update({pre + "weight": vector("E"), pre + "bias": vector("E")})
            elif hidden in shape:
                problems.append(
                    f"{pre[:-1] or '<root>'} ({kind} over {list(shape)}): normalizes more than the hidden axis"
                )
            else:
                rows.update({pre + "weight": COPY, pre + "bias": COPY})
            done.update(("weight", "bias"))
        elif type(module) in _CONVS:
            conv: Any = module
            if conv.in_channels == hidden or (conv.out_channels == hidden and conv.groups != 1):
                problems.append(
                    f"{pre}weight ({kind} {conv.in_channels} -> {conv.out_channels} channels, groups={conv.groups}): "
                    "reads d_model channels or groups them"
                )
            elif conv.out_channels == hidden:  # a patch embedding writing the hidden stream
                rows.update({pre + "weight": vector("E", 0), pre + "bias": vector("E")})
            else:
                rows.update({pre + "weight": COPY, pre + "bias": COPY})
            done.update(("weight", "bias"))
        elif type(module).__module__.split(".")[0] != "torch":
            problems.extend(_attribute_problems(path, module, hidden))
        for name, p in params.items():
            if name in done:
                continue
            shape = tuple(p.shape)
            if hidden not in shape:
                rows[pre + name] = COPY
            elif _token_shaped(shape, hidden):
                rows[pre + name] = vector("E", -1)
            elif len(shape) >= 3 and shape[-1] == hidden and all(s == 1 for s in shape[:-2]):
                problems.append(
                    f"{pre}{name} (parameter of shape {list(shape)} on {kind}): its token axis N = {shape[-2]} equals "
                    f"d_model = {hidden}, so the shape cannot tell a [1, ..., N, d_model] table added to the hidden "
                    "stream (a learned position table: d_model last) from a [d_model, d_model] weight read from it. "
                    "A table: map it in an adapter subclass (its param_table entry vector('E', -1)), or give the table "
                    "another length than d_model"
                )
            else:
                problems.append(
                    f"{pre}{name} (parameter of shape {list(shape)} on {kind}): an axis of d_model that is not the "
                    f"last axis of a token-shaped [1, ..., N, {hidden}] tensor (a table added to the hidden stream, "
                    "or a weight read from it?)"
                )
        for name, b in module._buffers.items():
            if b is None:
                continue
            if hidden in tuple(b.shape):
                problems.append(
                    f"{pre}{name} (buffer of shape {list(b.shape)} on {kind}): a fixed tensor with an axis of d_model "
                    "that coalescing would change"
                )
            elif name not in module._non_persistent_buffers_set:
                rows[pre + name] = COPY
    problems.extend(_tie_problems(rows, found, ctx))
    return rows, problems


def _attribute_problems(path: str, module: nn.Module, hidden: int) -> list[str]:
    """Integer (or tuple / list of integers) attributes equal to ``hidden`` and plain tensor attributes with an axis of
    ``hidden`` on a module of a class defined outside PyTorch: sizes the small network would keep."""
    out = []
    for name, value in vars(module).items():
        if name.startswith("_"):
            continue
        ints = value if isinstance(value, (tuple, list)) else [value]
        if any(type(v) is int and v == hidden for v in ints):
            out.append(
                f"{path or '<root>'}.{name} = {value!r} ({type(module).__name__}): equals d_model, a size the small "
                "network would keep"
            )
        elif isinstance(value, Tensor) and hidden in tuple(value.shape):
            out.append(
                f"{path or '<root>'}.{name} (tensor attribute of shape {list(value.shape)} on "
                f"{type(module).__name__}): an axis of d_model that the V-cycle cannot map"
            )
    return out


def _tie_problems(rows: dict[str, ParamSpec], found: BlockList, ctx: TableContext) -> list[str]:
    """Settle the rule of every tensor held under several names outside the blocks (``rows`` updated in place): one
    rule for all names, or an embedding table tied to an output head (``"official"``: the table ×c)."""
    groups: dict[str, list[str]] = {}
    for alias, canon in ctx.aliases.items():
        groups.setdefault(canon, [canon]).append(alias)
    problems = []
    for canon, keys in groups.items():
        if layer_key(canon, found.prefix) is not None or any(k not in rows for k in keys):
            continue  # inside a block (same rule by construction), or already a problem
        specs = {rows[k] for k in keys}
        if len(specs) == 1:
            continue
        if specs == {_EMBEDDING, _HEAD}:
            if ctx.convention == "exact":
                problems.append(
                    f"{', '.join(keys)}: an embedding table tied to an output head under embedding_convention='exact' "
                    "(the LayerNorm that feeds the head is unknown); use embedding_convention='official'"
                )
            else:
                rows[canon] = vector("E", 1, ctx.embedding_scale)
            continue
        problems.append(f"{', '.join(keys)}: one tensor shared by modules of different roles")
    return problems


def _small_layer(layer: nn.Module, d_model: int, nhead: int, ffn: int) -> nn.Module:
    """A fresh PyTorch transformer layer like ``layer`` with the small sizes (on the CPU in float32)."""
    assert isinstance(layer, TORCH_LAYERS)
    small = type(layer)(
        d_model=d_model,
        nhead=nhead,
        dim_feedforward=ffn,
        dropout=float(layer.dropout.p),
        activation=layer.activation,
        layer_norm_eps=float(layer.norm1.eps),
        batch_first=bool(layer.self_attn.batch_first),
        norm_first=bool(layer.norm_first),
        bias=layer.linear1.bias is not None,
    )
    for name in ("dropout", "dropout1", "dropout2", "dropout3"):  # the rates as they are now
        if hasattr(layer, name):
            setattr(small, name, copy.deepcopy(getattr(layer, name)))
    for name in ("self_attn", "multihead_attn"):
        if hasattr(layer, name):
            getattr(small, name).dropout = getattr(layer, name).dropout
    if isinstance(layer.activation, nn.Module):  # the constructor keeps the instance: not shared with the large one
        small.activation = copy.deepcopy(layer.activation)
    return small


def _resized(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    new = torch.zeros(shape, dtype=t.dtype, device=t.device)
    return nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new


def _resize_modules(small: nn.Module, found: BlockList, hidden: int, small_hidden: int) -> None:
    """The sizes of PyTorch modules outside the blocks whose tensors were resized (``normalized_shape`` matters in
    ``forward``; the others keep ``repr`` true)."""
    for path, m in small.named_modules():
        if found.owns(path):
            continue
        if isinstance(m, nn.Linear):
            m.out_features, m.in_features = (int(s) for s in m.weight.shape)
        elif isinstance(m, nn.Embedding):
            m.embedding_dim = int(m.weight.shape[1])
        elif isinstance(m, _NORMS) and tuple(m.normalized_shape) == (hidden,):
            m.normalized_shape = (small_hidden,)
        elif type(m) in _CONVS:
            m.out_channels = int(m.weight.shape[0])
