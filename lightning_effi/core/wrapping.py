"""Reading a wrapped DataModule's training loader, for technique DataModules that rebuild it (InfoBatch, curriculum).

A technique that owns the sampling order takes the user's loader apart (dataset, batch size, collate function,
workers, ...) and builds its own loader from the pieces. Only plain loaders qualify: a custom sampler or batch
sampler would be silently replaced, so it is rejected with a clear error instead.

Technique DataModules may be nested (``CurriculumDataModule(InfoBatchDataModule(dm))`` when InfoBatch thins inside the
curriculum's sampler): every wrapper reads the innermost (the user's) loader, and a callback finds its wrapper along
the ``.datamodule`` chain with :func:`find_wrapper`.

A technique that changes a module or a Trainer for the length of a fit marks what it left with :func:`live_fit`, so
that the ``setup`` of a later fit can tell the leftovers of a fit that ended without undoing them (one whose
``on_exception`` never ran) from those of a fit that is still running on the same module.
"""

from __future__ import annotations

import copy
import functools
import importlib
import sys
import weakref
from collections.abc import Callable, Mapping, Sized
from typing import Any, TypeVar

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities import AttributeDict, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    Subset,
)

from lightning_effi.core.batch import unwrap
from lightning_effi.core.errors import DataConfigError
from lightning_effi.core.loader import EpochShuffleSampler, SkippableSampler

W = TypeVar("W", bound="WrappingDataModule")

#: the batch hooks a LightningModule and a LightningDataModule share (Lightning's ``_DataHookSelector``)
BATCH_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")

#: samplers that only shuffle (or not): a technique may replace them without changing the semantics. A subclass
#: counts as one of them only if it keeps their ``__iter__`` and ``__len__`` (:func:`custom_order`)
PLAIN_SAMPLERS = (RandomSampler, SequentialSampler, EpochShuffleSampler, DistributedSampler)

#: the settings a technique's refusal message recommends instead
_PLAIN_LOADER = (
    "accepts only plain shuffling loaders: DataLoader(dataset, batch_size=..., shuffle=True/False, drop_last=...), "
    "no custom sampler or batch_sampler"
)


def custom_order(sampler: Any) -> str | None:
    """Why ``sampler`` is not a plain shuffling (or sequential) sampler that a technique may replace without changing
    what the run trains on; None when it is one.

    Plain: an instance of :data:`PLAIN_SAMPLERS` (``RandomSampler``, ``SequentialSampler``, ``DistributedSampler``,
    lightning_effi's :class:`~lightning_effi.core.loader.EpochShuffleSampler`) whose class keeps one of their
    ``__iter__`` and ``__len__`` (a subclass that only adds attributes is plain), and, for a ``RandomSampler``, one
    that draws every sample once per epoch (no ``replacement``, ``num_samples == len(data_source)``). A
    :class:`~lightning_effi.core.loader.SkippableSampler` (the resumable loader's wrapper, e.g. of the
    ``SequentialSampler`` that ``overfit_batches`` puts in) is judged by the sampler it wraps.

    Returns:
        None, or a short reason (``"a RandomSampler subclass that overrides __iter__"``, ...).
    """
    while isinstance(sampler, SkippableSampler):
        sampler = sampler.sampler
    cls = type(sampler)
    plain = PLAIN_SAMPLERS + _torchdata_classes()[:1] + _torchdata_classes()[3:]
    base = next((b for b in plain if isinstance(sampler, b)), None)
    if base is None:
        return "a custom sampler"
    overridden = [
        name for name in ("__iter__", "__len__") if getattr(cls, name) not in {getattr(b, name) for b in plain}
    ]
    if overridden:
        return f"a {base.__name__} subclass that overrides {' and '.join(overridden)} (its own order)"
    if isinstance(sampler, RandomSampler) or base.__name__ == "RandomSampler":
        if sampler.replacement:
            return "a RandomSampler that draws with replacement"
        if sampler.num_samples != len(sampler.data_source):
            return (
                f"a RandomSampler that draws num_samples={sampler.num_samples} of the dataset's "
                f"{len(sampler.data_source)} samples per epoch"
            )
    return None


def _torchdata_classes() -> tuple[type, ...]:
    """torchdata's ``StatefulDataLoader`` pieces, when torchdata is in use (imported), in this order: its
    ``RandomSampler`` and ``BatchSampler`` (``shuffle=True`` builds them: the stateful twins of torch's, which shuffle
    and batch alike), the loader class, and its ``StatefulDistributedSampler`` (``DistributedSampler``'s order,
    qa99-regress 03); empty otherwise. Its loader was refused as one with a custom batch sampler that groups samples by
    length (qa98-break 04)."""
    module = sys.modules.get("torchdata.stateful_dataloader")
    sampler = sys.modules.get("torchdata.stateful_dataloader.sampler")
    if module is None or sampler is None:
        return ()
    return (sampler.RandomSampler, sampler.BatchSampler, module.StatefulDataLoader, sampler.StatefulDistributedSampler)


def _own_iteration(loader: DataLoader) -> list[str]:  # type: ignore[type-arg]
    """The iteration methods (``__iter__``, ``__len__``, ``_get_iterator``) that ``loader``'s class defines itself,
    below ``DataLoader``: a subclass that transforms each batch as it iterates, which a rebuilt plain loader would
    drop (qa98-break 01). lightning_effi's ``ResumableDataLoader`` and torchdata's ``StatefulDataLoader`` (which
    only save the loader's position) are not counted."""
    from lightning_effi.core.loader import ResumableDataLoader

    kept = (DataLoader, ResumableDataLoader, *_torchdata_classes()[2:3])
    own = []
    for name in ("__iter__", "__len__", "_get_iterator"):
        defining = next((k for k in type(loader).__mro__ if name in vars(k)), DataLoader)
        if not any(defining is k for k in kept):
            own.append(name)
    return own


