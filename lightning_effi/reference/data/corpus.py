"""The embedded default text corpus: Python standard-library source code.

Needs no download and exists wherever Python runs. :data:`STDLIB_CORPUS_FILES` is a fixed list of 36 stable
modules (paths relative to ``sysconfig.get_paths()["stdlib"]``) that are plain ``.py`` files in CPython 3.10-3.13.
Modules that became packages or thin shims in that range are left out on purpose: ``pathlib`` (a package in 3.13),
``zipfile`` (a package in 3.12), ``datetime`` and ``decimal`` (shims over ``_pydatetime``/``_pydecimal`` in 3.12).
A listed file that is missing (an unusual or future Python) is skipped; :func:`stdlib_corpus_files` reports the files
actually used, in list order.

:func:`stdlib_corpus` concatenates the used files in list order, each preceded by a line
``# ---- <relative path> ----``, and truncates the result at ``max_chars`` characters. The text is deterministic for
a given Python installation (it changes with the Python version, as the sources do; caches key on its hash).
About 1.5 M characters are available before the cap on CPython 3.11.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

__all__ = ["STDLIB_CORPUS_FILES", "stdlib_corpus", "stdlib_corpus_files"]

STDLIB_CORPUS_FILES: tuple[str, ...] = (
    "argparse.py",
    "ast.py",
    "base64.py",
    "bisect.py",
    "calendar.py",
    "collections/__init__.py",
    "contextlib.py",
    "copy.py",
    "csv.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "getopt.py",
    "gettext.py",
    "heapq.py",
    "inspect.py",
    "ipaddress.py",
    "json/decoder.py",
    "json/encoder.py",
    "logging/__init__.py",
    "pickle.py",
    "pprint.py",
    "queue.py",
    "random.py",
    "shlex.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "tarfile.py",
    "textwrap.py",
    "threading.py",
    "tokenize.py",
    "typing.py",
    "uuid.py",
)


def _stdlib_dir(stdlib_dir: str | os.PathLike | None) -> Path:
    return Path(stdlib_dir) if stdlib_dir is not None else Path(sysconfig.get_paths()["stdlib"])


def stdlib_corpus_files(stdlib_dir: str | os.PathLike | None = None) -> list[str]:
    """The entries of :data:`STDLIB_CORPUS_FILES` present in ``stdlib_dir`` (default: this Python's), in order."""
    root = _stdlib_dir(stdlib_dir)
    return [name for name in STDLIB_CORPUS_FILES if (root / name).is_file()]


def stdlib_corpus(max_chars: int = 1_000_000, stdlib_dir: str | os.PathLike | None = None) -> str:
    """The stdlib corpus (see the module docstring), at most ``max_chars`` characters.

    Raises:
        ValueError: ``max_chars`` < 1.
        FileNotFoundError: none of the listed files exists in ``stdlib_dir``.
    """
    if max_chars < 1:
        raise ValueError(f"max_chars: {max_chars} is invalid; expected >= 1")
    root = _stdlib_dir(stdlib_dir)
    parts, size = [], 0
    files = stdlib_corpus_files(root)
    if not files:
        raise FileNotFoundError(f"none of STDLIB_CORPUS_FILES exists under '{root}'")
    for name in files:
        source = (root / name).read_text(encoding="utf-8")
        part = f"# ---- {name} ----\n{source}" + ("" if source.endswith("\n") else "\n")
        parts.append(part)
        size += len(part)
        if size >= max_chars:
            break
    return "".join(parts)[:max_chars]
