"""Printing text while a live progress display may be redirecting the output streams.

Lightning's :class:`~lightning.pytorch.callbacks.RichProgressBar` (the Trainer's default progress bar when ``rich``
is installed) runs a ``rich`` live display from ``on_train_start`` until its ``teardown``, so through ``on_fit_end``
too. While it is live, ``sys.stdout`` and ``sys.stderr`` are ``rich.file_proxy.FileProxy`` objects: ``write`` prints
every complete line at once and keeps the rest of the text (a partial line) in a buffer; ``flush`` prints the buffer
and empties it only afterwards. Under a Jupyter kernel each print is published as display data, and ipykernel
flushes ``sys.stdout`` and ``sys.stderr`` before it publishes anything, so a ``flush`` that finds a partial line
prints it, which flushes again, and so on until ``RecursionError`` (``rich`` issue #3390; seen with rich 15.0 and
ipykernel 7.4).
``print(text)`` is such a case for every multi-line ``text``: it writes ``text`` and the final newline separately,
so the last line of ``text`` is still buffered when the first lines are published.

:func:`print_block` writes the whole text with its final newline in one ``write``: every line is complete, the buffer
is empty when the lines are published, and the flush that publishing triggers has nothing to print. Outside a live
display it prints exactly what ``print(text, flush=True)`` prints.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from typing import TextIO

__all__ = ["print_block", "unshown_warnings"]


def print_block(text: str, file: TextIO | None = None) -> None:
    """Print ``text`` (any number of lines) followed by a newline, as one ``write`` call, then flush.

    Safe under a live ``rich`` display in Jupyter, where ``print`` of a multi-line text raises ``RecursionError``
    (module docstring). A partial line already buffered in ``file`` is completed by the first line of ``text``, as
    with ``print``.

    Args:
        text: the text; a newline is appended.
        file: where to write; default: the current ``sys.stdout`` (looked up at call time, so a redirection by a
            live display or by ``contextlib.redirect_stdout`` applies).

    Raises:
        TypeError: ``text`` is not a ``str``.
    """
    if not isinstance(text, str):
        raise TypeError(f"print_block: text must be a str, got {type(text).__name__}")
    stream = sys.stdout if file is None else file
    stream.write(text + "\n")
    stream.flush()


@contextlib.contextmanager
def unshown_warnings() -> Iterator[None]:
    """Show no warning raised inside (a replay of code the run already ran, whose warnings it showed), without
    touching the warning filters: ``warnings.catch_warnings()`` changes them on entry and exit, which makes Python
    forget every warning already shown once (each module's ``__warningregistry__`` is reset when the filters change),
    so Lightning's once-per-run warnings (and the user's) would show again after every use. Inside, ``showwarning``
    is a no-op; a filter's ``"error"`` action still raises.
    """
    show = warnings.showwarning
    warnings.showwarning = lambda *args, **kwargs: None
    try:
        yield
    finally:
        warnings.showwarning = show