def loader_template(loader: Any, technique: str, world: tuple[int, int] | None = None) -> dict[str, Any]:
    """The settings of ``loader`` a technique needs to rebuild it. Only a plain loader qualifies (its sampler and batch
    sampler would be replaced, so anything else would silently train another order): ``DataLoader(dataset,
    batch_size=B, shuffle=..., drop_last=...)`` over a map-style dataset, or one whose sampler is plain
    (:func:`custom_order`) and batched by a ``BatchSampler`` that the loader built itself from its ``batch_size``.

    Args:
        world: ``(trainer.world_size, trainer.global_rank)``: a ``DistributedSampler`` of another world or rank is
            refused (the technique shards the whole dataset over the Trainer's ranks, so it would train every
            sample, not the sampler's shard).

    Returns:
        ``{dataset, batch_size, drop_last, collate_fn, num_workers, pin_memory, worker_init_fn, prefetch_factor,
        persistent_workers, timeout, multiprocessing_context, in_order, length}``.

    Warns:
        UserWarning: a sequential loader (``shuffle=False``): the technique's own random order replaces it.

    Raises:
        DataConfigError: (naming ``technique`` and what was found) not one ``DataLoader``; an ``IterableDataset`` or
            a dataset without ``len()``; a custom sampler, a subclass of a plain sampler with its own ``__iter__`` /
            ``__len__``, a ``RandomSampler`` with ``replacement`` or another ``num_samples``, a ``DistributedSampler``
            whose ``num_replicas`` / ``rank`` are not ``world``'s; a custom batch sampler;
            an explicit ``batch_sampler=BatchSampler(...)`` (the loader's ``batch_size`` is then None); no automatic
            batching (``batch_size=None``).
    """
    if not isinstance(loader, DataLoader):
        several = isinstance(loader, (Mapping, list, tuple)) or type(loader).__name__ == "CombinedLoader"
        reason = (
            f" (several training loaders): {technique} chooses each step's samples from one training set by index, "
            "so it owns one loader's sampler; put the sources in one map-style dataset "
            "(torch.utils.data.ConcatDataset, with a key in each sample if the step must tell them apart) behind one "
            "DataLoader"
            if several
            else ""
        )
        raise DataConfigError(
            f"{technique}: the wrapped train_dataloader() must return one DataLoader, got {type(loader).__name__}"
            + reason
        )
    own = _own_iteration(loader)
    if own:
        raise DataConfigError(
            f"{technique}: the wrapped training loader is a {type(loader).__name__}, a DataLoader subclass with its "
            f"own {' and '.join(own)}; {technique} owns the sampler and rebuilds the loader as a plain DataLoader from "
            "its settings (dataset, batch_size, collate_fn, workers), so what the subclass does as it iterates (a "
            "transform of each batch, another order) would be lost in silence. Do that work in the dataset, the "
            "collate_fn, or the LightningModule (on_after_batch_transfer, training_step), and return a DataLoader"
        )
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        raise DataConfigError(
            f"{technique}: the training dataset must be map-style; IterableDataset is not supported (got "
            f"{type(dataset).__name__}): {technique} chooses the samples by index, so the dataset needs __len__ and "
            "__getitem__ (a torch.utils.data.Dataset)"
        )
    if not isinstance(dataset, Sized):
        raise DataConfigError(
            f"{technique}: the training dataset must be map-style with a length; {type(dataset).__name__} has no "
            f"__len__ ({technique} chooses the samples by index among len(dataset))"
        )
    batch_sampler = loader.batch_sampler
    sampler = getattr(batch_sampler, "sampler", loader.sampler)
    while isinstance(sampler, SkippableSampler):  # a ResumableDataLoader's wrapper of a plain sampler
        sampler = sampler.sampler
    found = f"{technique}: the wrapped training loader uses {type(sampler).__name__} / {type(batch_sampler).__name__}"
    if batch_sampler is None:
        raise DataConfigError(
            f"{found}: batch_size=None (no automatic batching: every sample is a batch); {technique} owns the "
            f"sampler and {_PLAIN_LOADER}"
        )
    if type(batch_sampler) is not BatchSampler and type(batch_sampler) not in _torchdata_classes()[1:2]:
        raise DataConfigError(
            f"{found}; {technique} owns the sampler and {_PLAIN_LOADER}. It draws each batch's samples itself, so a "
            "batch sampler that groups samples by length cannot be kept: to pad less, pack the sequences into rows "
            "of a fixed length, or crop them, in the dataset"
        )
    assert isinstance(batch_sampler, BatchSampler)  # torch's, or torchdata's stateful subclass of it
    if loader.batch_size is None:
        raise DataConfigError(
            f"{found} given as DataLoader(batch_sampler=...) (the loader's batch_size is None); {technique} owns "
            f"the sampler and the batch sampler and rebuilds the loader from its batch_size, so it {_PLAIN_LOADER}"
            f" (here DataLoader(dataset, batch_size={batch_sampler.batch_size}, "
            f"drop_last={batch_sampler.drop_last}, shuffle=...))"
        )
    why = custom_order(sampler)
    if why is not None:
        raise DataConfigError(f"{found} ({why}); {technique} owns the sampler and {_PLAIN_LOADER}")
    source = getattr(sampler, "dataset" if isinstance(sampler, DistributedSampler) else "data_source", None)
    if isinstance(source, Sized) and len(source) != len(dataset):
        # RandomSampler(range(20)) over 40 samples trained all 40 (qa98-break 05)
        raise DataConfigError(
            f"{found} over {len(source)} samples, while the loader's dataset holds {len(dataset)}: {technique} owns "
            "the sampler and draws from the whole dataset, so the run would train samples your sampler never gives; "
            "give those samples as the dataset (torch.utils.data.Subset(dataset, indices)) behind a plain loader"
        )
    if isinstance(sampler, DistributedSampler) and world is not None:
        shard, ranks = (int(sampler.rank), int(sampler.num_replicas)), (int(world[1]), int(world[0]))
        if shard != ranks:
            raise DataConfigError(
                f"{found}: a DistributedSampler(num_replicas={shard[1]}, rank={shard[0]}), while this Trainer runs "
                f"rank {ranks[0]} of {ranks[1]}: {technique} owns the sampler and shards the whole dataset over the "
                "Trainer's ranks itself, so it would train every sample, not the sampler's shard; give the shard "
                "as the dataset (torch.utils.data.Subset(dataset, indices)) with a plain loader, or leave the "
                "sharding to the Trainer"
            )
    if isinstance(sampler, SequentialSampler) or getattr(sampler, "shuffle", True) is False:
        rank_zero_warn(
            f"{technique}: the wrapped training loader keeps its samples in order ({type(sampler).__name__}, "
            f"shuffle=False), but {technique} owns the sampler and draws each epoch's samples in its own random "
            "order (seeded, as its reference does): the sequential order is not kept"
        )
    return dict(
        dataset=loader.dataset,
        batch_size=loader.batch_size,
        drop_last=loader.drop_last,
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        worker_init_fn=loader.worker_init_fn,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
        timeout=loader.timeout,
        multiprocessing_context=loader.multiprocessing_context,
        in_order=getattr(loader, "in_order", True),
        length=len(loader.dataset),  # type: ignore[arg-type]
    )


