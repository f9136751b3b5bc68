"""In-memory data analysis: per-sample metric values over a data set, computed in this process at ``setup`` (the
``analysis:`` key of a curriculum metric) instead of read from :class:`~lightning_effi.curriculum.analysis.DataAnalyzer`
index files. The method card is ``lightning_effi/curriculum/README.md``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sized
from typing import Any

import numpy as np
import torch

from lightning_effi.core.accounting import batch_size_of
from lightning_effi.core.checks import plain
from lightning_effi.core.indexed import sequence_lengths
from lightning_effi.curriculum.config import CurriculumConfigError

from .analyzer import _fetch, _to_numpy_result
from .metrics import get_metric

__all__ = ["analyze_in_memory"]

#: metrics computed in two passes (a ``total_vocab_freq`` histogram first) unless a ``freq`` option is given
_TWO_PASS = ("vocab_rarity", "seqlen_vocab_rarity")


def _metric_name(analysis: Any) -> tuple[str, dict[str, Any]]:
    """``(name, factory options)`` of an ``analysis`` entry (a name, ``{name: ..., **options}`` or a callable)."""
    if callable(analysis):
        return getattr(analysis, "__name__", repr(analysis)), {}
    options = dict(plain(analysis)) if isinstance(analysis, Mapping) else {"name": analysis}
    name = options.pop("name", None)
    if not isinstance(name, str):
        raise CurriculumConfigError(
            f"curriculum analysis: expected a metric name or {{name: ..., **options}}, got {analysis!r}"
        )
    return name, options


def _vocab_freq(name: str, options: dict[str, Any], loader: Any) -> np.ndarray | None:
    """First pass of a rarity metric: the ``total_vocab_freq`` histogram summed over the data set."""
    if "vocab_size" not in options:
        raise CurriculumConfigError(
            f"curriculum analysis {name}: give vocab_size (>= largest token id + 1) "
            "for the total_vocab_freq pass, or a precomputed freq"
        )
    counter = get_metric(
        "total_vocab_freq",
        vocab_size=options.pop("vocab_size"),
        **{k: options[k] for k in ("key", "mask_key", "pad_token_id") if k in options},
    )
    freq = None
    for batch in loader():
        v = np.asarray(counter(batch), dtype=np.int64)
        freq = v if freq is None else freq + v
    return freq


def _per_sample(name: str, values: Any, batch: Any) -> np.ndarray:
    """One batch's metric values as int64 ``[B]``, checked (integers by the analyzer's check, then the shape and the
    int64 range)."""
    if not isinstance(values, (torch.Tensor, np.ndarray)):
        values = np.asarray(values)  # a list of ints from a callable
    try:
        v = _to_numpy_result(values, name)
    except (TypeError, ValueError) as e:
        raise CurriculumConfigError(f"curriculum analysis: {e}") from None
    if v.dtype == np.uint64 and v.size and v.max() > np.iinfo(np.int64).max:
        raise CurriculumConfigError(
            f"curriculum analysis: metric {name!r} returned values above the int64 maximum; scale them down"
        )
    if v.shape != (batch_size_of(batch),):
        raise CurriculumConfigError(
            f"curriculum analysis: metric {name!r} returned shape {v.shape} for a batch "
            f"of {batch_size_of(batch)}; a per-sample metric returns [B]"
        )
    return v.astype(np.int64)


def analyze_in_memory(
    dataset: Any, analysis: str | Mapping[str, Any], collate_fn: Any = None, batch_size: int = 256
) -> np.ndarray:
    """Per-sample values of a registered analyzer metric over ``dataset`` (int64 ``[N]``), in this process: the map
    step of :class:`~lightning_effi.curriculum.analysis.DataAnalyzer` without files (every rank computes the same
    values).

    Args:
        analysis: a metric name (:func:`lightning_effi.curriculum.analysis.registered_metrics`), ``{"name": ...,
            **options}`` passed to the metric factory, or a callable ``fn(batch) -> int[B]``. ``vocab_rarity`` /
            ``seqlen_vocab_rarity`` without a ``freq`` option run two passes (as Megatron-DeepSpeed's
            ``analyze_data.py``): ``total_vocab_freq`` (needs ``vocab_size`` >= the largest token id + 1), then the
            rarity. ``seqlen`` uses the dataset's vectorised ``sequence_lengths()`` when it has one and no options
            are given.
        collate_fn: the training loader's collate function (or the curriculum's ``analysis_collate_fn``); the
            metric must read the same values from two collates of the same samples and from two fetches of them
            (checked on the first batch's samples, the global random state left as it was). batch_size: analysis
            batch size.

    Raises:
        CurriculumConfigError: unknown metric or options; a metric that cannot read a batch (its ``KeyError`` /
            ``TypeError`` / ``ValueError``, chained) or returning floats or a wrong shape; a ``collate_fn`` that
            collates the same samples into batches the metric reads other values from (random masking, as Hugging
            Face's ``DataCollatorForLanguageModeling``, or augmentation at collate time: each sample's difficulty
            would be a random draw); a dataset whose second fetch of the same samples the metric reads other values
            from (random augmentation in ``__getitem__``); a metric that gives a sample another value collated with
            others than alone (padding counted as tokens: the metric's ``pad_token_id`` names it).
    """
    name, options = _metric_name(analysis)
    if name == "seqlen" and not options and not callable(analysis):
        lengths = sequence_lengths(dataset)
        if lengths is not None:
            return np.asarray(lengths, dtype=np.int64)

    def loader() -> Any:
        return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate_fn)

    try:
        if name in _TWO_PASS and "freq" not in options:
            options["freq"] = _vocab_freq(name, options, loader)
        fn = analysis if callable(analysis) else get_metric(name, **options)
    except (KeyError, TypeError, ValueError) as e:
        raise CurriculumConfigError(f"curriculum analysis {name!r}: {e}") from None
    check_deterministic_collate(dataset, collate_fn, min(batch_size, len(dataset)), name, fn)
    out = [_per_sample(name, _run(name, fn, batch), batch) for batch in loader()]
    return np.concatenate(out) if out else np.zeros(0, np.int64)


#: how many of the first samples :func:`check_deterministic_collate` also collates one by one
ALONE_CHECKED = 32


class RandomDrawsError(CurriculumConfigError):
    """A collate or dataset that draws at random where a metric reads (:func:`check_deterministic_collate`)."""


def check_deterministic_collate(
    dataset: Any, collate_fn: Any, n: int, name: str, fn: Any, analyzer: bool = False
) -> None:
    """Fetch the first ``n`` samples of ``dataset`` twice, collate the first fetch twice and the second once, and
    compare the metric ``fn``'s values on the three batches; Python's, NumPy's and torch's global random states are
    then put back as they were. A collate or dataset that draws at random but leaves what the metric reads alone (a
    masked LM's masking under ``seqlen``, which reads the attention mask) passes. The first :data:`ALONE_CHECKED`
    samples are also collated one by one and all together: the metric must give each the value it gets in the batch
    (a metric that counts the padding a collate adds for a sample's batch-mates gave a sample 6, 12 or 13 as its
    analysis batch held 1, 4 or 20 samples, qa79-curriculum 01).

    Raises:
        RandomDrawsError: (a :class:`CurriculumConfigError`) the values differ: ``collate_fn`` draws at random
            (masking, augmentation) where the metric reads, or the dataset's ``__getitem__`` does (a torchvision
            transform with random augmentation), and an analysis through it gives each sample a random difficulty.
            The message names the collate function or the dataset and the ways out
            (``Curriculum(analysis_collate_fn=...)``, an offline index; with ``analyzer``, for
            :class:`~lightning_effi.curriculum.analysis.DataAnalyzer`: its own ``collate_fn`` and dataset). Also
            raised for a metric that gives a sample another value collated with others than alone (it reads the
            padding the collate adds: ``pad_token_id`` or an attention mask names it).
    """
    if n < 1:
        return
    collate = collate_fn if collate_fn is not None else torch.utils.data.default_collate
    state = random.getstate(), np.random.get_state()
    # the first samples one by one and together (however many the analysis batch holds: the first ones may be of one
    # length)
    alone = min(len(dataset), ALONE_CHECKED) if isinstance(dataset, Sized) else 0
    try:
        with torch.random.fork_rng(devices=[]):  # each fetch and collate draws on from where the last left the state
            samples = _fetch(dataset, list(range(n)))  # as the loader fetches (a batched __getitems__ first)
            again = _fetch(dataset, list(range(n)))
            batches = [collate(_copy(samples)), collate(_copy(samples)), collate(again)]
            singles, together = _alone_and_together(dataset, collate, alone)
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
    values = [_per_sample(name, _run(name, fn, batch), batch) for batch in batches]
    if not np.array_equal(values[0], values[1]):
        what = getattr(collate, "__qualname__", None) or type(collate).__name__
        if analyzer:
            raise RandomDrawsError(
                f"DataAnalyzer metric {name!r}: its collate_fn ({what}) collates the same {n} samples into batches on "
                f"which the metric gives other values ({int((values[0] != values[1]).sum())} of {n} samples differ: "
                "random masking or augmentation at collate time), so each sample's difficulty would be a random "
                "draw; pass DataAnalyzer(collate_fn=...) a collate without random draws"
            )
        raise RandomDrawsError(
            f"curriculum analysis {name!r}: its collate_fn ({what}; the training loader's unless "
            f"Curriculum(analysis_collate_fn=...) gives one) collates the same {n} samples into batches on which the "
            f"metric gives other values ({int((values[0] != values[1]).sum())} of {n} samples differ: random "
            "masking, as DataCollatorForLanguageModeling's, or augmentation at collate time), so the analysis would "
            "give each sample a random difficulty; pass "
            "Curriculum(analysis_collate_fn=...) a collate without random draws (for a masked LM, "
            "DataCollatorWithPadding(tokenizer): the metric reads the real tokens), or compute the index offline "
            "(DataAnalyzer) from the unmasked samples"
        )
    if singles and np.array_equal(values[0], values[1]) and np.array_equal(values[0], values[2]):
        each = np.concatenate([_per_sample(name, _run(name, fn, batch), batch) for batch in singles])
        batched = _per_sample(name, _run(name, fn, together), together)
        if not np.array_equal(batched, each):
            _refuse_batch_dependence(name, batched, each, analyzer)
    if not np.array_equal(values[0], values[2]):
        differ = int((values[0] != values[2]).sum())
        if analyzer:
            raise RandomDrawsError(
                f"DataAnalyzer metric {name!r}: the dataset ({type(dataset).__name__}) gives other samples at a second "
                f"fetch of the same indices: the metric reads other values for {differ} of its first {n} samples "
                "(random augmentation in __getitem__, a torchvision transform such as RandomCrop or ColorJitter), so "
                "each sample's difficulty would be a random draw; pass DataAnalyzer the dataset without its random "
                "transforms (the same samples, in the same order)"
            )
        raise RandomDrawsError(
            f"curriculum analysis {name!r}: the training dataset ({type(dataset).__name__}) gives other samples at a "
            f"second fetch of the same indices: the metric reads other values for {differ} of its first {n} samples "
            "(random augmentation in __getitem__, a torchvision transform such as "
            "RandomCrop or ColorJitter), so the analysis would give each sample a random difficulty; compute the index "
            "offline (DataAnalyzer) on the dataset without its random transforms and give it as "
            "index_to_sample_path / index_to_metric_path, or make the metric read what the augmentation leaves alone"
        )


def _alone_and_together(dataset: Any, collate: Any, alone: int) -> tuple[list[Any], Any]:
    """The first ``alone`` samples collated one by one, and all together; ``([], None)`` where the collate cannot
    batch them (ragged samples under ``default_collate``, analysed one at a time: nothing to pad, qa81-regress 02)."""
    if alone < 2:
        return [], None
    try:
        singles = [collate(_copy(_fetch(dataset, [i]))) for i in range(alone)]
        together = collate(_copy(_fetch(dataset, list(range(alone)))))
    except Exception:  # noqa: BLE001 - a collate that cannot batch these samples pads nothing: no check
        return [], None
    return singles, together


def _refuse_batch_dependence(name: str, together: np.ndarray, each: np.ndarray, analyzer: bool) -> None:
    """Raise :class:`RandomDrawsError`: the metric ``name`` reads other values for the first samples collated together
    (``together``) than collated one by one (``each``)."""
    differ = np.flatnonzero(together != each)
    i = int(differ[0])
    where = "DataAnalyzer metric" if analyzer else "curriculum analysis"
    if np.array_equal(np.sort(together), np.sort(each)):  # the same values at other positions
        raise RandomDrawsError(
            f"{where} {name!r}: the collate puts the samples of a batch in another order (the first {len(each)} "
            f"samples collated together give the values of the samples collated alone at other positions; "
            f"{len(differ)} differ), so the analysis would give each sample the difficulty of another; collate the "
            "samples in the order they come (sort the batch in the module, or give the analysis a collate that keeps "
            "the order: Curriculum(analysis_collate_fn=...), DataAnalyzer(collate_fn=...))"
        )
    raise RandomDrawsError(
        f"{where} {name!r}: the metric gives the first {len(each)} samples other values collated together than "
        f"each collated alone ({len(differ)} differ; sample {i}: {int(together[i])} in a batch, {int(each[i])} "
        "alone): it reads what the collate adds to a sample for its batch-mates (padding to the longest one), so a "
        "sample's difficulty would depend on the batch it is analysed in. Tell the metric which tokens are padding: "
        "its pad_token_id option (e.g. {'name': 'vocab_rarity', 'vocab_size': V, 'pad_token_id': <your pad id>}; "
        "vocab_rarity and total_vocab_freq count every token by default) or an attention_mask in the batch (its "
        "mask_key); a metric of your own reads each sample's real tokens only"
    )


def _copy(samples: Any) -> Any:
    """A list of samples as a new list (a collate may consume it); a batched fetch's own object as it is."""
    return list(samples) if isinstance(samples, list) else samples


def _run(name: str, fn: Any, batch: Any) -> Any:
    """``fn(batch)``; its ``KeyError`` / ``TypeError`` / ``ValueError`` re-raised as a :class:`CurriculumConfigError`
    naming the analysis and the batch's type (the original chained)."""
    try:
        return fn(batch)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, CurriculumConfigError):
            raise
        msg = e.args[0] if isinstance(e, KeyError) and len(e.args) == 1 else str(e)
        raise CurriculumConfigError(
            f"curriculum analysis {name!r} on a {type(batch).__name__} batch of the training loader (its collate_fn): "
            f"{msg}"
        ) from e
