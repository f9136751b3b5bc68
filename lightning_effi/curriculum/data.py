"""``CurriculumDataModule``: wraps any DataModule so that the curriculum decides which samples each step trains on.
The method card is ``lightning_effi/curriculum/README.md``. The training loader is rebuilt as

``DataLoader(CurriculumDataset(dataset), batch_sampler=CurriculumSampler(controller),
collate_fn=CurriculumCollate(collate_fn, ...), num_workers=..., ...)``

- :class:`CurriculumSampler` (a batch sampler, rank-aware: it shards by rank itself) yields lists of keys
  ``(index, curriculum_step, micro_idx, difficulties)`` from the controller's committed position. With a thinner
  attached (InfoBatch composed with the curriculum, see "Composition" in the method card), each micro-batch slice is
  thinned and every kept key gets ``(weight, candidates)`` appended.
- :class:`CurriculumDataset` returns ``(dataset[index], key)``, so the key travels with the sample into the worker.
- :class:`CurriculumCollate` collates with the user's function (any batch structure), applies ``seqlen_truncate`` /
  ``seqlen_reshape`` with the difficulty **that batch was drawn at** (not whatever the sampler holds when a prefetched
  batch arrives), and returns an :class:`~lightning_effi.core.batch.EffiBatch`: the user's batch (truncated, same
  structure and types) and the curriculum's metadata (:data:`BATCH_KEYS`): ``cl_step``, ``cl_micro``,
  ``cl_difficulty`` (dict metric -> int) and, for the ``EfficiencyMonitor``'s baseline, what the truncation removed:
  ``cl_full_length`` (the sequence length ``S`` before the transforms), ``cl_cut_mask`` (the attention-mask values it
  cut), ``cl_cut_left`` (a left-padded batch, cut on the left) and ``cl_cut_axes`` (the tensors and axes cut). The
  DataModule takes the metadata off
  before any user hook (:meth:`~lightning_effi.core.wrapping.WrappingDataModule.on_before_batch_transfer`); the
  :class:`~lightning_effi.callbacks.Curriculum` callback reads it with :func:`~lightning_effi.core.batch.batch_meta`.
  Thinned batches also carry ``index`` (int64 ``(B_kept,)``), ``infobatch_weight`` (float32 ``(B_kept,)``) and
  ``infobatch_candidates`` (int ``B``), read by InfoBatch's ``training_step`` wrapper.

Validation, test and predict loaders are delegated unchanged (never truncated).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from lightning_effi.core.batch import EffiBatch
from lightning_effi.core.errors import DataConfigError
from lightning_effi.core.indexed import ORDER_CHECKS, collate_reorders, reorder_message
from lightning_effi.core.loader import sample_draw, set_dataset_epoch
from lightning_effi.core.measure import tensor_leaves
from lightning_effi.core.wrapping import WrappingDataModule, find_wrapper, wrapper_chain
from lightning_effi.curriculum import functional as F
from lightning_effi.curriculum.config import CurriculumConfig
from lightning_effi.curriculum.stream import CurriculumController

#: the metadata the collate wrapper gives every training batch (:class:`CurriculumCollate`)
BATCH_KEYS = (
    "cl_step",
    "cl_micro",
    "cl_difficulty",
    "cl_full_length",
    "cl_cut_mask",
    "cl_cut_left",
    "cl_cut_axes",
    "cl_cut_mask_path",
    "cl_cut_values",
)
#: the metadata it adds when a thinner is attached (InfoBatch composed with the curriculum)
THINNED_KEYS = ("index", "infobatch_weight", "infobatch_candidates")


class Thinner(Protocol):
    """What :class:`CurriculumSampler` needs from a technique that thins the curriculum's micro-batches (InfoBatch).

    ``thin_keys(keys, rank)`` receives one rank's micro-batch slice (keys ``(index, step, micro_idx, difficulties)``,
    all of one step and micro-batch) and returns the kept keys, in order, each with ``(weight, candidates)`` appended:
    its loss weight (float) and the slice's candidate count ``B = len(keys)`` (int). It must be a pure function of
    its own frozen state, the keys and the rank (the sampler may run ahead of training), and never return an empty
    list.
    """

    def thin_keys(self, keys: list[tuple], rank: int) -> list[tuple]: ...


class CurriculumDataset(Dataset):
    """``dataset[key[0]]`` paired with its key (``(index, step, micro_idx, difficulties)``)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple) -> tuple[Any, tuple]:
        with sample_draw(key[1], key[2]):  # a sample drawn twice in a data epoch: each draw its own augmentation
            return self.dataset[key[0]], key


