"""The V-cycle's operators as pure functions of state dicts (torch only, no Lightning): :func:`coalesce` (large →
small), :func:`decoalesce` (small → large) and :func:`interpolate`; the width and depth partitions and
:class:`VCyclePlan` that say which tensor gets which map; and the model-level steps the callback takes at a level
change (:func:`snapshot`, :func:`plan_levels`, :func:`coalesce_model`, :func:`decoalesce_model`, :func:`build_levels`).

Zou, Zhang, Deng, "A Multi-Level Framework for Accelerating Training Transformer Models", ICLR 2024; official code
``Photooon/Multi-Level-Training-Framework``, ``map_tools/mapper.py``. The map matrices, exactness and function
preservation are described in the method card, ``README.md`` beside this file ("Operators").
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from numbers import Real
from typing import Literal

import torch
from torch import Tensor, nn

from lightning_effi.core.checks import is_int

__all__ = [
    "DepthScheme",
    "Side",
    "TensorRule",
    "TransformerWidthMaps",
    "VCyclePlan",
    "WidthMap",
    "WidthScheme",
    "build_levels",
    "carry_activation_checkpointing",
    "coalesce",
    "coalesce_model",
    "coalesced_requires_grad",
    "decoalesced_requires_grad",
    "mixed_depth_groups",
    "convention_scale",
    "decoalesce",
    "decoalesce_model",
    "depth_groups",
    "first_nonfinite",
    "interpolate",
    "layer_key",
    "plan_levels",
    "requires_grad_flags",
    "set_requires_grad",
    "snapshot",
    "transformer_width_maps",
    "width_groups",
]

#: ``"half"`` (official pairing: unit ``u`` ↔ ``u + U/2``) or explicit groups of units (a partition of ``range(U)``).
WidthScheme = Literal["half"] | Sequence[Sequence[int]]
#: ``"adjacent"`` (paper: (0,1), (2,3), …), ``"half"`` (official config: (0, L/2), (1, L/2+1), …) or explicit groups.
DepthScheme = Literal["adjacent", "half"] | Sequence[Sequence[int]]
#: ``"out"``: coalesce F (average) / de-coalesce T (copy) — output dims, LayerNorm, biases, embedding and token
#: tables on their hidden axis. ``"in"``: coalesce S (sum) / de-coalesce H (split) — input dims of linear maps.
Side = Literal["out", "in"]
EmbeddingConvention = Literal["official", "exact"]
EMBEDDING_CONVENTIONS = ("official", "exact")


# ---------------------------------------------------------------------------------------------------------------------
# partitions


def _validate_partition(groups: object, count: int, what: str, name: str) -> tuple[tuple[int, ...], ...]:
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
        raise ValueError(f"{name}: expected 'half' or a list of {what} groups, got {groups!r}")
    out: list[tuple[int, ...]] = []
    for g in groups:
        if isinstance(g, (str, bytes)) or not isinstance(g, Sequence) or len(g) == 0:
            raise ValueError(f"{name}: every group must be a non-empty list of {what} indices, got {g!r}")
        idx = []
        for j in g:
            if not is_int(j) and not (isinstance(j, Tensor) and j.ndim == 0 and not j.is_floating_point()):
                raise ValueError(f"{name}: {what} indices must be integers, got {j!r} in group {list(g)!r}")
            idx.append(int(j))
        out.append(tuple(idx))
    flat = sorted(j for g in out for j in g)
    if flat != list(range(count)):
        seen: dict[int, int] = {}
        for j in flat:
            seen[j] = seen.get(j, 0) + 1
        dup = sorted(j for j, c in seen.items() if c > 1)
        missing = sorted(set(range(count)) - set(seen))
        extra = sorted(j for j in seen if not 0 <= j < count)
        raise ValueError(
            f"{name}: groups must be a partition of the {count} {what} indices 0..{count - 1}; "
            f"duplicated {dup}, missing {missing}, out of range {extra}"
        )
    return tuple(out)


def width_groups(size: int, scheme: WidthScheme = "half", unit: int = 1, *, name: str = "size") -> WidthMap:
    """The width map of a partition of ``range(size)``, built at the granularity of ``unit``.

    Args:
        size: the large dimension ``D`` (an int, Python or numpy). unit: block size; ``size`` is
            ``U = size / unit`` units (e.g. ``unit = head_dim`` for attention output dims: whole heads are merged).
            scheme: ``"half"`` pairs unit ``u`` with ``u + U/2`` (the official 6-layer config in ``map_tools/config``:
            dim ``j`` ↔ ``j + D/2``); an explicit list gives, per small unit, the large units merged into it (a
            partition of ``range(U)``; groups of 3 or more allowed, weight ``1/|g|``). name: the configuration key
            named in error messages.

    Returns:
        A :class:`WidthMap` with ``d = len(groups) · unit`` small indices: element ``t`` of small unit ``i`` is the
        group ``{g·unit + t for g in groups[i]}``.

    Raises:
        ValueError: ``size`` not a positive multiple of ``unit``; ``"half"`` with an odd number of units; explicit
            groups that are not a partition of ``range(U)`` (duplicates, missing or out-of-range indices, empty
            groups); an unknown scheme string.
    """
    if not is_int(unit) or unit < 1:
        raise ValueError(f"{name}: unit must be a positive integer, got {unit!r}")
    if not is_int(size) or size < 1 or size % unit:
        raise ValueError(f"{name}: size {size!r} is not a positive multiple of the unit {unit}")
    size, unit = int(size), int(unit)
    units = size // unit
    if isinstance(scheme, str):
        if scheme != "half":
            raise ValueError(f"{name}: unknown width scheme {scheme!r}; use 'half' or a list of groups")
        if units % 2:
            what = f"{units} units of {unit}" if unit > 1 else f"{size}"
            raise ValueError(
                f"{name}: width scheme 'half' needs an even size, got {what}; pass explicit groups "
                "(a group of 3 is allowed) or change the model size"
            )
        ugroups: tuple[tuple[int, ...], ...] = tuple((u, u + units // 2) for u in range(units // 2))
    else:
        what = "unit" if unit > 1 else "index"
        ugroups = _validate_partition(scheme, units, what, name)
    groups = tuple(tuple(g * unit + t for g in ug) for ug in ugroups for t in range(unit))
    return WidthMap(groups, size)


def depth_groups(
    num_layers: int, scheme: DepthScheme = "adjacent", *, name: str = "num_layers"
) -> tuple[tuple[int, ...], ...]:
    """Depth partition: for every small layer, the large layers averaged into it.

    ``"adjacent"``: (0,1), (2,3), …; ``"half"``: (0, L/2), (1, L/2+1), …; explicit list: a partition of
    ``range(num_layers)`` (odd depths, e.g. ``[[0, 1], [2, 3, 4]]``: weights 1/2 and 1/3). ``num_layers``: an int,
    Python or numpy.

    Raises:
        ValueError (naming ``name``): odd ``num_layers`` with ``"adjacent"``/``"half"``, an unknown scheme string, or
            explicit groups that are not a partition.
    """
    if not is_int(num_layers) or num_layers < 1:
        raise ValueError(f"{name}: expected a positive number of layers, got {num_layers!r}")
    num_layers = int(num_layers)
    if isinstance(scheme, str):
        if scheme not in ("adjacent", "half"):
            raise ValueError(f"{name}: unknown depth scheme {scheme!r}; use 'adjacent', 'half' or a list of groups")
        if num_layers % 2:
            example = [[2 * i, 2 * i + 1] for i in range((num_layers - 3) // 2)] + [list(range(num_layers))[-3:]]
            raise ValueError(
                f"{name}: depth scheme {scheme!r} needs an even number of layers, got {num_layers}; pass explicit "
                f"groups as depth_scheme (VCycleCallback(depth_scheme=...)), e.g. {example} (a group of 3, or of 1, "
                "is allowed)"
            )
        half = num_layers // 2
        if scheme == "adjacent":
            return tuple((2 * i, 2 * i + 1) for i in range(half))
        return tuple((i, i + half) for i in range(half))
    return _validate_partition(scheme, num_layers, "layer", f"depth_scheme ({name}={num_layers})")


# ---------------------------------------------------------------------------------------------------------------------
# width map: tensor operations


def _half(t: Tensor) -> bool:
    """Whether ``t`` is a 16-bit float, whose sums of large values overflow (65504 for float16)."""
    return t.dtype in (torch.float16, torch.bfloat16)


def _mean_last(parts: Tensor) -> Tensor:
    """Mean over the last axis, exact when all entries are equal (see module docstring). 16-bit floats are averaged
    in float64 and rounded once (their sums would overflow: float16 60000 and 60000 average to 60000, not inf;
    bfloat16's largest values overflow even float32)."""
    n = parts.shape[-1]
    if n == 1:
        return parts[..., 0].clone()
    if _half(parts):
        return _mean_last(parts.double()).to(parts.dtype)
    if n == 2:
        return (parts[..., 0] + parts[..., 1]) * 0.5
    base = parts[..., 0]
    acc = parts[..., 1] - base
    for k in range(2, n):
        acc = acc + (parts[..., k] - base)
    return base + acc / n


def _mean_list(tensors: Sequence[Tensor]) -> Tensor:
    """Mean of equally shaped tensors with the formulation of :func:`_mean_last` (depth averaging)."""
    n = len(tensors)
    if n == 1:
        return tensors[0].clone()
    if _half(tensors[0]):
        return _mean_list([t.double() for t in tensors]).to(tensors[0].dtype)
    if n == 2:
        return (tensors[0] + tensors[1]) * 0.5
    base = tensors[0]
    acc = tensors[1] - base
    for t in tensors[2:]:
        acc = acc + (t - base)
    return base + acc / n


@dataclass(frozen=True)
class WidthMap:
    """A partition of the large index set ``range(large)``; small index ``i`` ↔ ``groups[i]``.

    Tensor methods map one axis (``dim``) and return new tensors: :meth:`average` (F), :meth:`sum` (S) go large →
    small; :meth:`copy` (T), :meth:`split` (H) go small → large. Build with :func:`width_groups` or
    :meth:`concat` (fused projections, e.g. ``concat(qk, qk, v)`` for a ``[Q; K; V]`` output).
    """

    groups: tuple[tuple[int, ...], ...]
    large: int

    def __post_init__(self) -> None:
        flat = sorted(j for g in self.groups for j in g)
        if flat != list(range(self.large)) or any(len(g) == 0 for g in self.groups):
            raise ValueError(f"WidthMap: groups must partition range({self.large}) into non-empty groups")

    @property
    def small(self) -> int:
        return len(self.groups)

    @cached_property
    def is_identity(self) -> bool:
        return all(g == (i,) for i, g in enumerate(self.groups))

    @cached_property
    def group_sizes(self) -> tuple[int, ...]:
        return tuple(len(g) for g in self.groups)

    @classmethod
    def identity(cls, size: int) -> WidthMap:
        return cls(tuple((i,) for i in range(size)), size)

    @classmethod
    def concat(cls, *maps: WidthMap) -> WidthMap:
        """Block-diagonal concatenation: large and small indices of each map offset by the previous maps' sizes."""
        groups: list[tuple[int, ...]] = []
        off = 0
        for m in maps:
            groups.extend(tuple(j + off for j in g) for g in m.groups)
            off += m.large
        return cls(tuple(groups), off)

    @cached_property
    def _buckets(self) -> tuple[tuple[int, Tensor, Tensor], ...]:
        """Per group size ``n``: ``(n, small positions [m], members [m, n])`` (int64, CPU)."""
        by_size: dict[int, list[int]] = {}
        for i, g in enumerate(self.groups):
            by_size.setdefault(len(g), []).append(i)
        return tuple(
            (
                n,
                torch.tensor(pos, dtype=torch.long),
                torch.tensor([self.groups[i] for i in pos], dtype=torch.long).reshape(len(pos), n),
            )
            for n, pos in sorted(by_size.items())
        )

    @cached_property
    def _owner(self) -> Tensor:
        owner = [0] * self.large
        for i, g in enumerate(self.groups):
            for j in g:
                owner[j] = i
        return torch.tensor(owner, dtype=torch.long)

    def _check(self, x: Tensor, dim: int, size: int, op: str) -> None:
        if op in ("average", "split") and not x.is_floating_point():
            raise ValueError(
                f"WidthMap.{op}: needs a floating-point tensor, got {x.dtype} (a mean or a split of integers would "
                "round); convert it first, or map an integer buffer with copy / sum"
            )
        if x.shape[dim] != size:
            raise ValueError(
                f"WidthMap.{op}: axis {dim} of a tensor of shape {tuple(x.shape)} has size "
                f"{x.shape[dim]}, expected {size}"
            )

    def average(self, x: Tensor, dim: int) -> Tensor:
        """F: small[i] = mean of large[g(i)] along ``dim`` (size ``large`` → ``small``)."""
        self._check(x, dim, self.large, "average")
        if self.is_identity:
            return x.clone()
        xm = x.movedim(dim, -1)
        out = xm.new_empty((*xm.shape[:-1], self.small))
        for _, pos, mem in self._buckets:
            out[..., pos.to(x.device)] = _mean_last(xm[..., mem.to(x.device)])
        return out.movedim(-1, dim)

    def sum(self, x: Tensor, dim: int) -> Tensor:
        """S: small[i] = sequential sum of large[g(i)] (in group order) along ``dim``."""
        self._check(x, dim, self.large, "sum")
        if self.is_identity:
            return x.clone()
        xm = x.movedim(dim, -1)
        out = xm.new_empty((*xm.shape[:-1], self.small))
        for n, pos, mem in self._buckets:
            parts = xm[..., mem.to(x.device)]
            acc = parts[..., 0]
            for k in range(1, n):
                acc = acc + parts[..., k]
            out[..., pos.to(x.device)] = acc
        return out.movedim(-1, dim)

    def copy(self, x: Tensor, dim: int) -> Tensor:
        """T: large[j] = small[i] for every j in g(i) along ``dim`` (size ``small`` → ``large``)."""
        self._check(x, dim, self.small, "copy")
        if self.is_identity:
            return x.clone()
        return x.index_select(dim, self._owner.to(x.device))

    def split(self, x: Tensor, dim: int) -> Tensor:
        """H: large[j] ≈ small[i] / |g(i)| for j in g(i); the last member of a group gets the exact remainder so that
        :meth:`sum` of the result returns ``x`` bit for bit (pairs: exactly ``x/2`` twice)."""
        self._check(x, dim, self.small, "split")
        if self.is_identity:
            return x.clone()
        xm = x.movedim(dim, -1)
        out = xm.new_empty((*xm.shape[:-1], self.large))
        for n, pos, mem in self._buckets:
            w = xm[..., pos.to(x.device)]
            mem = mem.to(x.device)
            if n == 1:
                out[..., mem[:, 0]] = w
                continue
            q = w / n
            partial = q
            out[..., mem[:, 0]] = q
            for k in range(1, n - 1):
                out[..., mem[:, k]] = q
                partial = partial + q
            out[..., mem[:, n - 1]] = w - partial
        return out.movedim(-1, dim)

    def matrices(self, dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Dense ``(F [d×D], S [D×d], T [D×d], H [d×D])``: the map matrices of the method card (for tests and
        debugging; the tensor methods do not use them)."""
        F = torch.zeros(self.small, self.large, dtype=dtype)
        for i, g in enumerate(self.groups):
            F[i, list(g)] = 1.0 / len(g)
        T = (F > 0).to(dtype).T.contiguous()
        return F, T.clone(), T, F.clone()

    def coalesce_axis(self, x: Tensor, dim: int, side: Side) -> Tensor:
        return self.average(x, dim) if side == "out" else self.sum(x, dim)

    def decoalesce_axis(self, x: Tensor, dim: int, side: Side) -> Tensor:
        return self.copy(x, dim) if side == "out" else self.split(x, dim)


@dataclass(frozen=True)
class TransformerWidthMaps:
    """The maps of one width level of a transformer (official ``MapMatrix``): ``hidden`` (E: residual stream,
    embeddings, LayerNorms), ``qk`` (Q and K outputs, whole heads), ``v`` (V output = attention output projection
    input), ``ffn`` (I: FFN intermediate). ``small_heads``: number of heads of the small model."""

    hidden: WidthMap
    qk: WidthMap
    v: WidthMap
    ffn: WidthMap
    small_heads: int

    @cached_property
    def qkv(self) -> WidthMap:
        """Fused ``[Q; K; V]`` output map (GPT-2 ``c_attn``, timm ``attn.qkv``)."""
        return WidthMap.concat(self.qk, self.qk, self.v)


def transformer_width_maps(
    hidden: int,
    heads: int,
    ffn: int,
    scheme: WidthScheme | None = "half",
    *,
    names: tuple[str, str, str] = ("hidden_size", "num_heads", "ffn_size"),
) -> TransformerWidthMaps:
    """Width maps of a standard transformer for one level (official ``MapMatrix.get_F``).

    ``scheme="half"``: head ``h`` ↔ ``h + H/2`` for Q/K/V, dim ``j`` ↔ ``j + D/2``, FFN neuron ``n`` ↔ ``n + F/2``.
    Explicit ``scheme``: groups of heads (a partition of ``range(heads)``), applied to whole heads for Q/K/V, to
    chunks of ``D/H`` dims for the hidden map and to chunks of ``F/H`` neurons for the FFN map (the official layout).
    ``None``: identity maps (depth-only levels). Head size and FFN width come from the arguments, not hard-coded.

    Raises:
        ValueError naming the configuration key (``names`` = keys of hidden, heads, FFN): hidden not divisible by
        heads; ``"half"`` with an odd number of heads or an odd hidden/FFN size; explicit groups that are not a
        partition of the heads; explicit groups with an FFN size not divisible by the number of heads.
    """
    kh, kn, kf = names
    for key, val in ((kh, hidden), (kn, heads), (kf, ffn)):
        if not is_int(val) or val < 1:
            raise ValueError(f"{key}: expected a positive integer, got {val!r}")
    hidden, heads, ffn = int(hidden), int(heads), int(ffn)
    if hidden % heads:
        raise ValueError(f"{kh}={hidden} is not divisible by {kn}={heads}")
    head_dim = hidden // heads
    if scheme is None:
        ident = WidthMap.identity(hidden)
        return TransformerWidthMaps(ident, ident, ident, WidthMap.identity(ffn), heads)
    if isinstance(scheme, str):
        if scheme != "half":
            raise ValueError(f"width_scheme: unknown scheme {scheme!r}; use 'half', a list of head groups or None")
        if heads % 2:
            raise ValueError(
                f"{kn}={heads} cannot be halved (width scheme 'half' needs an even number of heads); pass explicit "
                f"head groups, VCycleCallback(width_scheme={_odd_groups(heads)}) (a group of 3 merges three heads), "
                "or width_scheme=None to coalesce the depth only"
            )
        qk = width_groups(hidden, "half", head_dim, name=kn)
        return TransformerWidthMaps(
            width_groups(hidden, "half", 1, name=kh), qk, qk, width_groups(ffn, "half", 1, name=kf), heads // 2
        )
    groups = _validate_partition(scheme, heads, "head", f"width_scheme (groups of the {heads} heads, {kn})")
    if ffn % heads:
        raise ValueError(
            f"{kf}={ffn} is not divisible by {kn}={heads}: explicit head groups map the FFN in chunks "
            f"of {kf}/{kn} neurons; use width_scheme='half'"
        )
    qk = width_groups(hidden, groups, head_dim, name=kn)
    return TransformerWidthMaps(qk, qk, qk, width_groups(ffn, groups, ffn // heads, name=kf), len(groups))


def convention_scale(hidden: WidthMap) -> float:
    """Power-of-two factor of the tied-embedding conventions (``official`` / ``exact``): ``2^round(log2(D/d))`` — 2
    for the halving schemes, 1 for a width-identity (depth-only) level. Powers of two keep ``×c`` / ``×1/c`` exact."""
    return float(2.0 ** round(math.log2(hidden.large / hidden.small)))


# ---------------------------------------------------------------------------------------------------------------------
# plans


@dataclass(frozen=True)
class TensorRule:
    """How one tensor of the large model maps to the small one.

    Attributes:
        axes: ``(dim, map, side)`` per mapped axis (unlisted axes unchanged). A PyTorch ``Linear.weight`` (out × in)
            is ``((0, out_map, "out"), (1, in_map, "in"))``; an HF ``Conv1D`` weight (in × out) swaps the dims; an
            embedding table ``((1, hidden, "out"),)``; ``cls_token``/``pos_embed`` ``((-1, hidden, "out"),)``.
            Empty: copied unchanged.
        scale: multiplies the coalesced tensor (de-coalescing divides first); a power of two.
        layer: index of the block the tensor belongs to (depth step), or ``None``.
        template: the key with the layer index replaced by ``{}`` (``"h.{}.attn.c_attn.weight"``); tensors of
            different layers with the same template are averaged / copied by the depth step.
    """

    axes: tuple[tuple[int, WidthMap, Side], ...] = ()
    scale: float = 1.0
    layer: int | None = None
    template: str = ""

    def small_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        out = list(shape)
        for dim, m, _ in self.axes:
            out[dim] = m.small
        return tuple(out)


def _storage_key(t: Tensor) -> tuple[object, ...]:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


@dataclass(frozen=True)
class VCyclePlan:
    """One level of the V-cycle: the large model's state-dict keys, a :class:`TensorRule` per canonical key, the
    aliases of tied tensors, and the depth groups. Build with :meth:`create` (adapters do this).

    Attributes:
        rules: canonical large key → rule (one entry per storage).
        aliases: alias key → canonical key (e.g. ``lm_head.weight`` → ``transformer.wte.weight``); the aliases are
            written with the same tensor object in the output of :func:`coalesce` / :func:`decoalesce`.
        depth: depth groups: small layer ``i`` ← large layers ``depth[i]``.
        large_shapes / small_shapes: key → shape, over all keys (aliases included), in state-dict order.
        info: free-form description (adapter name, sizes, schemes), for logs and manifests.
    """

    rules: Mapping[str, TensorRule]
    aliases: Mapping[str, str]
    depth: tuple[tuple[int, ...], ...]
    large_shapes: Mapping[str, tuple[int, ...]]
    small_shapes: Mapping[str, tuple[int, ...]]
    info: Mapping[str, object] = field(default_factory=dict)

    @property
    def num_layers(self) -> tuple[int, int]:
        """``(large, small)`` depth."""
        return sum(len(g) for g in self.depth), len(self.depth)

    @classmethod
    def create(
        cls,
        shapes: Mapping[str, Sequence[int]],
        rules: Mapping[str, TensorRule],
        aliases: Mapping[str, str] | None = None,
        depth: Sequence[Sequence[int]] | None = None,
        info: Mapping[str, object] | None = None,
    ) -> VCyclePlan:
        """Validate and build a plan.

        Args:
            shapes: every state-dict key of the large model → shape, in state-dict order. rules: one rule per key
                that is not an alias. aliases: alias → canonical key. depth: depth groups (``None``: identity over
                the layer indices found in ``rules``).

        Raises:
            ValueError: a key without a rule (listed), a rule for an unknown key, an alias of an unknown key, a map
                whose large size does not match the tensor's axis, inconsistent layer templates (a template missing
                for some layer), depth groups that are not a partition of the layers.
        """
        aliases = dict(aliases or {})
        missing = [k for k in shapes if k not in rules and k not in aliases]
        if missing:
            raise ValueError(f"VCyclePlan: no rule for {len(missing)} state-dict entries: {missing}")
        unknown = [k for k in list(rules) + list(aliases) if k not in shapes]
        bad_alias = [a for a, c in aliases.items() if c not in rules]
        if unknown or bad_alias:
            raise ValueError(
                f"VCyclePlan: rules/aliases for unknown keys {unknown}; aliases of keys without a rule {bad_alias}"
            )
        for k, r in rules.items():
            shp = tuple(shapes[k])
            for dim, m, side in r.axes:
                if side not in ("out", "in"):
                    raise ValueError(f"VCyclePlan: {k}: side must be 'out' or 'in', got {side!r}")
                if not -len(shp) <= dim < len(shp) or shp[dim] != m.large:
                    raise ValueError(f"VCyclePlan: {k} of shape {shp}: map of size {m.large} does not fit axis {dim}")
            if r.scale <= 0 or math.log2(r.scale) != round(math.log2(r.scale)):
                raise ValueError(f"VCyclePlan: {k}: scale must be a power of two, got {r.scale}")
        layers = sorted({r.layer for r in rules.values() if r.layer is not None})
        if layers and layers != list(range(len(layers))):
            raise ValueError(f"VCyclePlan: layer indices must be 0..L-1, got {layers}")
        by_template: dict[str, set[int]] = {}
        for k, r in rules.items():
            if r.layer is not None:
                if r.template.format(r.layer) != k:
                    raise ValueError(f"VCyclePlan: template {r.template!r} with layer {r.layer} does not give {k!r}")
                by_template.setdefault(r.template, set()).add(r.layer)
        incomplete = {t: sorted(set(layers) - s) for t, s in by_template.items() if s != set(layers)}
        if incomplete:
            raise ValueError(
                f"VCyclePlan: layers with different parameter sets (template: missing layers) {incomplete}"
            )
        groups = (
            tuple((i,) for i in layers)
            if depth is None
            else _validate_partition(depth, len(layers), "layer", "depth_scheme")
        )
        if not layers and depth is not None and len(groups):
            raise ValueError("VCyclePlan: depth groups given but no rule has a layer index")
        small_shapes: dict[str, tuple[int, ...]] = {}
        for k, large_shape in shapes.items():
            r = rules[aliases.get(k, k)]
            if r.layer is not None and r.layer >= len(groups):
                continue
            small_shapes[k] = r.small_shape(large_shape)
        return cls(
            dict(rules), aliases, groups, {k: tuple(v) for k, v in shapes.items()}, small_shapes, dict(info or {})
        )

    # -- helpers used by the operators -------------------------------------------------------------------------------

    def _check(self, sd: Mapping[str, Tensor], expected: Mapping[str, tuple[int, ...]], which: str) -> None:
        missing = [k for k in expected if k not in sd]
        extra = [k for k in sd if k not in expected]
        if missing or extra:
            raise ValueError(f"{which}: state dict does not match the plan: missing {missing}, unexpected {extra}")
        wrong = {k: (tuple(sd[k].shape), v) for k, v in expected.items() if tuple(sd[k].shape) != v}
        if wrong:
            raise ValueError(f"{which}: shape mismatch (got, expected): {wrong}")
        for a, c in self.aliases.items():
            if a in expected and c in expected:
                ta, tc = sd[a], sd[c]
                if _storage_key(ta) != _storage_key(tc) and not torch.equal(ta, tc):
                    raise ValueError(f"{which}: {a!r} is tied to {c!r} in the plan but holds different values")


def _state_dict(obj: Mapping[str, Tensor] | nn.Module, which: str) -> Mapping[str, Tensor]:
    if isinstance(obj, nn.Module):
        return obj.state_dict()
    if not isinstance(obj, Mapping):
        raise TypeError(f"{which}: expected a state dict (mapping of tensors) or an nn.Module, got {type(obj)!r}")
    return obj


@torch.no_grad()
def coalesce(model_or_state_dict: Mapping[str, Tensor] | nn.Module, plan: VCyclePlan) -> dict[str, Tensor]:
    """Large → small (official ``mapper.py --opt C``): width maps F/S per axis and the rule's scale,
    then depth averaging (small layer ``i`` = mean of large layers ``plan.depth[i]``, parameter by parameter).

    Args:
        model_or_state_dict: the large model or its state dict (keys and shapes ``plan.large_shapes``).

    Returns:
        A new state dict with keys and shapes ``plan.small_shapes`` (load it with ``load_state_dict(strict=True)``);
        tied keys hold the same tensor object. Same dtype/device as the input. The input is not modified.

    Raises:
        ValueError: missing/unexpected keys (listed), wrong shapes, tied aliases holding different values.
    """
    sd = _state_dict(model_or_state_dict, "coalesce")
    plan._check(sd, plan.large_shapes, "coalesce")
    mapped: dict[str, Tensor] = {}
    for k, r in plan.rules.items():
        x = sd[k]
        for dim, m, side in r.axes:
            x = m.coalesce_axis(x, dim, side)
        if not r.axes:
            x = x.clone()
        mapped[k] = x * r.scale if r.scale != 1.0 else x
    out: dict[str, Tensor] = {}
    for k in plan.small_shapes:
        c = plan.aliases.get(k, k)
        if c != k:
            continue
        r = plan.rules[c]
        if r.layer is None:
            out[k] = mapped[k]
        else:
            out[k] = _mean_list([mapped[r.template.format(s)] for s in plan.depth[r.layer]])
    return {k: out[plan.aliases.get(k, k)] for k in plan.small_shapes}


@torch.no_grad()
def decoalesce(small_state_dict: Mapping[str, Tensor] | nn.Module, plan: VCyclePlan) -> dict[str, Tensor]:
    """Small → large (official ``mapper.py --opt D``): depth copy (large layer ``s`` = copy of the
    small layer whose group contains ``s``), then width maps T/H per axis with the rule's scale divided out.

    Returns:
        A new state dict with keys and shapes ``plan.large_shapes``: distinct tensors per key except tied aliases
        (same tensor object). ``coalesce(decoalesce(sd, plan), plan)`` equals ``sd`` bit for bit.

    Raises:
        ValueError: missing/unexpected keys (listed), wrong shapes, tied aliases holding different values.
    """
    sd = _state_dict(small_state_dict, "decoalesce")
    plan._check(sd, plan.small_shapes, "decoalesce")
    owner = {s: i for i, g in enumerate(plan.depth) for s in g}
    out: dict[str, Tensor] = {}
    for k, r in plan.rules.items():
        x = sd[k] if r.layer is None else sd[r.template.format(owner[r.layer])]
        if r.scale != 1.0:
            x = x * (1.0 / r.scale)
        for dim, m, side in reversed(r.axes):
            x = m.decoalesce_axis(x, dim, side)
        out[k] = x.clone() if (not r.axes and r.scale == 1.0) else x
    return {k: out[plan.aliases.get(k, k)] for k in plan.large_shapes}


def _check_alpha(alpha: object) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, Real) or not math.isfinite(float(alpha)):
        raise ValueError(f"alpha_original must be a real number in [0, 1], got {alpha!r}")
    a = float(alpha)
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"alpha_original must be in [0, 1], got {a}")
    return a


@torch.no_grad()
def interpolate(
    decoalesced: Mapping[str, Tensor] | nn.Module,
    saved_original: Mapping[str, Tensor] | nn.Module,
    alpha_original: float,
) -> dict[str, Tensor]:
    """``θ = (1 − alpha_original)·θ_decoalesced + alpha_original·θ_saved`` for every floating tensor (the
    official ``interpolate(alpha)`` with one unambiguous orientation: ``alpha_original`` weights the snapshot taken
    before coalescing). Non-floating tensors are taken from ``decoalesced`` unchanged.

    Endpoints are exact: ``alpha_original == 0`` returns copies of the de-coalesced tensors, ``== 1`` copies of the
    saved ones (converted to the de-coalesced dtype/device). Otherwise the result is computed in the promoted dtype
    (at least float32) as ``(1 − α)·a + α·b`` and cast to the de-coalesced dtype. Keys that share one storage in
    ``decoalesced`` (tied weights) are computed once and the same tensor is returned under every alias.

    Raises:
        ValueError: ``alpha_original`` outside [0, 1] or not a finite real; different key sets (listed) or shapes;
            keys tied in ``decoalesced`` whose values differ in ``saved_original``.
    """
    a = _check_alpha(alpha_original)
    da = _state_dict(decoalesced, "interpolate(decoalesced)")
    db = _state_dict(saved_original, "interpolate(saved_original)")
    missing, extra = [k for k in da if k not in db], [k for k in db if k not in da]
    if missing or extra:
        raise ValueError(f"interpolate: key sets differ: only in decoalesced {missing}, only in saved_original {extra}")
    wrong = {k: (tuple(da[k].shape), tuple(db[k].shape)) for k in da if da[k].shape != db[k].shape}
    if wrong:
        raise ValueError(f"interpolate: shape mismatch (decoalesced, saved_original): {wrong}")
    done: dict[tuple[object, ...], tuple[str, Tensor]] = {}
    out: dict[str, Tensor] = {}
    for k, x in da.items():
        sk = _storage_key(x)
        if sk in done:
            first, res = done[sk]
            y0, y = db[first], db[k]
            if _storage_key(y0) != _storage_key(y) and not torch.equal(y0, y.to(y0.device)):
                raise ValueError(
                    f"interpolate: {k!r} and {first!r} are tied in decoalesced but differ in saved_original"
                )
            out[k] = res
            continue
        y = db[k].to(device=x.device)
        if not x.is_floating_point():
            res = x.clone()
        elif a == 0.0:
            res = x.clone()
        elif a == 1.0:
            res = y.to(dtype=x.dtype, copy=True)
        else:
            ct = torch.promote_types(torch.promote_types(x.dtype, y.dtype), torch.float32)
            res = (x.to(ct) * (1.0 - a) + y.to(ct) * a).to(x.dtype)
        done[sk] = (k, res)
        out[k] = res
    return out


# ---------------------------------------------------------------------------------------------------------------------
# model-level steps (what the callback does at a level change)


def snapshot(model_or_state_dict: Mapping[str, Tensor] | nn.Module) -> dict[str, Tensor]:
    """A CPU copy of a state dict, floating tensors in float32 or their own dtype when it is wider (float64: no value
    is rounded; bfloat16 / float16 are widened exactly), other tensors as they are, tied tensors kept as one shared
    tensor: the copy of a level's model taken before coalescing, for :func:`interpolate` on the way up."""
    out: dict[str, Tensor] = {}
    seen: dict[tuple[object, ...], Tensor] = {}
    for k, t in _state_dict(model_or_state_dict, "snapshot").items():
        key = _storage_key(t)
        if key not in seen:
            t = t.detach()
            seen[key] = (
                t.to("cpu", torch.promote_types(t.dtype, torch.float32), copy=True)
                if t.is_floating_point()
                else t.to("cpu", copy=True)
            )
        out[k] = seen[key]
    return out


def plan_levels(
    model: nn.Module,
    adapter: object,
    levels: int,
    width_scheme: WidthScheme | None = "half",
    depth_scheme: DepthScheme | None = "adjacent",
    embedding_convention: str = "official",
    *,
    owner: str = "plan_levels",
) -> list[VCyclePlan]:
    """The plans of levels 1 → 2, ..., K−1 → K (``levels`` = K >= 2, an int), from the full ``model``:
    ``adapter.plan`` on each level's model, the intermediate small models built with ``adapter.build_small`` (global
    RNG untouched). ``owner`` prefixes the messages (the callback's class name).

    Raises:
        ValueError: ``levels`` not an int >= 2; from the adapter for the full model: sizes a scheme cannot halve
            (naming the configuration key, e.g. ``n_head``), unmapped parameters; a coarser level that cannot be
            coalesced once more (``levels`` deeper than the model allows): naming ``levels``, the level, its model's
            sizes, the adapter's reason (heads, width or depth that the scheme cannot halve) and the deepest
            ``levels`` the model allows with these schemes.
    """
    if not is_int(levels) or levels < 2:
        raise ValueError(f"{owner}.levels must be an int >= 2 (levels=1 has no coarser level to train), got {levels!r}")
    plans: list[VCyclePlan] = []
    current = model
    for k in range(1, int(levels)):
        try:
            plan = adapter.plan(current, width_scheme, depth_scheme, embedding_convention)  # type: ignore[attr-defined]
        except ValueError as err:
            if k == 1:  # the full model itself: the scheme or the model is at fault, not the number of levels
                raise
            raise ValueError(
                f"{owner}.levels={levels} is deeper than this model allows: level {k} cannot be coalesced into a "
                f"level {k + 1} ({err}); the level-{k} model is {_sizes(plans[-1])}, the full model halved "
                f"{k - 1} time(s) with width_scheme={width_scheme!r}, depth_scheme={depth_scheme!r}. The deepest "
                f"V-cycle this model allows with these schemes is levels={k}: pass levels <= {k}, or other schemes "
                "(width_scheme=None keeps the width, depth_scheme=None the depth)"
            ) from err
        plans.append(plan)
        if k < levels - 1:
            with torch.random.fork_rng(devices=[]):
                current = adapter.build_small(current, plan)  # type: ignore[attr-defined]
    return plans


def _sizes(plan: VCyclePlan) -> str:
    """The small model of ``plan`` in words (its sizes from the adapter's ``info``, else its depth)."""
    small = plan.info.get("small")
    if isinstance(small, Mapping):
        return (
            f"{small.get('hidden')} wide, {small.get('heads')} head(s), FFN {small.get('ffn')}, "
            f"{small.get('layers')} layer(s)"
        )
    return f"{plan.num_layers[1]} layer(s) deep"


def first_nonfinite(tensors: Mapping[str, Tensor] | nn.Module) -> tuple[str, str] | None:
    """The first floating tensor of ``tensors`` (a state dict, or a module's parameters, in their order) holding a NaN
    or an infinite value, as ``(name, what)`` with ``what`` one of ``"NaN"``, ``"inf"`` (``"NaN and inf"`` when both);
    None when all are finite. Used before a level change: the V-cycle never maps non-finite weights."""
    items = tensors.named_parameters() if isinstance(tensors, nn.Module) else tensors.items()
    for name, t in items:
        if not isinstance(t, Tensor) or not t.is_floating_point() or bool(torch.isfinite(t.detach()).all()):
            continue
        nan, inf = bool(torch.isnan(t.detach()).any()), bool(torch.isinf(t.detach()).any())
        return name, " and ".join(w for w, has in (("NaN", nan), ("inf", inf)) if has)
    return None


def requires_grad_flags(model: nn.Module) -> dict[str, bool]:
    """``{state-dict key: requires_grad}`` of every parameter of ``model`` (tied parameters under each name)."""
    return {k: p.requires_grad for k, p in model.named_parameters(remove_duplicate=False)}


def coalesced_requires_grad(flags: Mapping[str, bool], plan: VCyclePlan) -> dict[str, bool]:
    """The ``requires_grad`` of the small model's parameters from the large model's ``flags``
    (:func:`requires_grad_flags`): a small tensor is trainable when one of the large tensors :func:`coalesce` makes it
    from (the same key, or that key in every layer of its depth group) is; frozen when they all are (a frozen
    embedding stays frozen at every level). Keys of ``plan.small_shapes`` whose sources are not in ``flags``
    (buffers) are left out.

    >>> plan = VCyclePlan.create({"a": (2,), "b": (2,)}, {"a": TensorRule(), "b": TensorRule()})
    >>> coalesced_requires_grad({"a": False, "b": True}, plan)
    {'a': False, 'b': True}
    """
    out: dict[str, bool] = {}
    for k in plan.small_shapes:
        c = plan.aliases.get(k, k)
        r = plan.rules[c]
        sources = [c] if r.layer is None else [r.template.format(s) for s in plan.depth[r.layer]]
        known = [flags[s] for s in sources if s in flags]
        if known:
            out[k] = any(known)
    return out


def mixed_depth_groups(flags: Mapping[str, bool], plan: VCyclePlan) -> list[tuple[list[int], list[str]]]:
    """The depth groups of ``plan`` (layers of the large model :func:`coalesce` merges into one) whose tensors of one
    key are frozen in some layers and trainable in others, from the large model's ``flags``
    (:func:`requires_grad_flags`): ``[(layers of the group, the frozen large keys)]``. The merged tensor trains
    (:func:`coalesced_requires_grad`) and the frozen ones get their weights back at de-coalescing
    (:func:`decoalesced_requires_grad`), so a ``requires_grad_(True)`` at the coarse level cannot reach them.

    >>> plan = VCyclePlan.create({"h.0.w": (2,), "h.1.w": (2,)}, {"h.0.w": TensorRule(), "h.1.w": TensorRule()})
    >>> mixed_depth_groups({"h.0.w": False, "h.1.w": True}, plan)
    []
    """
    out: dict[int, list[str]] = {}
    for k in plan.small_shapes:
        r = plan.rules[plan.aliases.get(k, k)]
        if r.layer is None:
            continue
        sources = [r.template.format(s) for s in plan.depth[r.layer] if r.template.format(s) in flags]
        frozen = [s for s in sources if not flags[s]]
        if frozen and len(frozen) < len(sources):
            group = out.setdefault(r.layer, [])
            group.extend(f for f in frozen if f not in group)
    return [(list(plan.depth[layer]), keys) for layer, keys in sorted(out.items())]


def decoalesced_requires_grad(
    small_flags: Mapping[str, bool], large_flags: Mapping[str, bool], plan: VCyclePlan
) -> dict[str, bool]:
    """The ``requires_grad`` of the large model's parameters when the small one is de-coalesced into it, from both
    models' flags (:func:`requires_grad_flags`; ``large_flags`` as they were when it was coalesced): a small tensor
    whose flag the user's code changed during the coarse level (other than :func:`coalesced_requires_grad` gave it)
    passes it on to every large tensor :func:`decoalesce` makes from it (a module unfrozen at the coarse level stays
    trainable, one frozen there stays frozen); the others keep their large flag (a frozen layer of a depth group beside
    a trainable one stays frozen). Keys whose source is not in the flags (buffers) are left out.

    >>> plan = VCyclePlan.create({"a": (2,), "b": (2,)}, {"a": TensorRule(), "b": TensorRule()})
    >>> decoalesced_requires_grad({"a": True, "b": True}, {"a": False, "b": True}, plan)
    {'a': True, 'b': True}
    """
    given = coalesced_requires_grad(large_flags, plan)
    owner = {s: i for i, g in enumerate(plan.depth) for s in g}
    out: dict[str, bool] = {}
    for k in plan.large_shapes:
        c = plan.aliases.get(k, k)
        r = plan.rules[c]
        source = c if r.layer is None else r.template.format(owner[r.layer])
        if source in small_flags and source in given and small_flags[source] != given[source]:
            out[k] = small_flags[source]
        elif k in large_flags:
            out[k] = large_flags[k]
    return out


def set_requires_grad(model: nn.Module, flags: Mapping[str, bool]) -> None:
    """``requires_grad_(flags[name])`` on every parameter of ``model`` named in ``flags``."""
    for k, p in model.named_parameters(remove_duplicate=False):
        if k in flags:
            p.requires_grad_(flags[k])


def _build_small(model: nn.Module, plan: VCyclePlan, adapter: object) -> nn.Module:
    """``adapter.build_small`` (global RNG untouched) with the ``requires_grad`` of ``model``'s parameters carried
    over (:func:`coalesced_requires_grad`; a fresh module's parameters all require grad)."""
    with torch.random.fork_rng(devices=[]):
        small: nn.Module = adapter.build_small(model, plan)  # type: ignore[attr-defined]
    set_requires_grad(small, coalesced_requires_grad(requires_grad_flags(model), plan))
    carry_activation_checkpointing(model, small)
    return small


#: module attributes that switch activation checkpointing on: Hugging Face's (``gradient_checkpointing_enable()``
#: sets the flag and the checkpoint function on every module that has the flag) and timm's
#: (``set_grad_checkpointing()``)
CHECKPOINTING_ATTRS = ("gradient_checkpointing", "_gradient_checkpointing_func", "grad_checkpointing")


def carry_activation_checkpointing(large: nn.Module, small: nn.Module) -> None:
    """Set the activation checkpointing of ``large`` on ``small``, module by module of the same name
    (:data:`CHECKPOINTING_ATTRS`). An adapter builds the small network from a config, so a model checkpointed by
    ``gradient_checkpointing_enable()`` or ``set_grad_checkpointing()`` trained its coarse levels without it, with the
    activations' memory the user had turned off (qa54-extras 01). The input embeddings' gradient hook of Hugging Face's
    ``enable_input_require_grads()`` (which ``gradient_checkpointing_enable()`` registers when the embeddings are
    frozen) is registered on ``small`` too: without it a reentrant checkpoint of the coarse network had no input that
    requires grad, and none of its blocks trained (every gradient None, qa57-break 03)."""
    targets = dict(small.named_modules())
    for name, module in large.named_modules():
        target = targets.get(name)
        if target is None:
            continue
        for attr in CHECKPOINTING_ATTRS:
            value = vars(module).get(attr)
            if value is not None and not isinstance(value, nn.Module | Tensor):
                setattr(target, attr, value)
        hooked = vars(module).get("_require_grads_hooks") or vars(module).get("_require_grads_hook") is not None
        enable = getattr(target, "enable_input_require_grads", None)
        if hooked and callable(enable) and not vars(target).get("_require_grads_hooks"):
            enable()


def build_levels(
    model: nn.Module, adapter: object, plans: Sequence[VCyclePlan], level: int
) -> tuple[nn.Module, dict[int, nn.Module]]:
    """Fresh models of levels 2..``level`` from the full ``model`` (random weights, global RNG untouched; resume
    loads the checkpoint's weights into them; each parameter's ``requires_grad`` as :func:`coalesce_model` sets it):
    ``(model of level, {k: model of level k for k < level, on the CPU})``.
    """
    current, larger = model, {}
    for k in range(1, level):
        small = _build_small(current, plans[k - 1], adapter)
        larger[k] = current.to("cpu")
        current = small
    return current, larger


@torch.no_grad()
def coalesce_model(model: nn.Module, plan: VCyclePlan, adapter: object) -> nn.Module:
    """The small model of ``plan`` (``adapter.build_small``, global RNG untouched) holding ``coalesce(model, plan)``
    (strict load; ties re-established by the adapter). Its parameters keep the large ones' ``requires_grad``
    (:func:`coalesced_requires_grad`: frozen when every source is frozen). ``model`` is not modified."""
    small = _build_small(model, plan, adapter)
    small.load_state_dict(coalesce(model, plan))
    return small


@torch.no_grad()
def decoalesce_model(
    small: nn.Module, large: nn.Module, plan: VCyclePlan, saved_original: Mapping[str, Tensor], alpha_original: float
) -> nn.Module:
    """Load ``interpolate(decoalesce(small, plan), saved_original, alpha_original)`` into ``large`` (moved to the
    device of ``small`` and set to its train / eval mode; its own tensors are replaced in place, so ties stay) and
    return ``large``. Each parameter of ``large`` takes the ``requires_grad`` of its source in ``small`` now
    (:func:`decoalesced_requires_grad`: an embedding the module unfroze during the coarse level stays trainable, its
    coarse training de-coalesced into it; it was frozen again, with its value of ``saved_original``, qa51-distill 03).
    A parameter frozen at both ends (``requires_grad=False`` when it was coalesced and in ``small`` now) gets its
    value of ``saved_original`` back exactly: it was not trained, and coalescing then de-coalescing it would change it
    (averaged pairs and layers)."""
    merged = interpolate(decoalesce(small, plan), saved_original, alpha_original)
    now = decoalesced_requires_grad(requires_grad_flags(small), requires_grad_flags(large), plan)
    for k, trainable in requires_grad_flags(large).items():
        if not trainable and not now.get(k, False) and k in saved_original:
            merged[k] = saved_original[k]
    large = large.to(next(small.parameters()).device)
    large.load_state_dict(merged)
    set_requires_grad(large, now)
    large.train(small.training)
    return large


_LAYER_RE_CACHE: dict[str, re.Pattern[str]] = {}


def layer_key(key: str, prefix: str) -> tuple[int, str] | None:
    """``(layer index, template)`` if ``key`` is ``prefix + "<int>." + rest``, else ``None``
    (e.g. ``layer_key("transformer.h.3.ln_1.weight", "transformer.h.")`` → ``(3, "transformer.h.{}.ln_1.weight")``)."""
    pat = _LAYER_RE_CACHE.get(prefix)
    if pat is None:
        pat = _LAYER_RE_CACHE[prefix] = re.compile(re.escape(prefix) + r"(\d+)\.(.+)$")
    m = pat.match(key)
    if m is None:
        return None

    def esc(s: str) -> str:
        return s.replace("{", "{{").replace("}", "}}")

    return int(m.group(1)), esc(prefix) + "{}." + esc(m.group(2))


def _odd_groups(heads: int) -> list[list[int]]:
    """Head groups for an odd ``heads`` (>= 3): pairs, the last group of three, e.g. 5 -> [[0, 1], [2, 3, 4]]; 1 ->
    [[0]] (a single head is kept)."""
    if heads < 3:
        return [list(range(heads))]
    groups = [[i, i + 1] for i in range(0, heads - 3, 2)]
    return [*groups, list(range(heads - 3, heads))]
