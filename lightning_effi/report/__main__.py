"""``python -m lightning_effi.report <run or sweep folders...> [--out DIR] [--metric NAME] [--mode min|max]
[--compute flops|tokens|samples|layer_tokens]``: print the sweep report's Markdown table and write ``report.md``,
``report.csv``, ``report.json`` and the figures (:func:`lightning_effi.report.write_report`).

Exit status 0; 1 with a one-line error (``error: ...``) for a path without runs, an unreadable or older run record,
or runs that cannot be compared (set ``EFFI_FULL_ERROR=1`` for the traceback); 2 for bad arguments (argparse).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from lightning_effi.report.load import COMPUTE_KEYS, ReportError


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_effi.report",
        description=(
            "Compare the runs of a sweep (each folder holds result.json files, searched recursively) with the "
            "same-length baseline and the baseline frontier (Kaddour et al. 2023, 'No Train No Gain', Sec. 3)."
        ),
    )
    parser.add_argument("paths", nargs="+", help="run folders, sweep folders or any folder above them")
    parser.add_argument("--out", default=None, help="where to write the report (default: the first path)")
    parser.add_argument("--metric", default=None, help="quality metric (default: the runs' optimized_metric)")
    parser.add_argument(
        "--mode",
        default=None,
        choices=("min", "max"),
        help="metric direction (default: the runs' optimized_mode, else from the name)",
    )
    parser.add_argument(
        "--compute", default="flops", choices=COMPUTE_KEYS, help="compute quantity of the savings (default: flops)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args = parse_args(argv)
    from lightning_effi.report.table import write_report

    try:
        report = write_report(args.paths, out_dir=args.out, metric=args.metric, compute=args.compute, mode=args.mode)
    except (ReportError, FileNotFoundError, NotADirectoryError, PermissionError) as err:
        if os.environ.get("EFFI_FULL_ERROR") == "1":
            raise
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(report.to_markdown())
    print("Wrote: " + ", ".join(str(p) for p in report.files.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
