"""Offline data analyzer of DeepSpeed Data Efficiency curriculum learning (map / reduce): :class:`DataAnalyzer` and
the partitioning helpers :func:`split_index` / :func:`split_dataset`. It writes DeepSpeed's file names and
byte-identical ``MMapIndexedDataset`` files, with one intended difference: with ``sample_indices`` (ids that are not
the positions) ``{m}_sample_to_metric`` holds item ``i`` = the metric of sample id ``i`` and each
``{m}_index_to_sample`` row lists its ids ascending, where DeepSpeed 0.19.8 writes both in position order (item ``k``
= the sample at position ``k``); the curriculum reads the files by sample id
(``tests/data_analysis/test_deepspeed_files.py`` pins the relation against files DeepSpeed wrote). The method card is
``lightning_effi/curriculum/README.md``.

Reference DeepSpeed 0.19.8 ``deepspeed/runtime/data_pipeline/data_sampling/{data_analyzer,utils}.py``; the DeepSpeed
defects it avoids are named by their pull request where the code handles them.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import hashlib
import json
import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_effi.core.checks import check_bool, check_int, check_list, check_str, is_int

from .index import INPROGRESS_NAME, METADATA_NAME, MetricIndex, _load_validated, dataset_fingerprint, file_digest
from .indexed_dataset import (
    MMapIndexedDataset,
    data_file_path,
    find_fit_int_dtype,
    index_file_path,
    normalize_int_dtype,
    write_index_file,
)
from .metrics import METRIC_TYPES, get_metric

__all__ = ["AnalyzerError", "DataAnalyzer", "split_dataset", "split_index"]

_DONE = "map_done.json"
_FAILED = "map_failed.json"
_FORMAT = "lightning_effi.curriculum.analysis/1"
_CHUNK = 1 << 22


def _metric_function(name: str, fn: Any) -> Any:
    """The function of metric ``name``: ``fn`` itself, or the registered metric ``fn`` names (a str)."""
    if not isinstance(fn, str):
        return fn
    try:
        return get_metric(fn)
    except KeyError as err:
        raise ValueError(f"DataAnalyzer.metric_functions (metric {name!r}): {err.args[0]}") from None


class AnalyzerError(RuntimeError):
    """The analysis cannot proceed: missing/stale/failed map partitions, invalid ids, a failed worker process."""


def split_index(start_idx: int, end_idx: int, num_partitions: int) -> list[tuple[int, int]]:
    """Contiguous partitions of ``[start_idx, end_idx)``: boundaries ``np.linspace(a, b, n+1, dtype=int)``
    (DeepSpeed ``utils.split_index``, PR #5292, which replaced a split that produced invalid ranges). Sizes differ by
    at most one; empty allowed.

    >>> split_index(0, 20, 4)
    [(0, 5), (5, 10), (10, 15), (15, 20)]
    """
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1; got {num_partitions}")
    b = np.linspace(start_idx, end_idx, num=num_partitions + 1, dtype=int)
    return [(int(b[i]), int(b[i + 1])) for i in range(num_partitions)]


def split_dataset(
    num_samples: int, num_workers: int, worker_id: int, num_threads: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(worker_splits, thread_splits of worker_id)`` (DeepSpeed ``utils.split_dataset``)."""
    worker_splits = split_index(0, num_samples, num_workers)
    thread_splits = split_index(worker_splits[worker_id][0], worker_splits[worker_id][1], num_threads)
    return worker_splits, thread_splits


def _metric_signature(fn: Callable) -> str:
    """A process-independent description of a metric (no memory addresses), part of the run fingerprint."""
    import functools

    if isinstance(fn, functools.partial):
        return f"partial({_metric_signature(fn.func)}, {sorted((k, repr(v)) for k, v in fn.keywords.items())})"
    if hasattr(fn, "__qualname__") and hasattr(fn, "__module__"):
        return f"{fn.__module__}.{fn.__qualname__}"
    t = type(fn)
    own_repr = t.__repr__ is not object.__repr__
    return f"{t.__module__}.{t.__qualname__}" + (f":{fn!r}" if own_repr else "")


def _to_numpy_result(x: Any, name: str) -> np.ndarray:
    """A metric's values as a NumPy integer array.

    Raises:
        TypeError: a float, bool or complex result (naming the metric), or one that is neither a tensor nor an array.
        ValueError: an int64 value of ``-2**63`` (int32: ``-2**31``), what a NaN or infinite float reads as after a
            cast to an integer (a NaN score would become the easiest sample, silently).
    """
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        import torch

        if x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
            raise TypeError(
                f"metric {name!r} returned a {x.dtype} tensor; metric values must be integers (scale "
                "float values explicitly, after replacing NaN and infinite ones, e.g. (x * 1000).long())"
            )
        out = x.detach().cpu().numpy()
    elif isinstance(x, np.ndarray):
        if x.dtype.kind not in "iu":
            raise TypeError(
                f"metric {name!r} returned {x.dtype} values; metric values must be integers (scale "
                "float values explicitly, after replacing NaN and infinite ones, e.g. (x * 1000).astype(np.int64))"
            )
        out = x
    else:
        raise TypeError(f"metric {name!r} returned a {type(x).__name__}; expected a torch tensor or numpy array")
    lowest = int(np.iinfo(out.dtype).min) if out.dtype in (np.int64, np.int32) else None
    if lowest is not None and (bad := np.flatnonzero(out.reshape(-1) == lowest)).size:
        raise ValueError(
            f"metric {name!r} returned {lowest} (the {out.dtype} minimum) for {bad.size} of a batch's {out.size} "
            f"samples (the first at position {int(bad[0])}): a NaN or infinite float cast to an integer reads so, and "
            "would rank as the easiest sample; replace or drop non-finite scores before the cast (e.g. "
            "torch.nan_to_num with the difficulty they should have)"
        )
    return out


def _atomic_json(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _write_bin(path: str, flat: np.ndarray, dtype: Any) -> None:
    dt = np.dtype(dtype).newbyteorder("<")
    with open(path, "wb") as f:
        for start in range(0, len(flat), _CHUNK):
            f.write(np.asarray(flat[start : start + _CHUNK]).astype(dt, copy=False).tobytes(order="C"))
        f.flush()
        os.fsync(f.fileno())


def _write_dataset(prefix: str, flat: np.ndarray, sizes: np.ndarray, doc_idx: Sequence[int], dtype: Any) -> None:
    _write_bin(data_file_path(prefix), flat, dtype)
    write_index_file(index_file_path(prefix), dtype, sizes, doc_idx)
    fd = os.open(index_file_path(prefix), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fetch(dataset: Any, indices: list[int]) -> Any:
    getitems = getattr(dataset, "__getitems__", None)
    if getitems is not None:
        return getitems(indices)
    return [dataset[i] for i in indices]


@dataclass
class _Plan:
    """Everything a map partition needs (pickled once per worker process under ``spawn``)."""

    dataset: Any
    collate_fn: Callable | None
    batch_size: int
    names: list[str]
    functions: list[Callable]
    types: list[str]
    dtypes: list[np.dtype]
    save_path: str
    worker_id: int
    num_samples: int
    fingerprints: dict[str, str]
    sample_indices: np.ndarray | None
    index_key: str | None
    splits: list[tuple[int, int]] = field(default_factory=list)


def _partition_dir(save_path: str, m: str, w: int, t: int) -> str:
    return os.path.join(save_path, m, f"worker{w}_thread{t}")


def _ids_of_batch(plan: _Plan, batch: Any, positions: np.ndarray) -> np.ndarray:
    if plan.index_key is not None and isinstance(batch, dict) and plan.index_key in batch:
        raw = batch[plan.index_key]
        raw = raw.detach().cpu().numpy() if hasattr(raw, "detach") else np.asarray(raw)
        if raw.dtype.kind not in "iu":
            raise TypeError(f"batch[{plan.index_key!r}] must hold integer sample ids; got {raw.dtype}")
        if raw.ndim not in (1, 2):
            raise ValueError(f"batch[{plan.index_key!r}] must have shape [B] or [B, 1]; got {raw.shape}")
        ids = np.asarray(raw if raw.ndim == 1 else raw[:, 0], dtype=np.int64)
        if len(ids) != len(positions):
            raise ValueError(f"batch[{plan.index_key!r}] has {len(ids)} ids for a batch of {len(positions)} samples")
        return ids
    if plan.sample_indices is not None:
        return plan.sample_indices[positions]
    return positions


def _run_partition(plan: _Plan, thread_id: int, progress: Callable[[int], None] | None = None) -> dict:
    """Map one partition; writes its arrays and ``map_done.json``; on error writes ``map_failed.json`` and raises."""
    start, end = plan.splits[thread_id]
    w = plan.worker_id
    dirs = {m: _partition_dir(plan.save_path, m, w, thread_id) for m in plan.names}
    for d in dirs.values():
        os.makedirs(d, exist_ok=True)
        for name in (_DONE, _FAILED):
            if os.path.exists(os.path.join(d, name)):
                os.remove(os.path.join(d, name))
    t0 = time.perf_counter()
    n = end - start
    try:
        from numpy.lib.format import open_memmap

        singles, accs, shapes = {}, {}, {}
        for m, mtype, dt in zip(plan.names, plan.types, plan.dtypes):
            if mtype == "single_value_per_sample":
                d = dirs[m]
                singles[m] = (
                    open_memmap(os.path.join(d, f"{m}_ids.tmp.npy"), mode="w+", dtype=np.int64, shape=(n,))
                    if n
                    else np.zeros(0, np.int64),
                    open_memmap(os.path.join(d, f"{m}_values.tmp.npy"), mode="w+", dtype=dt, shape=(n,))
                    if n
                    else np.zeros(0, dt),
                )
            else:
                accs[m] = None
        pos = 0
        collate = plan.collate_fn
        if collate is None:
            from torch.utils.data import default_collate as collate
        for b0 in range(start, end, plan.batch_size):
            b1 = min(b0 + plan.batch_size, end)
            positions = np.arange(b0, b1, dtype=np.int64)
            batch = collate(_fetch(plan.dataset, positions.tolist()))
            bsz = b1 - b0
            ids = _ids_of_batch(plan, batch, positions)
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= plan.num_samples):
                bad = ids[(ids < 0) | (ids >= plan.num_samples)][:5].tolist()
                raise ValueError(
                    f"sample ids out of range [0, {plan.num_samples}) in the batch of positions "
                    f"[{b0}, {b1}): {bad} (from batch[{plan.index_key!r}] or sample_indices)"
                )
            for m, fn, mtype, dt in zip(plan.names, plan.functions, plan.types, plan.dtypes):
                out = _to_numpy_result(fn(batch), m)
                if mtype == "single_value_per_sample":
                    if out.shape != (bsz,):
                        raise ValueError(
                            f"metric {m!r} (single_value_per_sample) returned shape {tuple(out.shape)} "
                            f"for a batch of {bsz} samples; expected ({bsz},): one integer per sample"
                        )
                    if out.size:
                        info = np.iinfo(dt)
                        lo, hi = int(out.min()), int(out.max())
                        if lo < info.min or hi > info.max:
                            raise ValueError(
                                f"metric {m!r} returned values in [{lo}, {hi}], outside its declared "
                                f"metric_dtype {dt}; declare a wider dtype (e.g. int64)"
                            )
                    ids_mm, vals_mm = singles[m]
                    ids_mm[pos : pos + bsz] = ids
                    vals_mm[pos : pos + bsz] = out
                else:
                    shape = tuple(out.shape)
                    if m not in shapes:
                        shapes[m] = (shape, bsz)
                        accs[m] = out.astype(np.uint64 if dt == np.uint64 else np.int64, copy=True)
                    elif shape != shapes[m][0]:
                        first_shape, first_b = shapes[m]
                        hint = (
                            " It looks per-sample shaped (its first dimension follows the batch size): an "
                            "accumulate metric must return one fixed-shape array per batch (e.g. a histogram); "
                            "use metric_type 'single_value_per_sample' for per-sample values."
                            if shape[:1] == (bsz,) and first_shape[:1] == (first_b,)
                            else ""
                        )
                        raise ValueError(
                            f"metric {m!r} (accumulate_value_over_samples) returned shape {shape} for a "
                            f"batch of {bsz} samples after {first_shape} for a batch of {first_b}; the "
                            f"shape must be the same for every batch (DeepSpeed PR #5147).{hint}"
                        )
                    else:
                        np.add(accs[m], out, out=accs[m], casting="unsafe")
            pos += bsz
            if progress is not None:
                progress(bsz)
        for m, (ids_mm, vals_mm) in singles.items():
            d = dirs[m]
            for arr in (ids_mm, vals_mm):
                if isinstance(arr, np.memmap):
                    arr.flush()
            del ids_mm, vals_mm
            if n:
                os.replace(os.path.join(d, f"{m}_ids.tmp.npy"), os.path.join(d, f"{m}_ids.npy"))
                os.replace(os.path.join(d, f"{m}_values.tmp.npy"), os.path.join(d, f"{m}_values.npy"))
            else:
                np.save(os.path.join(d, f"{m}_ids.npy"), np.zeros(0, np.int64))
                np.save(os.path.join(d, f"{m}_values.npy"), np.zeros(0, plan.dtypes[plan.names.index(m)]))
        singles.clear()
        for m, acc in accs.items():
            path = os.path.join(dirs[m], f"{m}_metric_value.npy")
            if acc is not None:
                np.save(path, acc)
            elif os.path.exists(path):
                os.remove(path)
        seconds = time.perf_counter() - t0
        for m in plan.names:
            _atomic_json(
                os.path.join(dirs[m], _DONE),
                {
                    "fingerprint": plan.fingerprints[m],
                    "worker_id": w,
                    "thread_id": thread_id,
                    "start": start,
                    "end": end,
                    "count": n,
                    "seconds": seconds,
                    "empty_accumulate": accs.get(m, 0) is None,
                },
            )
        return {"worker_id": w, "thread_id": thread_id, "start": start, "end": end, "count": n, "seconds": seconds}
    except BaseException as err:
        msg = "".join(traceback.format_exception_only(type(err), err)).strip()
        for m in plan.names:
            try:
                _atomic_json(
                    os.path.join(dirs[m], _FAILED),
                    {
                        "fingerprint": plan.fingerprints[m],
                        "worker_id": w,
                        "thread_id": thread_id,
                        "error": msg,
                        "traceback": traceback.format_exc(),
                    },
                )
            except OSError:  # pragma: no cover - best effort
                pass
        raise


# ---- worker-process side (ProcessPoolExecutor initializer + task) ----
_CHILD: dict[str, Any] = {}


def _child_init(plan: _Plan, progress_queue: Any) -> None:
    try:
        import torch

        torch.set_num_threads(1)  # one process per partition; avoid oversubscription / OpenMP-after-fork stalls
    except Exception:  # pragma: no cover
        pass
    _CHILD["plan"] = plan
    _CHILD["queue"] = progress_queue


def _child_run(thread_id: int) -> dict:
    plan, q = _CHILD["plan"], _CHILD["queue"]
    pending = [0, time.monotonic()]

    def progress(k: int) -> None:
        pending[0] += k
        now = time.monotonic()
        if now - pending[1] > 0.2:
            q.put(pending[0])
            pending[0], pending[1] = 0, now

    try:
        return _run_partition(plan, thread_id, progress)
    finally:
        if pending[0]:
            q.put(pending[0])


class _InIdOrder:
    """A map-style data set read in sample-id order: item ``i`` is ``dataset[position[i]]``."""

    def __init__(self, dataset: Any, position: np.ndarray) -> None:
        self.dataset, self.position = dataset, position

    def __len__(self) -> int:
        return len(self.position)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[int(self.position[i])]


class DataAnalyzer:
    """Map/reduce analysis of a map-style data set (DeepSpeed ``DataAnalyzer`` argument names).

    **Partitioning** (:func:`split_index`): ``[0, N)`` is split into ``num_workers`` contiguous worker ranges (machines;
    any launcher sets ``worker_id``), each split into ``num_threads`` thread ranges (local worker processes); boundaries
    ``np.linspace(a, b, n + 1, dtype=int)``; empty ranges are legal (N smaller than the partitions works).

    **Map** (:meth:`DataAnalyzer.run_map`): each partition fetches its samples in order (``dataset.__getitems__`` when
    defined, else ``dataset[i]``), collates them (``collate_fn``, default ``torch.utils.data.default_collate``), calls
    every metric and writes, per metric, to ``save_path/{m}/worker{w}_thread{t}/``: ``{m}_ids.npy`` (int64 sample ids)
    and ``{m}_values.npy`` (declared dtype) for a ``single_value_per_sample`` metric, ``{m}_metric_value.npy`` for an
    ``accumulate_value_over_samples`` metric, then the completion marker ``map_done.json`` (run fingerprint, range,
    count). A failing partition writes ``map_failed.json`` instead. Sample ids are the fetched positions (independent of
    the batch structure: tensor, tuple, list, dict, custom collate; DeepSpeed counted the fields of a tuple batch and
    required an ``index`` field before PRs #5112 and #5142), replaced by a dict batch's ``index_key`` field (Megatron
    ``--return-data-index``) or remapped by ``sample_indices``.

    **Reduce** (:meth:`DataAnalyzer.run_reduce`, once, after every partition finished; DeepSpeed PR #5131): the markers
    of all ``num_workers × num_threads`` partitions must exist and carry this run's fingerprint (stale, partial, missing
    or failed partitions raise :class:`AnalyzerError` naming them). Values are scattered by id (every id in ``[0, N)``
    exactly once), sorted stably by ``(value, id)`` in memory, and written with DeepSpeed's names, fitted dtypes
    (:func:`find_fit_int_dtype`), the current dtype table and DeepSpeed's ``doc_idx`` (``num_threads_reduce`` only sets
    the ``doc_idx`` chunk boundaries DeepSpeed's reduce threads would produce; the reduce itself is one vectorised
    pass):

    - ``{m}_sample_to_metric``: N items ``[value of sample i]``;
    - ``{m}_index_to_sample``: one row of ids per distinct value (ascending), ids ascending within a row;
    - ``{m}_index_to_metric``: one ``[value]`` per row, strictly increasing;
    - ``{m}_index_to_sample_percentile_merged``: rows merged by ``merge_step = max(1, rows // 100)`` (DeepSpeed PR
      #3609: fewer than 100 distinct values crashed the merge);
    - ``{m}_metric_value`` (accumulate metrics): the summed vector.

    Files are written under temporary names, verified (:meth:`MetricIndex.load`), fsync'ed and renamed; a
    ``reduce.inprogress`` marker guards the renames and ``analysis_metadata.json`` (data-set length, fingerprint, file
    digests) is written last, so a killed run never leaves files that load as valid. Temp files are deleted after a
    verified reduce unless ``keep_temp``.

    Args:
        dataset: map-style data set (``__len__``, ``__getitem__``; ``__getitems__`` used when defined). Must be
            picklable when ``num_threads > 1`` with the ``spawn``/``forkserver`` start method.
        num_workers, worker_id: machine-level split; ``worker_id`` in ``[0, num_workers)``. Each machine maps its
            range; one reduce (``worker_id == 0`` in :meth:`run_map_reduce`) merges all (shared ``save_path``).
        num_threads: local worker processes of this machine (one partition each; 1 = run in this process).
        num_threads_reduce: only sets the ``doc_idx`` chunk boundaries of the merged files as DeepSpeed's reduce
            threads would, for byte-identical output.
        specific_threads: a list of the thread ids of this worker to run (re-run failed partitions); ``None``/``[]``:
            all.
        batch_size: samples per collated batch (does not change the results).
        metric_names: output directory / file names (unique, no path separators).
        metric_functions: callables ``fn(batch) -> values`` or registry names (:func:`.metrics.get_metric`).
        metric_types: ``"single_value_per_sample"`` (shape ``(B,)``) or ``"accumulate_value_over_samples"`` (one
            fixed shape, summed).
        metric_dtypes: declared integer dtypes (NumPy, torch or string; equivalent); floats raise ``TypeError``.
            Values outside the declared dtype raise; the final files use fitted dtypes.
        save_path: output root; metric ``m`` goes to ``save_path/{m}/``.
        collate_fn: batch collation (default ``torch.utils.data.default_collate``).
        sample_indices: ``int[N]``: the id of the sample at position ``k`` is ``sample_indices[k]`` (a permutation of
            ``[0, N)``); a dict batch's ``index_key`` field takes precedence (DeepSpeed semantics).
        keep_temp: (bool) keep the per-partition map files after a verified reduce.
        progress: (bool) show a tqdm progress bar during the map.
        index_key: (str) dict-batch field holding sample ids (``None`` disables).
        start_method: multiprocessing start method for ``num_threads > 1`` (``None``: ``"fork"`` where available,
            else ``"spawn"``). Workers run ``torch.set_num_threads(1)``.
        run_tag: optional str folded into the run fingerprint (e.g. a hash of the data config), so partitions of a
            run over other data of the same length are rejected as stale.

    Raises:
        ValueError / TypeError: invalid arguments (the message names the parameter and what is allowed): e.g. a
            string where a list (``metric_names``, ``specific_threads``, ...) or a bool (``keep_temp``,
            ``progress``) is expected, an unknown registered metric name, a ``save_path`` that is not a path.
    """

    def __init__(
        self,
        dataset: Any,
        num_workers: int = 1,
        worker_id: int = 0,
        num_threads: int = 1,
        num_threads_reduce: int = 1,
        specific_threads: Sequence[int] | None = None,
        batch_size: int = 1,
        metric_names: Sequence[str] = (),
        metric_functions: Sequence[Callable | str] = (),
        metric_types: Sequence[str] = (),
        metric_dtypes: Sequence[Any] = (),
        save_path: str = "./",
        collate_fn: Callable | None = None,
        sample_indices: Sequence[int] | np.ndarray | None = None,
        keep_temp: bool = False,
        progress: bool = True,
        index_key: str | None = "index",
        start_method: str | None = None,
        run_tag: str | None = None,
    ):
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise TypeError(
                f"dataset must be a map-style data set with __len__ and __getitem__; got {type(dataset).__name__}"
            )
        self.dataset = dataset
        self.num_samples = len(dataset)
        if self.num_samples < 1:
            raise ValueError("dataset is empty; nothing to analyze")
        self.num_workers = check_int("DataAnalyzer", "num_workers", num_workers, 1)
        self.worker_id = check_int("DataAnalyzer", "worker_id", worker_id, 0)
        if self.worker_id >= self.num_workers:
            raise ValueError(f"worker_id must be in [0, num_workers={self.num_workers}); got {worker_id}")
        self.num_threads = check_int("DataAnalyzer", "num_threads", num_threads, 1)
        self.num_threads_reduce = check_int("DataAnalyzer", "num_threads_reduce", num_threads_reduce, 1)
        self.batch_size = check_int("DataAnalyzer", "batch_size", batch_size, 1)
        owner = "DataAnalyzer"
        chosen = (
            [] if specific_threads is None else check_list(owner, "specific_threads", specific_threads, what="ints")
        )
        bad = [t for t in chosen if not is_int(t) or not 0 <= t < self.num_threads]
        if bad or len(set(chosen)) != len(chosen):
            raise ValueError(
                f"DataAnalyzer.specific_threads must be distinct int thread ids in [0, num_threads={self.num_threads}) "
                f"or None (every thread); got {chosen!r}"
            )
        self.specific_threads = [int(t) for t in chosen] if chosen else list(range(self.num_threads))
        names, fns, types, dts = (
            check_list(owner, "metric_names", metric_names, what="metric names (str)"),
            check_list(owner, "metric_functions", metric_functions, what="functions fn(batch) or registered names"),
            check_list(owner, "metric_types", metric_types, what=f"metric types {METRIC_TYPES}"),
            check_list(owner, "metric_dtypes", metric_dtypes, what="integer dtypes"),
        )
        if not names:
            raise ValueError("metric_names is empty; give at least one metric")
        if not len(names) == len(fns) == len(types) == len(dts):
            raise ValueError(
                f"metric_names, metric_functions, metric_types and metric_dtypes must have the same "
                f"length; got {len(names)}, {len(fns)}, {len(types)}, {len(dts)}"
            )
        for m in names:
            if not isinstance(m, str) or not m or os.sep in m or m in (".", "..") or (os.altsep and os.altsep in m):
                raise ValueError(f"metric_names: {m!r} is not a valid name (non-empty, no path separator)")
        if len(set(names)) != len(names):
            raise ValueError(f"metric_names must be unique; got {names}")
        for m, t in zip(names, types):
            if t not in METRIC_TYPES:
                raise ValueError(f"metric_types: {t!r} for metric {m!r} is not one of {METRIC_TYPES}")
        self.metric_names = names
        self.metric_functions = [_metric_function(m, f) for m, f in zip(names, fns)]
        for m, f in zip(names, self.metric_functions):
            if not callable(f):
                raise TypeError(f"metric_functions: the function of metric {m!r} is not callable ({f!r})")
        self.metric_types = types
        self.metric_dtypes = [normalize_int_dtype(d, f"metric_dtypes[{m!r}]") for m, d in zip(names, dts)]
        if not isinstance(save_path, (str, os.PathLike)):
            raise TypeError(f"DataAnalyzer.save_path must be a folder path (str or os.PathLike), got {save_path!r}")
        self.save_path = os.fspath(save_path)
        self.collate_fn = collate_fn
        if sample_indices is not None:
            si = np.asarray(sample_indices)
            if si.shape != (self.num_samples,) or (si.size and si.dtype.kind not in "iu"):
                raise ValueError(
                    f"sample_indices must be integers of shape ({self.num_samples},) (one id per "
                    f"position); got {si.dtype} {si.shape}"
                )
            si = si.astype(np.int64)
            if np.any(si < 0) or np.any(si >= self.num_samples) or len(np.unique(si)) != len(si):
                raise ValueError(f"sample_indices must be a permutation of [0, {self.num_samples})")
            self.sample_indices = si
        else:
            self.sample_indices = None
        self.keep_temp = check_bool(owner, "keep_temp", keep_temp)
        self.progress = check_bool(owner, "progress", progress)
        self.index_key = check_str(owner, "index_key", index_key, none_ok=True)
        if start_method is not None and start_method not in mp.get_all_start_methods():
            raise ValueError(f"start_method must be one of {mp.get_all_start_methods()} or None; got {start_method!r}")
        self.start_method = start_method
        self.run_tag = check_str(owner, "run_tag", run_tag, none_ok=True)
        self.worker_splits, self.thread_splits = split_dataset(
            self.num_samples, self.num_workers, self.worker_id, self.num_threads
        )

    # ---- fingerprint / partitions ----
    def fingerprint(self, metric_name: str) -> str:
        """Run fingerprint of one metric: data-set length and type, partitioning, the metric (name, type, dtype,
        function signature), ``sample_indices``, ``index_key`` and ``run_tag`` (16 hex digits)."""
        i = self.metric_names.index(metric_name)
        si = (
            hashlib.blake2b(self.sample_indices.astype("<i8").tobytes(), digest_size=8).hexdigest()
            if self.sample_indices is not None
            else None
        )
        payload = {
            "format": _FORMAT,
            "num_samples": self.num_samples,
            "dataset": type(self.dataset).__qualname__,
            "num_workers": self.num_workers,
            "num_threads": self.num_threads,
            "metric": metric_name,
            "type": self.metric_types[i],
            "dtype": str(self.metric_dtypes[i]),
            "function": _metric_signature(self.metric_functions[i]),
            "sample_indices": si,
            "index_key": self.index_key,
            "run_tag": self.run_tag,
        }
        return hashlib.blake2b(json.dumps(payload, sort_keys=True).encode(), digest_size=8).hexdigest()

    def _all_partitions(self) -> list[tuple[int, int, int, int]]:
        out = []
        for w, (ws, we) in enumerate(self.worker_splits):
            for t, (s, e) in enumerate(split_index(ws, we, self.num_threads)):
                out.append((w, t, s, e))
        return out

    def _plan(self) -> _Plan:
        return _Plan(
            self.dataset,
            self.collate_fn,
            self.batch_size,
            self.metric_names,
            self.metric_functions,
            self.metric_types,
            self.metric_dtypes,
            self.save_path,
            self.worker_id,
            self.num_samples,
            {m: self.fingerprint(m) for m in self.metric_names},
            self.sample_indices,
            self.index_key,
            list(self.thread_splits),
        )

    # ---- map ----
    def run_map(self) -> list[dict]:
        """Map this worker's partitions (``specific_threads`` or all) and write their files and markers.

        Returns:
            one summary dict per partition run (``worker_id, thread_id, start, end, count, seconds``).

        Raises:
            AnalyzerError: a partition failed (its error is included; others still finish) or a worker process died.
            The error of a metric (float values, wrong shape...) is re-raised as is when ``num_threads == 1``.
        """
        plan = self._plan()
        threads = self.specific_threads
        self._check_deterministic()
        total = sum(e - s for t, (s, e) in enumerate(self.thread_splits) if t in threads)
        bar = self._bar(total)
        try:
            if len(threads) == 1 or self.num_threads == 1:
                results = []
                for t in threads:
                    results.append(_run_partition(plan, t, bar.update if bar is not None else None))
                return results
            return self._run_pool(plan, threads, bar)
        finally:
            if bar is not None:
                bar.close()

    def _check_deterministic(self) -> None:
        """Refuse a collate or dataset that draws at random where a per-sample metric reads (augmentation in
        ``__getitem__``, random masking at collate time): each sample's difficulty would be a random draw. Read on the
        dataset's first ``batch_size`` samples, fetched twice
        (:func:`~lightning_effi.curriculum.analysis.in_memory.check_deterministic_collate`)."""
        from .in_memory import RandomDrawsError, check_deterministic_collate

        n = min(self.batch_size, len(self.dataset))
        for name, fn, kind in zip(self.metric_names, self.metric_functions, self.metric_types):
            if kind != "single_value_per_sample":
                continue
            try:
                check_deterministic_collate(self.dataset, self.collate_fn, n, name, fn, analyzer=True)
            except RandomDrawsError as err:
                raise AnalyzerError(str(err)) from None
            except Exception:  # noqa: BLE001 - the metric's own error: the map reports it, with the partition
                return

    def _bar(self, total: int) -> Any:
        if not self.progress:
            return None
        try:
            from tqdm.auto import tqdm
        except ImportError:  # pragma: no cover - tqdm ships with lightning
            return None
        return tqdm(
            total=total,
            desc=f"analyze map (worker {self.worker_id})",
            unit="sample",
            dynamic_ncols=True,
            file=sys.stderr,
        )

    def _run_pool(self, plan: _Plan, threads: list[int], bar: Any) -> list[dict]:
        method = self.start_method or ("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        ctx = mp.get_context(method)
        q = ctx.Queue()
        results, failures = {}, {}
        with cf.ProcessPoolExecutor(
            max_workers=len(threads), mp_context=ctx, initializer=_child_init, initargs=(plan, q)
        ) as pool:
            futures = {pool.submit(_child_run, t): t for t in threads}
            pending = set(futures)
            while pending:
                done, pending = cf.wait(pending, timeout=0.1, return_when=cf.FIRST_COMPLETED)
                self._drain(q, bar)
                for fut in done:
                    t = futures[fut]
                    try:
                        results[t] = fut.result()
                    except cf.process.BrokenProcessPool as err:
                        failures[t] = f"worker process died ({err})"
                    except BaseException as err:  # noqa: BLE001 - reported below with the partition
                        failures[t] = "".join(traceback.format_exception_only(type(err), err)).strip()
            self._drain(q, bar)
        q.close()
        if failures:
            lines = "; ".join(f"worker{self.worker_id}_thread{t}: {msg}" for t, msg in sorted(failures.items()))
            raise AnalyzerError(
                f"{len(failures)} of {len(threads)} map partitions failed: {lines}. Fix the cause "
                f"and re-run them with worker_id={self.worker_id}, "
                f"specific_threads={sorted(failures)}"
            )
        return [results[t] for t in threads]

    @staticmethod
    def _drain(q: Any, bar: Any) -> None:
        while True:
            try:
                k = q.get_nowait()
            except (queue_mod.Empty, OSError, ValueError):
                return
            if bar is not None:
                bar.update(k)

    # ---- reduce ----
    def _check_partitions(self, m: str) -> list[tuple[int, int, int, int, str, dict]]:
        fp = self.fingerprint(m)
        ok, problems = [], []
        for w, t, s, e in self._all_partitions():
            d = _partition_dir(self.save_path, m, w, t)
            name = f"worker{w}_thread{t}"
            failed = os.path.join(d, _FAILED)
            done = os.path.join(d, _DONE)
            if os.path.exists(failed):
                try:
                    with open(failed) as f:
                        info = json.load(f)
                    problems.append(f"{name}: failed ({info.get('error', '?')})")
                except (OSError, ValueError):
                    problems.append(f"{name}: failed")
                continue
            if not os.path.exists(done):
                problems.append(f"{name}: missing (not run yet, still running, or killed)")
                continue
            try:
                with open(done) as f:
                    info = json.load(f)
            except (OSError, ValueError):
                problems.append(f"{name}: unreadable marker {done}")
                continue
            if info.get("fingerprint") != fp:
                problems.append(
                    f"{name}: stale (from another run: fingerprint {info.get('fingerprint')}, this run {fp})"
                )
                continue
            if (info.get("start"), info.get("end"), info.get("count")) != (s, e, e - s):
                problems.append(f"{name}: stale (range [{info.get('start')}, {info.get('end')}), expected [{s}, {e}))")
                continue
            if self.metric_types[self.metric_names.index(m)] == "single_value_per_sample":
                for kind in ("ids", "values"):
                    p = os.path.join(d, f"{m}_{kind}.npy")
                    try:
                        shape = np.load(p, mmap_mode="r").shape if e > s else np.load(p).shape
                    except (OSError, ValueError):
                        shape = None
                    if shape != (e - s,):
                        problems.append(f"{name}: partial ({p} has shape {shape}, expected ({e - s},))")
                        break
                else:
                    ok.append((w, t, s, e, d, info))
            else:
                p = os.path.join(d, f"{m}_metric_value.npy")
                if not info.get("empty_accumulate") and not os.path.exists(p):
                    problems.append(f"{name}: partial ({p} missing)")
                else:
                    ok.append((w, t, s, e, d, info))
        if problems:
            by_worker: dict[int, list[int]] = {}
            for w, t, _s, _e in self._all_partitions():
                if not any(o[0] == w and o[1] == t for o in ok):
                    by_worker.setdefault(w, []).append(t)
            rerun = "; ".join(f"worker_id={w} specific_threads={ts}" for w, ts in sorted(by_worker.items()))
            raise AnalyzerError(
                f"metric {m!r}: cannot reduce: {len(problems)} of {len(self._all_partitions())} map "
                f"partitions are not usable (never merged): "
                + "; ".join(problems[:20])
                + f". Re-run the map for: {rerun}"
            )
        return ok

    def _doc_idx_chunks(self, chunk_sizes: Sequence[int], total: int) -> list[int]:
        return [0] + np.cumsum(np.asarray(chunk_sizes, dtype=np.int64)).tolist() + [total]

    def run_reduce(self) -> dict[str, dict]:
        """Merge all map partitions of every metric into the final files (module docstring).

        Returns:
            ``{metric: metadata dict}`` (what ``analysis_metadata.json`` holds).

        Raises:
            AnalyzerError: missing/stale/partial/failed partitions; ids not a permutation of ``[0, N)``.
        """
        out = {}
        for m, mtype in zip(self.metric_names, self.metric_types):
            parts = self._check_partitions(m)
            if mtype == "single_value_per_sample":
                out[m] = self._reduce_single(m, parts)
            else:
                out[m] = self._reduce_accumulate(m, parts)
            if not self.keep_temp:
                for w, t, *_ in self._all_partitions():
                    shutil.rmtree(_partition_dir(self.save_path, m, w, t), ignore_errors=True)
        return out

    def _reduce_single(self, m: str, parts: list) -> dict:
        n = self.num_samples
        by_id = np.empty(n, dtype=np.int64)
        seen = np.zeros(n, dtype=bool)
        id_at: np.ndarray | None = np.empty(n, dtype=np.int64)  # the sample id of each position of the data set
        for w, t, s, e, d, _ in parts:
            if e == s:
                continue
            ids = np.load(os.path.join(d, f"{m}_ids.npy"), mmap_mode="r")
            if id_at is not None and len(ids) == e - s:
                id_at[s:e] = ids
            else:
                id_at = None
            vals = np.load(os.path.join(d, f"{m}_values.npy"), mmap_mode="r")
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= n:
                raise AnalyzerError(
                    f"metric {m!r}: worker{w}_thread{t} wrote sample ids outside [0, {n}) (min {lo}, max {hi})"
                )
            if vals.dtype == np.uint64 and int(vals.max()) > np.iinfo(np.int64).max:
                raise AnalyzerError(f"metric {m!r}: values above int64 max are not supported")
            by_id[ids] = vals
            seen[ids] = True
        if not seen.all():
            missing = np.flatnonzero(~seen)[:5].tolist()
            raise AnalyzerError(
                f"metric {m!r}: sample ids are not a permutation of [0, {n}): no value for ids "
                f"{missing}... (some ids appear more than once; check the batch "
                f"{self.index_key!r} field / sample_indices)"
            )
        del seen
        order = np.argsort(by_id, kind="stable")  # ids sorted by (value, id): ids are the positions of by_id
        sorted_vals = by_id[order]
        starts = np.flatnonzero(np.concatenate(([True], sorted_vals[1:] != sorted_vals[:-1])))
        uniq = sorted_vals[starts]
        counts = np.diff(np.concatenate((starts, [n]))).astype(np.int64)
        del sorted_vals
        if len(uniq) > 1 and np.any(uniq[1:] <= uniq[:-1]):  # pragma: no cover - guaranteed by the sort
            raise AnalyzerError(f"metric {m!r}: rows not strictly increasing")
        vdtype = find_fit_int_dtype(int(uniq[0]), int(uniq[-1]))
        idtype = find_fit_int_dtype(0, n - 1)
        rows = len(uniq)
        folder = os.path.join(self.save_path, m)
        tag = f".tmp{os.getpid()}"
        final = {
            k: os.path.join(folder, f"{m}_{k}")
            for k in ("sample_to_metric", "index_to_sample", "index_to_metric", "index_to_sample_percentile_merged")
        }
        tmp = {k: v + tag for k, v in final.items()}
        # doc_idx as DeepSpeed's reduce threads produce them (``MMapIndexedDatasetBuilder.merge_file_``)
        part_sizes = [e - s for _, _, s, e in self._all_partitions()]
        s2m_chunks = [sum(part_sizes[a:b]) for a, b in split_index(0, len(part_sizes), self.num_threads_reduce)]
        row_chunks = [b - a for a, b in split_index(0, rows, self.num_threads_reduce)]
        ones_n = np.broadcast_to(np.int32(1), (n,))
        _write_dataset(tmp["sample_to_metric"], by_id, ones_n, self._doc_idx_chunks(s2m_chunks, n), vdtype)
        _write_dataset(tmp["index_to_sample"], order, counts, self._doc_idx_chunks(row_chunks, rows), idtype)
        _write_dataset(
            tmp["index_to_metric"],
            uniq,
            np.broadcast_to(np.int32(1), (rows,)),
            self._doc_idx_chunks(row_chunks, rows),
            vdtype,
        )
        merge_step = max(1, rows // 100)
        merged_sizes = np.add.reduceat(counts, np.arange(0, rows, merge_step))
        _write_dataset(tmp["index_to_sample_percentile_merged"], order, merged_sizes, [0, len(merged_sizes)], idtype)
        # verify what was written before publishing it
        index = _load_validated(tmp["index_to_sample"], tmp["index_to_metric"], n, "current", check_metadata=False)
        expected = MetricIndex(order, np.concatenate(([0], np.cumsum(counts))), uniq)
        if index.fingerprint() != expected.fingerprint():  # pragma: no cover - would be a writer bug
            raise AnalyzerError(f"metric {m!r}: written index does not read back identically")
        merged = _load_validated(tmp["index_to_sample_percentile_merged"], None, n, "current", check_metadata=False)
        s2m = MMapIndexedDataset(tmp["sample_to_metric"])
        if len(s2m) != n or not np.array_equal(np.asarray(s2m.flat, dtype=np.int64), by_id):
            raise AnalyzerError(f"metric {m!r}: written sample_to_metric does not read back identically")
        del s2m
        meta = {
            "format": _FORMAT,
            "metric_name": m,
            "metric_type": "single_value_per_sample",
            "num_samples": n,
            "run_fingerprint": self.fingerprint(m),
            "dataset_fingerprint": self._id_order_fingerprint(id_at),
            # where the ids came from when they are not the positions, and the analysed set's own fingerprint: a
            # training set that is the analysed one in its own order is then told why it is refused (a DataFrame's
            # row labels in an `index` field read as ids, qa113-tabular 05)
            "ids_from": self._ids_from(id_at),
            "positions_fingerprint": None if self._ids_from(id_at) is None else dataset_fingerprint(self.dataset),
            "index_fingerprint": index.fingerprint(),
            "merged_fingerprint": merged.fingerprint(),
            "num_distinct_values": rows,
            "merge_step": merge_step,
            "merged_rows": len(merged_sizes),
            "value_dtype": np.dtype(vdtype).name,
            "sample_idx_dtype": np.dtype(idtype).name,
            "min_value": int(uniq[0]),
            "max_value": int(uniq[-1]),
            "num_workers": self.num_workers,
            "num_threads": self.num_threads,
            "num_threads_reduce": self.num_threads_reduce,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "files": {os.path.basename(final[k]): file_digest(tmp[k]) for k in final},
        }
        self._publish(folder, tmp, final, meta)
        return meta

    def _ids_from(self, id_at: np.ndarray | None) -> str | None:
        """Where the sample ids came from when they are not the data set's positions: ``"index_key 'index'"`` (a dict
        sample's field, which takes precedence) or ``"sample_indices"``; None when they are the positions (or not
        known)."""
        if id_at is None or np.array_equal(id_at, np.arange(len(id_at))):
            return None
        try:
            first = self.dataset[0]
        except Exception:  # noqa: BLE001 - only for the message
            first = None
        if self.index_key is not None and isinstance(first, Mapping) and self.index_key in first:
            return f"index_key {self.index_key!r}"
        return "sample_indices"

    def _id_order_fingerprint(self, id_at: np.ndarray | None) -> str | None:
        """:func:`~lightning_effi.curriculum.analysis.index.dataset_fingerprint` of the analysed data set read in
        sample-id order (``id_at[k]``: the id of position ``k``): the files index samples by id, so a training set
        is checked against the data its ids point into. With ``sample_indices`` or an ``index_key`` field, the
        position-order fingerprint refused the training set the ids index and accepted the analysed one, whose
        positions were then read as ids (qa108-break 01). None when the ids of some position are not known."""
        if id_at is None:
            return None
        if np.array_equal(id_at, np.arange(len(id_at))):
            return dataset_fingerprint(self.dataset)
        return dataset_fingerprint(_InIdOrder(self.dataset, np.argsort(id_at, kind="stable")))

    def _reduce_accumulate(self, m: str, parts: list) -> dict:
        total, shape, src = None, None, None
        for w, t, _s, _e, d, info in parts:
            if info.get("empty_accumulate"):
                continue
            v = np.load(os.path.join(d, f"{m}_metric_value.npy"))
            if shape is None:
                total, shape, src = v.astype(np.int64 if v.dtype != np.uint64 else np.uint64), v.shape, (w, t)
            elif v.shape != shape:
                raise AnalyzerError(
                    f"metric {m!r} (accumulate_value_over_samples): worker{w}_thread{t} produced "
                    f"shape {v.shape} but worker{src[0]}_thread{src[1]} produced {shape}; an "
                    "accumulate metric must return one fixed shape for every batch"
                )
            else:
                total += v
        if total is None:  # pragma: no cover - N >= 1 guarantees a non-empty partition
            raise AnalyzerError(f"metric {m!r}: no partition produced a value")
        flat = total.reshape(-1)
        vdtype = find_fit_int_dtype(int(flat.min()), int(flat.max())) if flat.size else np.uint8
        folder = os.path.join(self.save_path, m)
        final = {"metric_value": os.path.join(folder, f"{m}_metric_value")}
        tmp = {"metric_value": final["metric_value"] + f".tmp{os.getpid()}"}
        _write_dataset(tmp["metric_value"], flat, np.array([flat.size]), [0, 1], vdtype)
        back = MMapIndexedDataset(tmp["metric_value"])
        if len(back) != 1 or not np.array_equal(np.asarray(back[0], dtype=np.int64), flat.astype(np.int64)):
            raise AnalyzerError(f"metric {m!r}: written metric_value does not read back identically")
        del back
        meta = {
            "format": _FORMAT,
            "metric_name": m,
            "metric_type": "accumulate_value_over_samples",
            "num_samples": self.num_samples,
            "run_fingerprint": self.fingerprint(m),
            "dataset_fingerprint": dataset_fingerprint(self.dataset),
            "shape": list(shape),
            "value_dtype": np.dtype(vdtype).name,
            "num_workers": self.num_workers,
            "num_threads": self.num_threads,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "files": {os.path.basename(final["metric_value"]): file_digest(tmp["metric_value"])},
        }
        self._publish(folder, tmp, final, meta)
        return meta

    @staticmethod
    def _publish(folder: str, tmp: dict[str, str], final: dict[str, str], meta: dict) -> None:
        marker = os.path.join(folder, INPROGRESS_NAME)
        with open(marker, "w") as f:
            f.write(json.dumps({"run_fingerprint": meta["run_fingerprint"], "pid": os.getpid()}))
            f.flush()
            os.fsync(f.fileno())
        meta_path = os.path.join(folder, METADATA_NAME)
        if os.path.exists(meta_path):
            os.remove(meta_path)
        for k in final:
            os.replace(data_file_path(tmp[k]), data_file_path(final[k]))
            os.replace(index_file_path(tmp[k]), index_file_path(final[k]))
        _fsync_dir(folder)
        _atomic_json(meta_path, meta)
        os.remove(marker)
        _fsync_dir(folder)

    # ---- both ----
    def run_map_reduce(
        self, comm_group: Any = None, wait_timeout: float = 3600.0, poll_interval: float = 1.0
    ) -> dict[str, dict] | None:
        """Map, then one reduce on ``worker_id == 0`` after every partition finished (DeepSpeed PR #5131: the reduce
        ran before the maps finished, or on every node).

        With ``torch.distributed`` initialized: barrier (``comm_group``), reduce on worker 0, barrier. Otherwise
        (e.g. independent Slurm/submitit jobs sharing ``save_path``) worker 0 waits for the completion markers of all
        partitions (up to ``wait_timeout`` seconds, failing fast on a failed partition); other workers return after
        their map. Returns the reduce's metadata on worker 0, else ``None``.
        """
        self.run_map()
        dist = None
        try:
            import torch.distributed as dist_mod

            if dist_mod.is_available() and dist_mod.is_initialized():
                dist = dist_mod
        except ImportError:  # pragma: no cover
            pass
        if dist is not None:
            dist.barrier(group=comm_group)
            result = self.run_reduce() if self.worker_id == 0 else None
            dist.barrier(group=comm_group)
            return result
        if self.worker_id != 0:
            return None
        if self.num_workers > 1:
            self.wait_for_partitions(wait_timeout, poll_interval)
        return self.run_reduce()

    def wait_for_partitions(self, timeout: float = 3600.0, poll: float = 1.0) -> None:
        """Block until every partition of every metric has a completion marker of this run.

        Raises:
            AnalyzerError: a partition failed (``map_failed.json``), or ``timeout`` seconds passed.
        """
        deadline = time.monotonic() + timeout
        while True:
            waiting = []
            for m in self.metric_names:
                fp = self.fingerprint(m)
                for w, t, _, _ in self._all_partitions():
                    d = _partition_dir(self.save_path, m, w, t)
                    if os.path.exists(os.path.join(d, _FAILED)):
                        self._check_partitions(m)  # raises, naming the failure
                    try:
                        with open(os.path.join(d, _DONE)) as f:
                            if json.load(f).get("fingerprint") == fp:
                                continue
                    except (OSError, ValueError):
                        pass
                    waiting.append(f"worker{w}_thread{t}")
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise AnalyzerError(
                    f"timed out after {timeout} s waiting for map partitions {sorted(set(waiting))[:10]} to finish"
                )
            time.sleep(poll)

    def __repr__(self) -> str:
        return (
            f"DataAnalyzer(N={self.num_samples}, metrics={self.metric_names}, num_workers={self.num_workers}, "
            f"worker_id={self.worker_id}, num_threads={self.num_threads}, save_path='{self.save_path}')"
        )