class CurriculumCollate:
    """Collate ``(sample, key)`` pairs into an :class:`~lightning_effi.core.batch.EffiBatch`: the user's collate
    (``default_collate`` if None; any sample and batch structure: tensor, tuple, list, dict, dataclass, HF
    ``BatchEncoding``), then the sequence-length transform of the batch's own difficulty; the metadata
    (:data:`BATCH_KEYS`):

    - ``cl_step``, ``cl_micro`` (int): the curriculum step and micro-batch the batch was drawn at;
    - ``cl_difficulty``: metric name -> the difficulty (int) the batch was drawn at;
    - ``cl_full_length``: the collated batch's sequence length ``S`` before ``seqlen_truncate`` / ``seqlen_reshape``
      (int; :func:`~lightning_effi.curriculum.functional.sequence_length`), None when it has no sequence tensor;
    - ``cl_cut_mask``: the padding-mask values ``seqlen_truncate`` removed, ``[B, S - L]`` (each row's in column
      order), None when it removed none (or the batch has no padding mask); ``cl_cut_mask_path``: that mask's path in
      the batch (``("attention_mask",)``, ``(1,)`` for a tuple's second entry; None with it); ``cl_cut_values``: path ->
      the removed values of every ``[B, S]`` tensor cut (ids, token types, masks, labels; :attr:`~lightning_effi
      .curriculum.functional.Truncation.cut_values`); ``cl_cut_left``: the batch
      was left-padded and its last ``L`` columns kept; ``cl_cut_axes``: dict path -> the axes cut of every tensor
      cut (:attr:`~lightning_effi.curriculum.functional.Truncation.axes`; empty when nothing was cut). With
      ``cl_full_length`` they let the callback count the untruncated batch exactly, padding included
      (:meth:`~lightning_effi.callbacks.Curriculum.effi_baseline`).

    ``seqlen_truncate`` cuts every ``[B, S, ...]`` tensor of the batch (pairwise ``[B, S, S]`` ones and masks
    ``[B, 1, 1, S]`` on every sequence axis), in any structure, rebuilt with the same types
    (:func:`~lightning_effi.curriculum.functional.truncate`; left padding read from the batch's padding mask,
    :func:`~lightning_effi.curriculum.functional.padding_mask`); ``seqlen_reshape`` re-chunks every ``[B, S]``
    tensor of a dict batch alike, or a tensor batch (:func:`~lightning_effi.curriculum.functional.reshape_batch`).

    Thinned keys (6 fields) also give ``meta["index"]`` (int64 ``(B_kept,)``), ``meta["infobatch_weight"]``
    (float32 ``(B_kept,)``) and ``meta["infobatch_candidates"]`` (int).

    Args:
        collate_fn: the wrapped loader's collate function. metric_names: the curriculum's metric names, in order.
        truncate_keys, causal_label_shift, keep_last_token, truncation_side: ``seqlen_truncate`` options
            (:func:`~lightning_effi.curriculum.functional.truncate`).

    Raises:
        DataConfigError: ``seqlen_truncate`` with a batch that has no sequence tensor to cut (none of
            ``truncate_keys``; without them no tensor named ``attention_mask`` / ``input_ids`` and no integer ``[B, S]``
            tensor), a key of ``truncate_keys`` that names no tensor of the batch (the message names ``truncate_keys``,
            the missing keys and the batch's tensors), or padded on both sides; ``seqlen_reshape`` with a batch that is
            neither a dict with ``input_ids`` nor a ``[B, S]`` tensor; either with a sequence-first batch (the sequence
            tensor is ``[S, B]``: its dimension 1 is the number of samples collated, ``batch_first=False``); a float
            mask that is neither additive nor 0/1; the samples of one batch carry different steps (or, thinned,
            different candidate counts). Raised at the first such batch, naming the metric and the tensors found;
            :meth:`check` raises them before training for a batch of the training set's first samples (at setup, so a
            batch structure the transforms cannot work with never reaches the training loop).
    """

    def __init__(
        self,
        collate_fn: Callable | None,
        metric_names: Sequence[str],
        truncate_keys: Sequence[str] | None = None,
        causal_label_shift: bool = False,
        keep_last_token: bool = False,
        truncation_side: str = "right",
    ) -> None:
        self.collate_fn = collate_fn or default_collate
        self.truncation_side = truncation_side
        self.metric_names = tuple(metric_names)
        self.truncate_keys = None if truncate_keys is None else tuple(truncate_keys)
        self.causal_label_shift = causal_label_shift
        self.keep_last_token = keep_last_token
        self._left_padding_checked = False  # its first cut checks for unmarked left padding (F.truncate)
        self._order_checks = ORDER_CHECKS  # with InfoBatch, its first batches are checked for reordered rows
        #: truncate_keys=None: path -> (the axes seqlen_truncate's rule cuts of that tensor, its shape then, the
        #: batch's length), as first seen (this process; each loader worker has its own): a tensor cut on other axes
        #: in another batch (or left whole there) is refused (_check_consistent_cut)
        self._cuttable: dict[Any, tuple[tuple[int, ...], tuple[int, ...], int]] = {}

    def __call__(self, items: Sequence[tuple[Any, tuple]]) -> EffiBatch:
        keys = [k for _, k in items]
        _, step, micro, diffs = keys[0][:4]
        if any(k[1] != step or k[2] != micro for k in keys):
            raise DataConfigError("curriculum: one batch mixes samples of different curriculum steps")
        samples = [s for s, _ in items]
        batch = self.collate_fn(samples)
        if len(keys[0]) > 4 and self._order_checks > 0:  # thinned by InfoBatch: its rows are the drawn samples
            self._order_checks -= 1
            if self.collate_fn is not default_collate and collate_reorders(self.collate_fn, samples, batch):
                raise DataConfigError(reorder_message(self.collate_fn))
        return self._transform(batch, keys)

    def check(self, samples: Sequence[Any], difficulties: Sequence[int]) -> None:
        """Run the sequence-length transforms on the user's collated batch of ``samples`` at ``difficulties`` (one
        int per metric, in :attr:`metric_names` order), so that a batch structure the transforms cannot work with is
        refused before training (:meth:`CurriculumDataModule.train_dataloader` calls this with the training set's
        first samples and the first step's difficulties) instead of at the first batch.

        A collate function that raises here (e.g. one that needs a worker's state) is left to the training loader,
        which reports its error at the first batch.

        Raises:
            DataConfigError: what :meth:`__call__` raises for that batch (see the class docstring), the message
                ending with where it was found (``at setup, on a batch of the training set's first k samples``).
        """
        try:
            batch = self.collate_fn(list(samples))
        except Exception:  # the user's collate: left to the loader, which raises it in context
            return
        keys = [(i, 1, 0, tuple(difficulties)) for i in range(len(samples))]
        try:
            self._transform(batch, keys)
        except DataConfigError as e:
            raise DataConfigError(
                f"{e} [found at setup, on a batch of the training set's first {len(samples)} samples]"
            ) from None

    def _check_consistent_cut(self, batch: Any, size: int, length: int) -> None:
        """``truncate_keys=None`` cuts every tensor whose axis 1 (or last axis, for masks) has the batch's sequence
        length ``S`` (:func:`~lightning_effi.curriculum.functional.cut_axes`). A tensor of a length of its own (an
        encoder-decoder's targets, a ``[B, D]`` feature) matches ``S`` in some batches only, and would be cut in
        those alone: refused at the first batch that shows it both ways.

        Raises:
            DataConfigError: naming the tensor, the two shapes and ``truncate_keys``.
        """
        text = F.has_token_ids(batch, size, length)
        for path, value in tensor_leaves(batch):
            if value.ndim < 2 or value.shape[0] != size:
                continue
            axes = tuple(F.cut_axes(path, value, size, length, text=text))
            seen = self._cuttable.setdefault(path, (axes, tuple(value.shape), length))
            if seen[0] != axes:
                where = ".".join(map(str, path)) or "batch"

                def told(entry: tuple[tuple[int, ...], tuple[int, ...], int]) -> str:
                    cut, shape, at = entry
                    what = f"cut on axes {list(cut)}" if cut else "left whole"
                    return f"{what} in a batch of sequence length {at} (its shape {list(shape)})"

                raise DataConfigError(
                    f"seqlen_truncate: the batch's tensor {where!r} has a length of its own (an encoder-decoder's "
                    "targets, a [B, D] or [B, T, D] feature whose D matches the sequence length in some batches): "
                    "truncate_keys=None cuts every axis of the batch's sequence length, and "
                    f"{where!r} is {told(seen)} but {told((axes, tuple(value.shape), length))}. Name the tensors to "
                    "cut: truncate_keys=['input_ids', 'attention_mask'] (the source of an encoder-decoder), or a list "
                    "of yours. Sequences that are cut alike but padded each to its own length (a preference pair's "
                    "chosen_* and rejected_*) cannot be: pad them to one length in the collate, or concatenate them "
                    "along the batch axis ([2B, T], TRL's concatenated layout)"
                )

    def _transform(self, batch: Any, keys: Sequence[tuple]) -> EffiBatch:
        """The transforms and metadata of :meth:`__call__` on the user's collated ``batch`` of samples ``keys``."""
        _, step, micro, diffs = keys[0][:4]
        difficulty = dict(zip(self.metric_names, diffs))
        full_length = F.sequence_length(batch, self.truncate_keys)
        cut_mask, left, axes, mask_path, cut_values = None, False, {}, None, None
        if "seqlen_truncate" in difficulty:
            if full_length is None:
                which = (
                    f"none of truncate_keys {list(self.truncate_keys)} as a [B, S, ...] tensor"
                    if self.truncate_keys is not None
                    else "no tensor named attention_mask or input_ids and no integer [B, S] tensor (token ids, B "
                    "the first dimension of the batch's first tensor)"
                )
                if "edge_index" in F.tensor_names(batch) or any(
                    F.is_edge_list(batch, v) for _, v in F.tensor_leaves(batch)
                ):
                    which += (
                        " (a graph batch: its edge_index [2, E] is no sequence; order the graphs by a difficulty "
                        "metric of their size instead of cutting them)"
                    )
                raise DataConfigError(
                    f"seqlen_truncate: nothing to truncate: the training batch has {which}; found a "
                    f"{F.describe_batch(batch)}. Put the token ids in the batch as an integer [B, S] tensor (or name "
                    "the sequence tensors with truncate_keys, in a dict or dataclass batch), or remove "
                    "seqlen_truncate. A batch of continuous features [B, S, D] without token ids: a dict batch "
                    "{'x': ..., 'attention_mask': [B, S] with 1 or True at the real positions, ...}, or "
                    "truncate_keys naming its sequence tensors"
                )
            if self.truncate_keys is not None:
                names = F.tensor_names(batch)
                missing = [k for k in self.truncate_keys if k not in names]
                if missing:
                    raise DataConfigError(
                        f"curriculum truncate_keys {list(self.truncate_keys)}: {missing} name no tensor of the "
                        f"training batch, whose tensors are {names} (a {F.describe_batch(batch)}); seqlen_truncate "
                        "cuts only the tensors named, so the one a misspelt key means would stay at full length "
                        "(e.g. labels longer than the inputs). Name only tensors of the batch in truncate_keys "
                        "(check the spelling), or pass truncate_keys=None to cut every [B, S, ...] tensor"
                    )
            if self.truncate_keys is None and full_length is not None:
                self._check_consistent_cut(batch, len(keys), full_length)
            try:
                cut = F.truncate(
                    batch,
                    difficulty["seqlen_truncate"],
                    self.truncate_keys,
                    self.causal_label_shift,
                    self.keep_last_token,
                    batch_size=len(keys),
                    check_left_padding=not self._left_padding_checked and self.truncation_side == "right",
                    truncation_side=self.truncation_side,
                )
            except ValueError as e:
                raise DataConfigError(str(e)) from None
            if cut.length is not None and cut.full_length is not None and cut.length < cut.full_length:
                self._left_padding_checked = True  # the first cut of this collate (in each loader worker) is checked
            batch, cut_mask, left, axes = cut.batch, cut.cut_mask, cut.left, dict(zip(cut.cut, cut.axes))
            mask_path, cut_values = cut.mask_path, cut.cut_values
        if "seqlen_reshape" in difficulty:
            try:
                F.check_batch_first(batch, len(keys), technique="seqlen_reshape")
                batch = F.reshape_batch(batch, difficulty["seqlen_reshape"])
            except ValueError as e:
                raise DataConfigError(f"curriculum: {e}") from None
        meta: dict[str, Any] = dict(
            zip(
                BATCH_KEYS,
                (int(step), int(micro), difficulty, full_length, cut_mask, left, axes, mask_path, cut_values),
            )
        )
        if len(keys[0]) > 4:  # thinned by InfoBatch: (index, step, micro, difficulties, weight, candidates)
            candidates = int(keys[0][5])
            if any(int(k[5]) != candidates for k in keys):
                raise DataConfigError("curriculum + InfoBatch: one batch mixes samples of different slices")
            meta["index"] = torch.tensor([int(k[0]) for k in keys], dtype=torch.int64)
            meta["infobatch_weight"] = torch.tensor([float(k[4]) for k in keys], dtype=torch.float32)
            meta["infobatch_candidates"] = candidates
        return EffiBatch(batch, meta)