class LiveFit:
    """``running(current)`` of :func:`live_fit`: a callable object, so that a technique callback holding one can be
    pickled after a fit (``strategy="ddp_spawn"`` pickles the callbacks to start its processes). A pickled copy (in
    another process) refers to no fit; a deep copy shares the original's reference, as a function would."""

    def __init__(self, trainer: Any) -> None:
        self._ref: Callable[[], Any] | None
        try:
            self._ref, self._strong = weakref.ref(trainer), None
        except TypeError:  # a stand-in without weak references (tests)
            self._ref, self._strong = None, trainer

    def __call__(self, current: Any) -> bool:
        owner = self._ref() if self._ref is not None else self._strong
        status = getattr(getattr(owner, "state", None), "status", None)
        return owner is not None and owner is not current and status == TrainerStatus.RUNNING

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._ref, self._strong = None, None

    def __deepcopy__(self, memo: dict[int, Any]) -> LiveFit:
        return self


def live_fit(trainer: Any) -> Callable[[Any], bool]:
    """``running(current)``: whether the fit ``trainer`` runs now is still going, seen from the ``setup`` of a fit on
    the Trainer ``current``: True while ``trainer``'s status is ``RUNNING``, unless ``current`` is ``trainer`` itself
    (a Trainer runs one fit at a time, so its earlier fit is over) or ``trainer`` is gone (held weakly where it can
    be). A :class:`LiveFit`: picklable (its pickled copy refers to no fit)."""
    return LiveFit(trainer)


def wrapper_chain(datamodule: Any) -> list[Any]:
    """``[datamodule, datamodule.datamodule, ...]``: the DataModule and every DataModule it wraps, outermost first,
    down to the first one that is not a :class:`WrappingDataModule` (the user's)."""
    chain = [datamodule]
    while isinstance(chain[-1], WrappingDataModule):
        chain.append(chain[-1].datamodule)
    return chain


def find_wrapper(datamodule: Any, cls: type[W]) -> W | None:
    """The outermost DataModule of class ``cls`` along ``datamodule``'s ``.datamodule`` chain (``datamodule`` itself
    included); None when there is none (also for ``datamodule=None``)."""
    for dm in wrapper_chain(datamodule):
        if isinstance(dm, cls):
            return dm
    return None


def _same_dataset(a: Any, b: Any) -> bool:
    """Whether two datasets hold the same samples in the same order: the same object, or ``Subset`` views (rebuilt
    at each call of a ``train_dataloader()``) of the same dataset at the same indices."""
    if a is b:
        return True
    if type(a) is Subset and type(b) is Subset:
        return _same_dataset(a.dataset, b.dataset) and list(a.indices) == list(b.indices)
    return False


