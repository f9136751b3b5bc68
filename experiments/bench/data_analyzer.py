"""Benchmark: lightning_effi DataAnalyzer vs DeepSpeed 0.19.8's DataAnalyzer on 1,000,000 token samples.

Data: Tiny Shakespeare, character level (65 symbols -> ids 1..65, padding 0). Sample i is a window of the text
(repeated as needed) of a length drawn uniformly in ``[--min-len, --width]`` starting at a random offset, right-padded
with 0 to ``--width`` columns; all samples form one ``uint8[N, width]`` array stored as ``.npy`` and memory-mapped.
:class:`TokenRows` serves single rows and batched fetches (``__getitems__``: one slice for contiguous indices, which
torch's DataLoader and both analyzers use); the collate function passes the ``[B, width]`` tensor through.

Metric: ``seqlen`` (non-padding tokens per sample). Arms, each in a fresh subprocess (timed inside, after imports):

- ``ours1`` / ``ours2``: ``DataAnalyzer(num_threads=1|2).run_map_reduce()`` (map in 1 or 2 local processes + reduce);
- ``deepspeed``: ``deepspeed...DataAnalyzer(num_threads=2)`` ``run_map()`` then ``run_reduce()``, run with
  ``PYTHONPATH=--ds-site`` (DeepSpeed is not a project dependency; when it cannot be imported the arm is skipped
  and the reason recorded).

Same batch size for all arms (``--batch-size``). Peak memory: ``resource.getrusage`` ``ru_maxrss`` of the arm
process (``RUSAGE_SELF``; also its high-water mark right after the imports, and the increase over it) and of its
child processes (``RUSAGE_CHILDREN``: the largest child, including subprocesses started by imports), in MiB; it
includes the memory-mapped data pages each process touched (128 MiB for all 1M rows). ``import lightning_effi``
imports lightning (~750 MiB RSS), DeepSpeed's arm imports torch only. The final index files of ours2 and DeepSpeed
are compared: byte-identical ``.bin``/``.idx`` and identical contents (``sample_to_metric``, ``index_to_sample`` rows,
``index_to_metric`` values, ``_percentile_merged`` rows).

    python experiments/bench/data_analyzer.py                      # 1M samples, all arms (~2 min on 2 CPUs)
    python experiments/bench/data_analyzer.py --num-samples 100000 --tag _100k

Writes ``experiments/bench/results/data_analyzer<tag>.json`` and ``.png``. Target (issue): ours >= 5x faster than
DeepSpeed with 2 processes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


class TokenRows:
    """``uint8[N, width]`` token rows from a ``.npy`` file (memory-mapped; pickles as its path)."""

    def __init__(self, path: str):
        self.path = str(path)
        self.rows = np.load(self.path, mmap_mode="r")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        import torch

        return torch.from_numpy(np.array(self.rows[int(i)]))

    def __getitems__(self, indices):
        import torch

        idx = np.asarray(indices, dtype=np.int64)
        if len(idx) and idx[-1] - idx[0] == len(idx) - 1 and np.all(np.diff(idx) == 1):
            block = np.array(self.rows[idx[0] : idx[-1] + 1])
        else:
            block = self.rows[idx]
        return torch.from_numpy(block)

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])


def passthrough(batch):
    return batch


def ds_seqlen(batch):
    import torch

    return torch.count_nonzero(batch, dim=1).to(torch.int64)


def build_data(path: Path, n: int, width: int, min_len: int, seed: int) -> dict:
    text = DATA.read_text(encoding="utf-8")
    chars = sorted(set(text))
    lut = np.zeros(0x110000 if max(map(ord, chars)) > 255 else 256, dtype=np.uint8)
    for i, c in enumerate(chars):
        lut[ord(c)] = i + 1
    ids = lut[np.frombuffer(text.encode("latin-1"), dtype=np.uint8)]
    ids = np.concatenate([ids, ids[:width]])  # windows may wrap around: repeat the text
    rng = np.random.default_rng(seed)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(n, width))
    cols = np.arange(width)
    for s in range(0, n, 1 << 16):
        e = min(n, s + (1 << 16))
        starts = rng.integers(0, len(ids) - width, e - s)
        lengths = rng.integers(min_len, width + 1, e - s)
        block = ids[starts[:, None] + cols]
        block[cols[None, :] >= lengths[:, None]] = 0
        out[s:e] = block
    out.flush()
    return {
        "num_samples": n,
        "width": width,
        "min_len": min_len,
        "vocab": len(chars),
        "seed": seed,
        "bytes": int(os.path.getsize(path)),
    }


def run_arm(arm: str, data_path: str, save_path: str, batch_size: int) -> dict:
    t_import = time.perf_counter()
    ds = TokenRows(data_path)
    if arm.startswith("ours"):
        from lightning_effi.curriculum.analysis import DataAnalyzer, seqlen

        threads = int(arm[-1])
        import_s = time.perf_counter() - t_import
        a = DataAnalyzer(
            ds,
            num_threads=threads,
            batch_size=batch_size,
            metric_names=["seqlen"],
            metric_functions=[seqlen(pad_token_id=0)],
            metric_types=["single_value_per_sample"],
            metric_dtypes=[np.int64],
            save_path=save_path,
            collate_fn=passthrough,
            progress=False,
        )
        base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        a.run_map()
        t1 = time.perf_counter()
        a.run_reduce()
        t2 = time.perf_counter()
    else:
        import logging

        import torch
        from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer as DSAnalyzer

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        import_s = time.perf_counter() - t_import
        kw = dict(
            num_threads=2,
            batch_size=batch_size,
            metric_names=["seqlen"],
            metric_functions=[ds_seqlen],
            metric_types=["single_value_per_sample"],
            metric_dtypes=[torch.int64],
            save_path=save_path,
            collate_fn=passthrough,
        )
        base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        DSAnalyzer(ds, **kw).run_map()
        t1 = time.perf_counter()
        DSAnalyzer(ds, **kw).run_reduce()
        t2 = time.perf_counter()
    self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    child_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    n = len(ds)
    return {
        "arm": arm,
        "map_s": t1 - t0,
        "reduce_s": t2 - t1,
        "total_s": t2 - t0,
        "samples_per_s": n / (t2 - t0),
        "map_samples_per_s": n / (t1 - t0),
        "import_s": import_s,
        "peak_rss_self_mib": self_kb / 1024,
        "rss_after_imports_mib": base_kb / 1024,
        "peak_rss_increase_mib": (self_kb - base_kb) / 1024,
        "peak_rss_largest_child_mib": child_kb / 1024,
    }


def compare(ours: str, theirs: str) -> dict:
    sys.path.insert(0, str(ROOT))
    from lightning_effi.curriculum.analysis import MMapIndexedDataset

    files = ("sample_to_metric", "index_to_sample", "index_to_metric", "index_to_sample_percentile_merged")
    out = {"bytes_identical": {}, "contents_identical": {}}
    for f in files:
        a, b = Path(ours) / "seqlen" / f"seqlen_{f}", Path(theirs) / "seqlen" / f"seqlen_{f}"
        out["bytes_identical"][f] = all(
            Path(f"{a}.{e}").read_bytes() == Path(f"{b}.{e}").read_bytes() for e in ("bin", "idx")
        )
        da, db = MMapIndexedDataset(a), MMapIndexedDataset(b)
        out["contents_identical"][f] = bool(
            np.array_equal(da.sizes, db.sizes)
            and np.array_equal(np.asarray(da.flat, np.int64), np.asarray(db.flat, np.int64))
        )
    out["all_identical"] = all(out["bytes_identical"].values()) and all(out["contents_identical"].values())
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [r for r in results["arms"] if "total_s" in r]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["arm"] for r in arms]
    ax[0].bar(names, [r["samples_per_s"] for r in arms], color=["C0", "C0", "C3"][: len(arms)])
    ax[0].set_ylabel("samples / s (map + reduce)")
    ax[0].set_yscale("log")
    ax[0].set_title(f"seqlen over {results['data']['num_samples']:,} samples")
    ax[1].bar(names, [r["map_s"] for r in arms], label="map")
    ax[1].bar(names, [r["reduce_s"] for r in arms], bottom=[r["map_s"] for r in arms], label="reduce")
    ax[1].set_ylabel("seconds")
    ax[1].legend()
    for a in ax:
        a.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-samples", type=int, default=1_000_000)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", nargs="+", default=["ours1", "ours2", "deepspeed"])
    p.add_argument("--ds-site", default="/work/ds_site", help="folder with deepspeed installed (pip --target)")
    p.add_argument("--workdir", default=None, help="scratch folder (default: a temporary folder)")
    p.add_argument("--out", default=str(ROOT / "experiments" / "bench" / "results"))
    p.add_argument("--tag", default="")
    p.add_argument("--arm", help=argparse.SUPPRESS)
    p.add_argument("--data-path", help=argparse.SUPPRESS)
    p.add_argument("--save-path", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.arm:  # child mode
        print(json.dumps(run_arm(args.arm, args.data_path, args.save_path, args.batch_size)))
        return
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_analyzer_"))
    work.mkdir(parents=True, exist_ok=True)
    data_path = work / f"tokens_{args.num_samples}_{args.width}.npy"
    t0 = time.perf_counter()
    data = build_data(data_path, args.num_samples, args.width, args.min_len, args.seed)
    data["build_s"] = time.perf_counter() - t0
    results = {
        "data": data,
        "batch_size": args.batch_size,
        "metric": "seqlen",
        "arms": [],
        "memory_note": "ru_maxrss (MiB) of the arm process and of its largest child process; includes the "
        "memory-mapped data pages touched",
        "cpus": os.cpu_count(),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }
    for arm in args.arms:
        env = dict(os.environ)
        if arm == "deepspeed":
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.ds_site, str(ROOT), env.get("PYTHONPATH")]))
            env["DS_ACCELERATOR"] = "cpu"
        save = work / f"out_{arm}"
        cmd = [
            sys.executable,
            __file__,
            "--arm",
            arm,
            "--data-path",
            str(data_path),
            "--save-path",
            str(save),
            "--batch-size",
            str(args.batch_size),
        ]
        print(f"[bench] running {arm} ...", flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            reason = (proc.stderr.strip().splitlines() or ["?"])[-1]
            results["arms"].append({"arm": arm, "skipped": True, "reason": reason[-500:]})
            print(f"[bench] {arm} failed/skipped: {reason}", flush=True)
            continue
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        res["save_path"] = str(save)
        results["arms"].append(res)
        print(
            f"[bench] {arm}: {res['total_s']:.2f} s ({res['samples_per_s']:,.0f} samples/s; map "
            f"{res['map_s']:.2f} s, reduce {res['reduce_s']:.2f} s), peak RSS {res['peak_rss_self_mib']:.0f} MiB "
            f"(+{res['peak_rss_increase_mib']:.0f} MiB over the imports; largest child "
            f"{res['peak_rss_largest_child_mib']:.0f} MiB)",
            flush=True,
        )
    by = {r["arm"]: r for r in results["arms"] if "total_s" in r}
    if "deepspeed" in by:
        for arm in ("ours1", "ours2"):
            if arm in by:
                results[f"speedup_{arm}_vs_deepspeed"] = by["deepspeed"]["total_s"] / by[arm]["total_s"]
        ref = by.get("ours2") or by.get("ours1")
        if ref is not None:
            results["comparison_vs_deepspeed"] = compare(ref["save_path"], by["deepspeed"]["save_path"])
        results["target_5x_met"] = results.get("speedup_ours2_vs_deepspeed", 0) >= 5
    if "ours1" in by and "ours2" in by:
        results["ours1_vs_ours2_identical"] = compare(by["ours1"]["save_path"], by["ours2"]["save_path"])[
            "all_identical"
        ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"data_analyzer{args.tag}.json").write_text(json.dumps(results, indent=1))
    plot(results, out / f"data_analyzer{args.tag}.png")
    print(json.dumps({k: v for k, v in results.items() if k != "arms"}, indent=1))


if __name__ == "__main__":
    main()
