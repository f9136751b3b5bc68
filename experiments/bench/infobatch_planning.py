"""Micro-benchmark: the cost of planning one InfoBatch prune epoch for 10 million samples (issue #3's target: < 1 s).

Times :func:`lightning_effi.functional.infobatch.plan_epoch` (threshold at the mean score, split into well-learned
and other samples, the random draw of the kept well-learned ones, the shuffle and the 1 / (1 - r) weights) on
exponentially distributed scores with every sample seen, r = 0.5, delta = 0.875, 10 epochs, ``--repeats`` times at
epochs 1, 2, ...; reports the fastest and the median wall time (seconds) and the fraction of samples the plan drops.
The training benchmark (InfoBatch against the baseline frontier on CIFAR-10) is ``bench=infobatch_cifar10``
(conf/bench/infobatch_cifar10.yaml); this part was its script's ``--planning-only`` mode up to commit 0a842af.

    python experiments/bench/infobatch_planning.py              # about 20 s on 2 CPU cores
    python experiments/bench/infobatch_planning.py --n 100000 --out /tmp/planning.json

Writes ``experiments/bench/results/infobatch_planning.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from lightning_effi.functional import infobatch as ib

ROOT = Path(__file__).resolve().parents[2]


def planning_overhead(n: int = 10_000_000, repeats: int = 7) -> dict[str, Any]:
    """Seconds to plan one prune epoch for ``n`` samples: the fastest of ``repeats`` (``seconds``), the median and
    all of them, and the saved fraction of the last plan."""
    g = torch.Generator().manual_seed(0)
    score = torch.empty(n).exponential_(generator=g)
    seen = torch.ones(n, dtype=torch.bool)
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        plan = ib.plan_epoch(score, seen, epoch=1 + r, num_epochs=10, prune_ratio=0.5, delta=0.875, seed=0)
        times.append(time.perf_counter() - t0)
    return {
        "n": n,
        "seconds": min(times),
        "median_seconds": statistics.median(times),
        "all_seconds": times,
        "saved_fraction": plan.saved / n,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=10_000_000, help="samples in the planned epoch")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "bench" / "results" / "infobatch_planning.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    overhead = planning_overhead(args.n, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"planning_overhead": overhead, "threads": torch.get_num_threads()}, indent=2))
    print(json.dumps(overhead, indent=2))


if __name__ == "__main__":
    main()