class _Same:
    """A value compared by identity (``a == b`` is ``a is b``), holding it so its id is not reused."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.value is self.value

    __hash__ = None  # type: ignore[assignment]


def _settings_of(datamodule: Any) -> tuple[dict[str, _Same], dict[str, _Same]]:
    """The user's DataModule's public attributes and its hyperparameters, by identity: what a setting handed to it
    (``trainer.datamodule.scale = 2``, ``trainer.datamodule.hparams.scale = 2``) changes."""
    attributes = {k: _Same(v) for k, v in vars(datamodule).items() if not k.startswith("_")}
    hparams = getattr(datamodule, "_hparams", None)
    try:
        own = {str(k): _Same(v) for k, v in dict(hparams).items()} if hparams is not None else {}
    except (TypeError, ValueError):
        own = {}
    return attributes, own


class EvaluationLoader:
    """An evaluation loader hook of :class:`WrappingDataModule` (``val_dataloader``, ...): the wrapped DataModule's,
    read when Lightning looks it up (``method``: the name of a subclass's own implementation, used instead of
    delegating). Lightning reads whether a loader is defined off the outermost DataModule (``is_overridden``): a
    wrapped DataModule that does not define it (at that moment: a hook assigned later counts) gives
    ``LightningDataModule``'s own, so the run reads as without it (validation skipped) rather than calling one that
    raises."""

    name = ""

    def __init__(self, method: str | None = None) -> None:
        self.method = method  # the wrapper's own implementation, a method of that name (None: the wrapped one's)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        inner = instance.__dict__.get("datamodule")
        if inner is not None and not is_overridden(self.name, inner, pl.LightningDataModule):
            return getattr(inner, self.name)
        if self.method is not None:
            return getattr(instance, self.method)
        return functools.partial(_call_inner, instance, self.name)


def _call_inner(wrapper: Any, name: str) -> Any:
    """The wrapped DataModule's loader hook ``name``."""
    return getattr(wrapper.datamodule, name)()


#: the instantiator ``LightningCLI`` records in the hyperparameters it hands a module (``lightning.pytorch.cli``)
CLI_INSTANTIATOR = "lightning.pytorch.cli.instantiate_module"


def _resolve(path: Any) -> Any:
    """The object a dotted ``class_path`` names, or None."""
    if not isinstance(path, str) or "." not in path:
        return None
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _cli_wrapper_config(hparams: Any) -> dict[str, Any] | None:
    """``hparams`` when they are a ``LightningCLI`` ``data`` entry of a technique wrapper (``_instantiator`` the CLI's,
    ``_class_path`` a :class:`WrappingDataModule`, the wrapped DataModule's entry under ``datamodule``); None
    otherwise."""
    if not isinstance(hparams, Mapping) or hparams.get("_instantiator") != CLI_INSTANTIATOR:
        return None
    cls = _resolve(hparams.get("_class_path"))
    if not (isinstance(cls, type) and issubclass(cls, WrappingDataModule)) or not isinstance(
        hparams.get("datamodule"), Mapping
    ):
        return None
    return dict(hparams)


def _entry_of(config: Mapping[str, Any], cls: type) -> Mapping[str, Any] | None:
    """The entry (``{class_path, init_args}``) of class ``cls`` among the DataModules nested in a wrapper's CLI
    config (``datamodule``, its ``init_args.datamodule``, ...), or None."""
    node = config.get("datamodule")
    while isinstance(node, Mapping) and "class_path" in node:
        if _resolve(node["class_path"]) is cls:
            return node
        node = (node.get("init_args") or {}).get("datamodule")
    return None