def check_length(dataset: Any, length: int) -> None:
    """Refuse a training set whose length is no longer ``length`` (the ``N`` of the fit's stream).

    Raises:
        DataConfigError: ``curriculum: the training dataset's length changed from {length} to {len(dataset)}``.
    """
    if len(dataset) != length:
        raise DataConfigError(
            f"curriculum: the training dataset's length changed from {length} to {len(dataset)}; it must stay "
            "constant during a run"
        )


#: training samples :func:`data_sequence_length` reads, at most (spread over the training set)
LENGTH_PROBES = 8


def data_sequence_length(
    dataset: Any,
    collate_fn: Callable | None,
    num_samples: int,
    keys: Sequence[str] | None = None,
    check: Callable[[Any, int], None] | None = None,
) -> int | None:
    """The sequence length ``S`` (tokens, :func:`~lightning_effi.curriculum.functional.sequence_length`) of every
    batch the user's collate makes from ``dataset``, when it is one length: up to :data:`LENGTH_PROBES` samples spread
    evenly over the training set (the first and the last included) are collated each alone and all together, and
    ``S`` is returned when every one of these batches has the same length (fixed-length samples, such as LM blocks,
    or a collate that pads to a fixed length). Used by ``Curriculum.setup`` to check a ``seqlen_truncate`` /
    ``seqlen_reshape`` range against the data (:meth:`~lightning_effi.curriculum.CurriculumConfig
    .check_data_length`).

    Returns None when the lengths differ (a collate that pads each batch to its longest sample: the data's length is
    not one number), when no sequence tensor is found, or when reading or collating raises (e.g. a data set that opens
    its files in the loader's workers; the training loader reports such errors itself).

    Args:
        dataset: the map-style training set. collate_fn: the training loader's (``None``: ``default_collate``).
        num_samples: ``len(dataset)``. keys: ``truncate_keys`` (None: automatic). check: called with the batch of
            the samples read and ``S`` when there is one length (``Curriculum.setup``'s check of the layout: no
            sample read twice); what it raises is raised.
    """
    if num_samples < 1:
        return None
    k = min(LENGTH_PROBES, num_samples)
    ids = sorted({(i * (num_samples - 1)) // max(1, k - 1) for i in range(k)})
    collate = collate_fn or default_collate
    try:
        samples = [dataset[i] for i in ids]
        lengths = {F.sequence_length(collate([x]), keys) for x in samples}
        batch = collate(samples)
        lengths.add(F.sequence_length(batch, keys))
    except Exception:  # the user's data or collate: left to the training loader, which raises it in context
        return None
    if len(lengths) != 1:
        return None
    length = lengths.pop()
    if check is not None and length is not None:
        check(batch, length)
    return length


#: training sets larger than this are not read whole by :func:`data_longest_sequence` (its pass reads every sample)
LONGEST_SCAN_LIMIT = 200_000
#: samples :func:`data_longest_sequence` collates at once
LONGEST_SCAN_CHUNK = 256


def data_longest_sequence(
    dataset: Any, collate_fn: Callable | None, num_samples: int, keys: Sequence[str] | None = None
) -> int | None:
    """The longest sequence (tokens, :func:`~lightning_effi.curriculum.functional.sequence_length`) of any batch the
    user's collate makes from ``dataset``, for data whose batches have no one length (:func:`data_sequence_length`
    returned None: a collate that pads each batch to its longest sample), or to confirm the one length its probes saw
    (rows of two lengths whose probed rows were all short ones). Every sample is read once, collated in
    chunks of :data:`LONGEST_SCAN_CHUNK` (a chunk is as long as its longest sample, and no batch is longer than its
    longest sample), so the result is the length of the training set's longest sample after the collate (its own cap
    included). Used by ``Curriculum.setup`` to check a ``seqlen_truncate`` range against the data.

    Returns None when the set has more than :data:`LONGEST_SCAN_LIMIT` samples (not read), when a batch has no
    sequence tensor, or when reading or collating raises (left to the training loader, which reports it in context).
    """
    if not 1 <= num_samples <= LONGEST_SCAN_LIMIT:
        return None
    collate = collate_fn or default_collate
    longest = 0
    try:
        for start in range(0, num_samples, LONGEST_SCAN_CHUNK):
            chunk = [dataset[i] for i in range(start, min(num_samples, start + LONGEST_SCAN_CHUNK))]
            length = F.sequence_length(collate(chunk), keys)
            if length is None:
                return None
            longest = max(longest, length)
    except Exception:  # the user's data or collate: left to the training loader, which raises it in context
        return None
    return longest


#: training samples :meth:`CurriculumDataModule.train_dataloader` reads, at most, to check the batch structure
PROBE_SAMPLES = 4


class CurriculumSampler:
    """Batch sampler over the controller's stream (this rank's micro-batches of the current data epoch, from the
    committed position). ``len()`` is the full per-epoch count, also after a mid-epoch resume (a shorter ``len()``
    would make Lightning end the resumed epoch early).

    Args:
        controller: the :class:`~lightning_effi.curriculum.CurriculumController` (this rank's stream).
        thinner: optional :class:`Thinner` (the InfoBatch callback): each micro-batch slice is passed through
            ``thinner.thin_keys(keys, controller.rank)``, which keeps a subset and appends ``(weight, candidates)`` to
            every kept key. The curriculum's stream, steps and ``len()`` are unchanged (a thinned micro-batch is still
            one micro-batch).
        dataset: optionally the training set the keys index: its length is checked against the controller's ``N``
            at every ``iter()``, i.e. at every epoch's start (the curriculum's loader is built once per fit, so a
            check when it is built would see only the first epoch).

    Raises:
        DataConfigError: (``iter()``) ``len(dataset)`` is no longer the ``N`` the stream was laid out for.
    """

    def __init__(self, controller: CurriculumController, thinner: Thinner | None = None, dataset: Any = None) -> None:
        self.controller = controller
        self.thinner = thinner
        self.dataset = dataset

    def __iter__(self) -> Iterator[list[tuple]]:
        if self.dataset is not None:
            check_length(self.dataset, self.controller.n)
        if self.thinner is None:
            return self.controller.micro_batches()
        return self._thinned(self.thinner)

    def _thinned(self, thinner: Thinner) -> Iterator[list[tuple]]:
        rank = self.controller.rank
        for keys in self.controller.micro_batches():
            yield thinner.thin_keys(keys, rank)

    def __len__(self) -> int:
        return len(self.controller)


class CurriculumDataLoader(DataLoader):
    """The curriculum's training loader. Its resume position lives in the :class:`~lightning_effi.callbacks.Curriculum`
    callback's state (the committed stream position), so the loader itself has nothing to save; it declares an empty
    state so that a checkpoint written by a stateful loader (e.g. a run without curriculum on a shipped DataModule)
    still loads (the curriculum then starts from its beginning)."""

    def __iter__(self) -> Any:
        """Tell the dataset (and those it wraps) the data epoch, when it has ``set_epoch`` (an augmentation seeded per
        sample and epoch: :func:`~lightning_effi.core.loader.set_dataset_epoch`), then iterate."""
        sampler = self.batch_sampler
        if isinstance(sampler, CurriculumSampler):
            set_dataset_epoch(self.dataset, sampler.controller.data_epoch)
        return super().__iter__()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Ignored: see the class docstring."""


class CurriculumDataModule(WrappingDataModule):
    """Wrap ``datamodule`` for curriculum learning. Everything but the training loader is delegated unchanged.

    Args:
        datamodule: any ``LightningDataModule`` whose ``train_dataloader()`` returns one ``DataLoader`` over a
            map-style dataset with a plain (shuffling or sequential) sampler; samples and batches of any structure.
        metrics: optionally the curriculum configuration (``{name: {difficulty_type, clustering_type,
            min_difficulty, max_difficulty, schedule_type, schedule_config, ...}}``; see :class:`~lightning_effi
            .curriculum.CurriculumConfig`). Give it here or to the :class:`~lightning_effi.callbacks.Curriculum`
            callback, not both.
        seed, num_epochs, rounding, percentile_rounding, dp_split, drop_last, truncate_keys, causal_label_shift,
            keep_last_token, truncation_side: the :class:`~lightning_effi.curriculum.CurriculumConfig` options that go
            with ``metrics``; ``None`` (the default) means "not given": the configuration's default. A LightningCLI
            or any other tool that fills every argument with its default can therefore build this wrapper around a
            configuration given to the callback.

    The callback (required in ``Trainer(callbacks=...)``) builds the controller in its ``setup`` and attaches it; an
    :class:`~lightning_effi.callbacks.InfoBatchCallback` in the Trainer attaches itself as ``thinner`` (InfoBatch then
    thins each drawn micro-batch, see "Composition" in the method card). Wrap the DataModule once, in either order
    with an :class:`~lightning_effi.data.InfoBatchDataModule` (or without one): the callbacks find their wrapper along
    the ``.datamodule`` chain, and the user's loader is read from the innermost DataModule. The
    rebuilt loader keeps the wrapped loader's workers, ``pin_memory``, ``prefetch_factor``, ``persistent_workers``,
    ``timeout``, ``multiprocessing_context`` and ``in_order``; its batch size is the micro-batch size. Batches are
    never dropped by the wrapped loader's ``drop_last``: the curriculum's own ``drop_last`` option governs the end of
    the sample budget.

    Raises:
        CurriculumConfigError: a bad configuration (at construction).
        DataConfigError: (at construction) options given without ``metrics``; (first ``train_dataloader()``) a custom
            sampler or batch sampler, an iterable dataset (:func:`~lightning_effi.core.wrapping.loader_template`);
            used without the callback (or a nested technique DataModule without its callback); a thinner with
            ``seqlen_reshape`` (its rows are no longer samples, so per-sample weights cannot follow them); with
            ``seqlen_truncate`` / ``seqlen_reshape``, a batch of the training set's first samples the transforms
            cannot work with, e.g. ``truncate_keys`` that name no tensor of the batch (:meth:`_check_batches`); (at
            every epoch's start) a training set whose length changed during the run (:class:`CurriculumSampler`).

    Example::

        dm = CurriculumDataModule(CausalLMDataModule(...), metrics={"seqlen_truncate": dict(
            difficulty_type="value", clustering_type="single_cluster", min_difficulty=16, max_difficulty=128,
            schedule_type="fixed_linear", schedule_config=dict(total_curriculum_step=300, difficulty_step=8))})
        pl.Trainer(max_steps=500, callbacks=[Curriculum()]).fit(model, dm)
    """

    technique = "curriculum"
    own_attributes = WrappingDataModule.own_attributes | {"config", "controller", "thinner"}

    def __init__(
        self,
        datamodule: pl.LightningDataModule,
        metrics: Mapping[str, Any] | None = None,
        seed: int | None = None,
        num_epochs: int | None = None,
        rounding: str | None = None,
        percentile_rounding: str | None = None,
        dp_split: str | None = None,
        drop_last: bool | None = None,
        truncate_keys: Sequence[str] | None = None,
        causal_label_shift: bool | None = None,
        keep_last_token: bool | None = None,
        truncation_side: str | None = None,
    ) -> None:
        if find_wrapper(datamodule, CurriculumDataModule) is not None:
            # the callback attaches its stream to the outer wrapper; the inner one's loader then said the callback was
            # missing from the Trainer, where it was (qa48-break 03)
            raise DataConfigError(
                "CurriculumDataModule: the DataModule it wraps is a CurriculumDataModule already (nested, e.g. by a "
                "config that wraps and by code that wraps again); wrap your DataModule once"
            )
        super().__init__(datamodule)
        given = dict(
            seed=seed,
            num_epochs=num_epochs,
            rounding=rounding,
            percentile_rounding=percentile_rounding,
            dp_split=dp_split,
            drop_last=drop_last,
            truncate_keys=truncate_keys,
            causal_label_shift=causal_label_shift,
            keep_last_token=keep_last_token,
            truncation_side=truncation_side,
        )
        options = {k: v for k, v in given.items() if v is not None}
        if metrics is None and options:
            raise DataConfigError(f"CurriculumDataModule: options {sorted(options)} given without metrics")
        self.config: CurriculumConfig | None = CurriculumConfig(metrics=metrics, **options) if metrics else None
        self.controller: CurriculumController | None = None  # attached by the Curriculum callback's setup()
        self.thinner: Thinner | None = None  # attached by an InfoBatch callback's setup() (composition)
        self._checked: dict[str, Any] | None = None  # the template whose batch structure was checked

    def check_attached(self) -> None:
        """Raise unless the Curriculum callback attached its controller.

        Raises:
            DataConfigError: no controller (the callback is missing from the Trainer).
        """
        if self.controller is None:
            raise DataConfigError(
                "CurriculumDataModule needs the Curriculum callback in Trainer(callbacks=[...]); "
                "without it use the wrapped DataModule directly"
            )

    def train_dataloader(self) -> CurriculumDataLoader:
        """The curriculum's training loader (see the module docstring), thinned when a thinner is attached."""
        self.check_attached()
        self._serve()
        assert self.controller is not None
        for inner in wrapper_chain(self)[1:-1]:  # nested technique wrappers need their callbacks too
            inner.check_attached()
        if self.thinner is not None and "seqlen_reshape" in self.controller.config.metrics:
            raise DataConfigError(
                "curriculum + InfoBatch: seqlen_reshape re-chunks each batch into rows that are no longer samples, so "
                "InfoBatch cannot weight them per sample; use seqlen_truncate, or one of the two techniques"
            )
        t = self.template()
        check_length(t["dataset"], t["length"])
        cfg = self.controller.config
        collate = CurriculumCollate(
            t["collate_fn"],
            list(cfg.metrics),
            cfg.truncate_keys,
            cfg.causal_label_shift,
            cfg.keep_last_token,
            cfg.truncation_side,
        )
        if self._checked is not t:  # once per fit (the template is read afresh at every setup("fit"))
            self._check_batches(t, collate)
            self._checked = t
        workers = t["num_workers"]
        return CurriculumDataLoader(
            CurriculumDataset(t["dataset"]),
            batch_sampler=CurriculumSampler(self.controller, self.thinner, t["dataset"]),
            collate_fn=collate,
            num_workers=workers,
            pin_memory=t["pin_memory"],
            worker_init_fn=t["worker_init_fn"],
            prefetch_factor=t["prefetch_factor"] if workers > 0 else None,
            persistent_workers=t["persistent_workers"] and workers > 0,
            timeout=t["timeout"],
            multiprocessing_context=t["multiprocessing_context"],
            in_order=t["in_order"],
        )

    def _check_batches(self, t: dict[str, Any], collate: CurriculumCollate) -> None:
        """With ``seqlen_truncate`` or ``seqlen_reshape`` configured, collate the training set's first samples (at
        most :data:`PROBE_SAMPLES` and the micro-batch size) with the user's collate function and run the transforms
        on them at the first step's difficulties (:meth:`CurriculumCollate.check`), so that a batch they cannot work
        with (``truncate_keys`` that name no tensor of the batch, no sequence tensor, a sequence-first batch, ...) is
        refused before training. The samples are read in this process; without a transform nothing is read.

        Raises:
            DataConfigError: as :meth:`CurriculumCollate.check`.
        """
        assert self.controller is not None
        if not {"seqlen_truncate", "seqlen_reshape"} & set(self.controller.config.metrics):
            return
        k = min(PROBE_SAMPLES, self.controller.mbs, t["length"])
        try:
            samples = [t["dataset"][i] for i in range(k)]
        except Exception:  # e.g. a dataset that opens its files in the loader's workers: left to the loader
            return
        first = self.controller.first_difficulties()
        collate.check(samples, [first[name] for name in collate.metric_names])