class WrappingDataModule(pl.LightningDataModule):
    """Base of the technique DataModules: wraps ``datamodule`` and delegates everything but ``train_dataloader``
    (``prepare_data``, ``setup``, ``teardown``, ``on_exception``, the evaluation loaders, ``state_dict``,
    ``model_hints``).
    :meth:`template` reads the innermost (the user's) training loader once (:func:`loader_template`), also when
    wrappers are nested.

    The batch hooks (``on_before_batch_transfer``, ``transfer_batch_to_device``, ``on_after_batch_transfer``) go where
    Lightning would send them without the wrapper: the user's DataModule's when it overrides the hook, else the
    LightningModule's, else Lightning's default. Before that, ``on_before_batch_transfer`` takes a technique's
    :class:`~lightning_effi.core.batch.EffiBatch` apart, keeps its ``meta`` in :attr:`effi_batch_meta` (read with
    :func:`~lightning_effi.core.batch.batch_meta`) and passes on the user's batch, so no user hook ever sees the
    techniques' metadata.

    The user's DataModule stays reachable through the wrapper: an attribute the wrapper does not have is read from
    (and set on) the wrapped DataModule (``trainer.datamodule.num_classes`` in a module's ``setup``), and its
    hyperparameters (``save_hyperparameters()``) are the wrapper's, so the checkpoint and the loggers hold them
    (``MyDataModule.load_from_checkpoint(path)`` rebuilds it with them) as without the wrapper.

    Raises:
        DataConfigError: ``datamodule`` is not a ``LightningDataModule``.
    """

    technique = "technique"
    #: the wrapper's own public attributes (set by it or by its callback): never read from or set on the wrapped
    #: DataModule, which may have one of the same name (a user's ``config``)
    own_attributes: frozenset[str] = frozenset({"datamodule", "effi_batch_meta"})

    def __init__(self, datamodule: pl.LightningDataModule) -> None:
        super().__init__()
        if not isinstance(datamodule, pl.LightningDataModule):
            raise DataConfigError(f"data.datamodule: expected a LightningDataModule, got {type(datamodule).__name__}")
        self.datamodule = datamodule
        self._adopt_cli_hparams(datamodule)
        self._template: dict[str, Any] | None = None
        #: the user's Trainer's reload_dataloaders_every_n_epochs when the fit started (before a technique set it),
        #: and the last epoch whose reload was checked (:meth:`_check_reload`)
        self._user_reload_every = 0
        self._reload_checked = -1
        self._reload_base = 0  # the epoch the user's loader was last read at (_check_reload)
        #: the ``meta`` of the training batch in flight (see the class docstring); None between runs
        self.effi_batch_meta: dict[str, Any] | None = None
        #: a fit's setup is under way: from this wrapper's ``setup("fit")`` to the first training loader it serves
        #: (:meth:`_serve`, which reads the user's loader again when a setting was handed to it since its last read:
        #: ``_user_state``, its settings then)
        self._setup_open = False
        self._user_state: tuple[dict[str, _Same], dict[str, _Same]] | None = None

    def _adopt_cli_hparams(self, datamodule: pl.LightningDataModule) -> None:
        """Under ``LightningCLI``, every ``LightningDataModule`` built for the ``data`` entry is handed that entry's
        config as its hyperparameters (``cli._InstantiatorFn``), so a DataModule wrapped inside this one that calls
        ``save_hyperparameters()`` got the wrapper's config (``_class_path`` this wrapper, its own settings under
        ``datamodule``) and failed reading its own (qa39-user 01). Give it its own settings, from its entry in that
        config, and give the outermost wrapper the whole ``data`` config (the loggers' and the checkpoint's
        DataModule hyperparameters). Nothing happens outside the CLI."""
        config = getattr(datamodule, "_effi_cli_data_config", None)
        if config is None:
            config = _cli_wrapper_config(getattr(datamodule, "_hparams", None))
            if config is None:
                return
            entry = _entry_of(config, type(datamodule))
            if entry is not None:  # the user's DataModule: its own settings
                own = {"_class_path": entry["class_path"], **(entry.get("init_args") or {})}
                own.update(entry.get("dict_kwargs") or {})
                own["_instantiator"] = config["_instantiator"]
                datamodule._hparams = AttributeDict(own)
                datamodule._hparams_initial = copy.deepcopy(datamodule._hparams)  # type: ignore[attr-defined]
        if _resolve(config.get("_class_path")) is type(self):  # the outermost wrapper: the CLI's data entry
            self._hparams = AttributeDict(config)  # its own (not _set_hparams: without own ones, hparams are inner's)
            self._hparams_initial = copy.deepcopy(self._hparams)
        else:  # a wrapper inside another: hand the config on
            self._effi_cli_data_config = config

    # ------------------------------------------------------------------------------ the wrapped DataModule's
    def __getattr__(self, name: str) -> Any:
        """An attribute this wrapper does not have (a public one, or ``_hparams_name``): the wrapped DataModule's, as
        ``trainer.datamodule.<name>`` read it without the wrapper (an ``AttributeError`` before, qa79-curriculum 03).

        Raises:
            AttributeError: neither this wrapper nor the wrapped DataModule has ``name``.
        """
        inner = self.__dict__.get("datamodule")
        if inner is None or name in self.own_attributes or (name.startswith("_") and name != "_hparams_name"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            return getattr(inner, name)
        except AttributeError:
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r} (nor has the {type(inner).__name__} it "
                "wraps)"
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        """Set a public attribute this wrapper does not have (not one of :attr:`own_attributes`, none of its class or
        set before it wrapped the DataModule) on the wrapped DataModule, where its loaders read it, as
        ``trainer.datamodule.<name> = ...`` set it without the wrapper (``num_workers = 4``; a new attribute too,
        which landed on the wrapper: the user's loader read its own, qa81-break 03); any other on this wrapper. A
        subclass lists the public attributes it sets on itself in :attr:`own_attributes`."""
        inner = self.__dict__.get("datamodule")
        if (
            inner is not None
            and not name.startswith("_")
            and name not in self.own_attributes
            and name not in self.__dict__
            and not hasattr(type(self), name)
        ):
            setattr(inner, name, value)
        else:
            super().__setattr__(name, value)

    @property
    def prepare_data_per_node(self) -> bool:
        """The wrapped DataModule's (Lightning reads it off ``trainer.datamodule``: the wrapper's default ``True`` ran
        the user's ``prepare_data`` on every node where it asked for one, qa81-break 02)."""
        return self._inner_setting("prepare_data_per_node", True)

    @prepare_data_per_node.setter
    def prepare_data_per_node(self, value: bool) -> None:
        self._set_inner_setting("prepare_data_per_node", value)

    @property
    def allow_zero_length_dataloader_with_multiple_devices(self) -> bool:
        """The wrapped DataModule's (read off ``trainer.datamodule`` by Lightning, as :attr:`prepare_data_per_node`)."""
        return self._inner_setting("allow_zero_length_dataloader_with_multiple_devices", False)

    @allow_zero_length_dataloader_with_multiple_devices.setter
    def allow_zero_length_dataloader_with_multiple_devices(self, value: bool) -> None:
        self._set_inner_setting("allow_zero_length_dataloader_with_multiple_devices", value)

    def _inner_setting(self, name: str, default: bool) -> bool:
        """A Lightning setting of the wrapped DataModule (this wrapper's own value, or ``default``, before it wraps)."""
        inner = self.__dict__.get("datamodule")
        return bool(getattr(inner, name) if inner is not None else self.__dict__.get(f"_effi_{name}", default))

    def _set_inner_setting(self, name: str, value: bool) -> None:
        inner = self.__dict__.get("datamodule")
        if inner is None:  # LightningDataModule.__init__ sets the defaults, before the wrapped one is known
            self.__dict__[f"_effi_{name}"] = value
        else:
            setattr(inner, name, value)

    def _own_hparams(self) -> bool:
        """Whether this wrapper has hyperparameters of its own (the ``LightningCLI`` data entry's config)."""
        return bool(self.__dict__.get("_hparams"))

    @property
    def hparams(self) -> Any:
        """This wrapper's hyperparameters where it has its own (under ``LightningCLI``: the ``data`` entry's config),
        else the wrapped DataModule's (its ``save_hyperparameters()``), which Lightning writes to the checkpoint
        (``datamodule_hyper_parameters``) and the loggers as without the wrapper; they were lost (a DataModule
        rebuilt by ``load_from_checkpoint`` with its defaults, qa79-curriculum 02)."""
        if self._own_hparams():
            return super().hparams
        return self.datamodule.hparams

    @property
    def hparams_initial(self) -> Any:
        """The initial hyperparameters, of this wrapper or the wrapped DataModule (see :attr:`hparams`)."""
        if self._own_hparams():
            return super().hparams_initial
        return self.datamodule.hparams_initial

    def _set_hparams(self, hp: Any) -> None:
        """This wrapper's own hyperparameters (a subclass's ``save_hyperparameters()``): Lightning's would update
        :attr:`hparams`, the wrapped DataModule's while the wrapper has none (they were changed, and the wrapper
        failed, qa81-regress 03)."""
        hp = self._to_hparams_dict(hp)
        own = self.__dict__.get("_hparams")
        if isinstance(hp, dict) and isinstance(own, dict):
            own.update(hp)
        else:
            self._hparams = hp

    @property
    def _log_hyperparams(self) -> bool:
        """Whether Lightning logs the DataModule's hyperparameters: where this wrapper has its own (the CLI's data
        entry, a subclass's ``save_hyperparameters()``), its own choice (``False`` under the CLI, as before: the data
        entry's unset options, ``None``, clashed with the module's hyperparameters of the same names, qa81-regress
        01); else the wrapped DataModule's (``save_hyperparameters(logger=...)``)."""
        own = bool(self.__dict__.get("_effi_log_hyperparams", False))
        if self._own_hparams():
            return own
        inner = self.__dict__.get("datamodule")
        return own or bool(getattr(inner, "_log_hyperparams", False))

    @_log_hyperparams.setter
    def _log_hyperparams(self, value: bool) -> None:
        self.__dict__["_effi_log_hyperparams"] = value

    def prepare_data(self) -> None:
        self.datamodule.prepare_data()

    def setup(self, stage: str) -> None:
        """Delegated (the wrapped DataModule gets this one's ``trainer``); for ``fit``, the user's training loader is
        read afresh at the next :meth:`template` (a batch size changed between fits applies)."""
        self.datamodule.trainer = self.trainer
        self.datamodule.setup(stage)
        if stage == "fit":
            self._template = None
            self._setup_open = True
            # Lightning runs the DataModule's setup before the callbacks': the user's own setting
            trainer = self.trainer
            self._user_reload_every = int(getattr(trainer, "reload_dataloaders_every_n_epochs", 0) or 0)
            # the epoch of this read (0 in a resumed fit too: before the checkpoint is restored)
            self._reload_checked, self._reload_base = -1, int(getattr(trainer, "current_epoch", 0) or 0)
        self._quiet_hook_warnings()

    @property
    def batch_size(self) -> Any:
        """The user's DataModule's ``batch_size`` (the innermost of the ``.datamodule`` chain), so that Lightning's
        tuner (``lightning_hasattr(model, "batch_size")``, which looks at ``trainer.datamodule``) and the user read
        the value the training loader is built with. Setting it sets the user's DataModule's and makes every wrapper
        of the chain read the user's loader afresh.

        Raises:
            AttributeError: the user's DataModule has no ``batch_size`` attribute.
        """
        chain = wrapper_chain(self)
        if not hasattr(chain[-1], "batch_size"):
            raise AttributeError(f"{type(chain[-1]).__name__} (wrapped by {type(self).__name__}) has no batch_size")
        return chain[-1].batch_size

    @batch_size.setter
    def batch_size(self, value: Any) -> None:
        chain = wrapper_chain(self)
        if not hasattr(chain[-1], "batch_size"):
            raise AttributeError(f"{type(chain[-1]).__name__} (wrapped by {type(self).__name__}) has no batch_size")
        chain[-1].batch_size = value
        for wrapper in chain[:-1]:
            if not wrapper._setup_open:  # during a fit's setup the loader served first is compared (_serve)
                wrapper._template = None

    # ------------------------------------------------------------------------------------------- batch hooks
    def _user_hook(self, name: str) -> Any:
        """The hook ``name`` Lightning would call without the wrappers: the user's DataModule's if it overrides it,
        else the LightningModule's if it does, else None (Lightning's default)."""
        inner = wrapper_chain(self)[-1]
        if is_overridden(name, inner, pl.LightningDataModule):
            return getattr(inner, name)
        module = self.trainer.lightning_module if self.trainer is not None else None
        if module is not None and is_overridden(name, module, pl.LightningModule):
            return getattr(module, name)
        return None

    def _quiet_hook_warnings(self) -> None:
        """Lightning warns "overridden in both LightningModule and LightningDataModule ... will use the
        LightningDataModule's" for every batch hook the user's LightningModule overrides, since this wrapper overrides
        them all; the warning would be false (the wrapper calls the module's hook), so it is marked as already
        shown, for those hooks only (the user's DataModule does not override them)."""
        module = self.trainer.lightning_module if self.trainer is not None else None
        if module is None:
            return
        try:
            from lightning.pytorch.trainer.connectors import data_connector
        except ImportError:  # pragma: no cover - Lightning moved it: the (harmless) warning shows
            return
        inner = wrapper_chain(self)[-1]
        for name in BATCH_HOOKS:
            by_module = is_overridden(name, module, pl.LightningModule)
            if by_module and not is_overridden(name, inner, pl.LightningDataModule):
                data_connector.warning_cache.add(
                    f"You have overridden `{name}` in both `LightningModule` and `LightningDataModule`."
                    " It will use the implementation from `LightningDataModule` instance."
                )

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Take a technique's :class:`~lightning_effi.core.batch.EffiBatch` apart (its ``meta`` goes to
        :attr:`effi_batch_meta`), then call the user's hook (class docstring) with the user's batch."""
        batch, meta = unwrap(batch)
        if meta is not None:
            self.effi_batch_meta = meta
        elif self.trainer is not None and self.trainer.training:
            self.effi_batch_meta = None
        hook = self._user_hook("on_before_batch_transfer")
        return hook(batch, dataloader_idx) if hook is not None else batch

    def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
        hook = self._user_hook("transfer_batch_to_device")
        if hook is not None:
            return hook(batch, device, dataloader_idx)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        hook = self._user_hook("on_after_batch_transfer")
        return hook(batch, dataloader_idx) if hook is not None else batch

    def teardown(self, stage: str) -> None:
        self.effi_batch_meta = None
        self.datamodule.teardown(stage)

    def on_exception(self, exception: BaseException) -> None:
        """A run raised (Lightning calls this hook of the outermost DataModule only, after the callbacks'
        ``on_exception``): forget the batch in flight and pass the exception on to the wrapped DataModule."""
        self.effi_batch_meta = None
        self.datamodule.on_exception(exception)

    val_dataloader = EvaluationLoader()
    test_dataloader = EvaluationLoader()
    predict_dataloader = EvaluationLoader()

    def state_dict(self) -> dict[str, Any]:
        return self.datamodule.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.datamodule.load_state_dict(state_dict)

    def model_hints(self) -> dict[str, Any]:
        hints = getattr(self.datamodule, "model_hints", None)
        return hints() if callable(hints) else {}

    def template(self) -> dict[str, Any]:
        """The user's training loader's dataset and settings, read once (first call) and validated: the loader of the
        innermost DataModule of the ``.datamodule`` chain (nested technique wrappers are skipped; each wrapper of the
        chain gets this one's ``trainer``). Read again when the fit's first training loader is served
        (:meth:`_serve`).

        Raises:
            DataConfigError: see :func:`loader_template` and :meth:`_serve`.
        """
        if self._template is None:
            self._template = self._read_user_loader()
        else:
            self._check_reload()
        assert self._template is not None
        return self._template

    def _read_user_loader(self) -> dict[str, Any]:
        chain = wrapper_chain(self)
        for inner in chain[1:]:
            inner.trainer = self.trainer
        trainer = self.trainer
        world = None if trainer is None else (int(trainer.world_size), int(trainer.global_rank))
        template = loader_template(chain[-1].train_dataloader(), self.technique, world)
        self._user_state = _settings_of(chain[-1])  # after the call: its own changes (a call counter) included
        return template

    def _serve(self) -> None:
        """Called by a subclass's ``train_dataloader``. At the fit's first training loader, read the user's loader
        again when its DataModule's attributes or hyperparameters changed since it was read (by identity; else it is
        not called again, as Lightning calls it once). The technique's callback read it in its ``setup``, which
        Lightning runs before the LightningModule's, where a module hands its DataModule a setting
        (``self.trainer.datamodule.scale = 2``, or through its ``hparams``); the fit trained on the loader read before
        the setting (qa81-break 03). Its settings (collate function, workers, ...) and dataset are taken, as without
        the technique the loader read after the setting is the one trained on; a dataset built anew at each call is
        taken when it holds as many samples (qa87-break 01).

        Raises:
            DataConfigError: the loader now holds another number of samples, or another ``batch_size`` or
                ``drop_last``: the technique's callback sized its per-sample state and checked the run on the first
                loader; naming what changed and where to set it.
        """
        old = self._template if self._setup_open else None
        self._setup_open = False
        if old is None or _settings_of(wrapper_chain(self)[-1]) == self.__dict__.get("_user_state"):
            return  # nothing set on the user's DataModule since its loader was read: not called again
        fresh = self._read_user_loader()
        changed = [f"{fresh['length']} samples (was {old['length']})"] if fresh["length"] != old["length"] else []
        changed += [
            f"{key}={fresh[key]!r} (was {old[key]!r})" for key in ("batch_size", "drop_last") if fresh[key] != old[key]
        ]
        if changed:
            user = type(wrapper_chain(self)[-1]).__name__
            raise DataConfigError(
                f"{self.technique}: your {user}'s train_dataloader() returned a loader with {', '.join(changed)} "
                f"after {self.technique} read it in its callback's setup: a setting made in the LightningModule's "
                "setup, which Lightning runs after the callbacks'? "
                f"{self.technique} sized its per-sample state and checked the run on the first loader; set it before "
                "the fit: when you build the DataModule, in the DataModule's own setup() (which runs first), or in "
                f"the setup() of a callback listed before {self.technique}'s"
            )
        self._template = fresh

    def _check_reload(self) -> None:
        """At an epoch where the user's Trainer reloads the training loader (``reload_dataloaders_every_n_epochs =
        n > 0`` when the fit started), call the user's ``train_dataloader()`` as Lightning would without the
        technique, and refuse a loader over another dataset object: the technique builds every epoch's loader from
        the dataset the run started on (InfoBatch's per-sample scores, the curriculum's per-sample difficulties and
        stream), so a new subset or grown data served at a reload would be ignored. A loader over the same dataset is
        checked as the first one was (:func:`loader_template`: a custom sampler is refused) and its settings (collate
        function, workers) are taken for the epochs from this one on.

        Raises:
            DataConfigError: naming the technique, the epoch, ``reload_dataloaders_every_n_epochs`` and the fixes.
        """
        trainer, n = self.trainer, self._user_reload_every
        if not n or trainer is None or trainer.sanity_checking or not trainer.training:
            return
        epoch = trainer.current_epoch
        if epoch == self._reload_checked or self._template is None:
            return
        # the epochs Lightning reads the loader at without the technique: the fit's first training epoch when it is
        # not the one read in setup (a resumed fit: its epoch, after the restore, qa100-regress 02), then n epochs
        # after the last read (a fit resumed at an odd epoch reloads at odd ones: `epoch % n` read none after the
        # resume, qa99-regress 01), and an epoch before it (a fit set back to its start by an LR finder's search,
        # which read up to its last epoch: no read after it, qa100-regress 01)
        base, first = self._reload_base, self._reload_checked == -1
        due = epoch != base if first else (epoch < base or epoch - base >= n)
        self._reload_checked = epoch
        if not due:
            return
        self._reload_base = epoch
        fresh = wrapper_chain(self)[-1].train_dataloader()
        t = self._template
        # the loader Lightning would train on without the technique: refused as at the fit's start (a custom sampler
        # returned at a reload was dropped in silence, qa98-break 02; a list of loaders was told to be another dataset,
        # qa100-regress 03), its settings taken below
        world = (int(trainer.world_size), int(trainer.global_rank))
        try:
            new = loader_template(fresh, self.technique, world)
        except DataConfigError as err:  # said as the refusal of a reload (qa99-regress 02)
            why = str(err).removeprefix(f"{self.technique}: ")
            raise DataConfigError(
                f"{self.technique}: the Trainer reloads the training loader (reload_dataloaders_every_n_epochs={n}), "
                f"and the loader your train_dataloader() returned at epoch {epoch} cannot be taken: {why}. Return a "
                "loader it can take at every reload, or set reload_dataloaders_every_n_epochs=0"
            ) from None
        same = _same_dataset(fresh.dataset, t["dataset"])
        changed = [
            f"{key}={getattr(fresh, key, None)!r} (was {t[key]!r})"
            for key in ("batch_size", "drop_last")
            if getattr(fresh, key, None) != t[key]
        ]
        if same and changed:
            raise DataConfigError(
                f"{self.technique}: the Trainer reloads the training loader (reload_dataloaders_every_n_epochs={n}), "
                f"and at epoch {epoch} your train_dataloader() returned a loader with {', '.join(changed)}; "
                f"{self.technique} builds every epoch's loader with the settings the fit started with, so the change "
                "would be ignored. Keep the loader's batch_size and drop_last for the whole fit (a batch-size ramp is "
                "not supported with it), or set reload_dataloaders_every_n_epochs=0"
            )
        if not same:
            raise DataConfigError(
                f"{self.technique}: the Trainer reloads the training loader (reload_dataloaders_every_n_epochs={n}), "
                f"and at epoch {epoch} your train_dataloader() returned a loader over another dataset object than "
                f"the one the fit started on; {self.technique} builds every epoch's loader from the dataset the fit "
                "started on (its per-sample state is indexed by that dataset's samples), so the new data would be "
                "ignored. Return the same dataset object from train_dataloader() (create it once, in setup()), or "
                "set reload_dataloaders_every_n_epochs=0; a training set that changes during the fit is not supported"
            )
        # its collate function and worker settings, as Lightning would train with them (the first loader's collate
        # went on in silence, qa98-break 03); the dataset object the per-sample state is indexed by is kept
        self._template = {**new, "dataset": t["dataset"], "length": t["length"]}

    def check_attached(self) -> None:
        """Raise if this wrapper's technique callback is missing; called by an outer wrapper that builds the training
        loader for the chain (a no-op here).

        Raises:
            DataConfigError: (in subclasses) the wrapper is used without its callback.
        """

    @property
    def train_dataset(self) -> Any:
        """The user's training loader's dataset (:meth:`template`); set, the user's DataModule's attribute (read by
        its ``train_dataloader()``, as without the wrapper: an AttributeError before, qa87-break 04)."""
        return self.template()["dataset"]

    @train_dataset.setter
    def train_dataset(self, value: Any) -> None:
        wrapper_chain(self)[-1].train_dataset = value

    @property
    def collate_fn(self) -> Any:
        """The user's training loader's collate function (:meth:`template`); set, the user's DataModule's attribute,
        as ``train_dataset``."""
        return self.template()["collate_fn"]

    @collate_fn.setter
    def collate_fn(self, value: Any) -> None:
        wrapper_chain(self)[-1].collate_fn = value
