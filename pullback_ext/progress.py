"""Progress output on stderr that suits where stderr goes, and info lines on stdout.

On a terminal, :func:`progress_bar` is tqdm's redrawn bar. Anywhere else (a log file, a pipe, a
CI job) it writes one plain line per stage: when the bar starts, each time another tenth of the
total is done, and when it ends, instead of tqdm's carriage-return redraws, which a log file
fills with hundreds of partial lines; a bar given a ``heartbeat`` also writes a line when that
many seconds have passed since its last one and it was updated (or its postfix changed), so that
a stage whose steps take minutes still shows that it moves. :func:`info_line` prints a line about
the run (what was written where, which stage runs); results (tables, figures) are printed with
``print``. Inside :func:`silenced` (``--quiet``) neither progress nor info lines are shown;
warnings and errors are.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Iterable, Iterator, Optional, TextIO

STEPS = 10  # a line per tenth of the total off a terminal
_silenced = False


@contextlib.contextmanager
def silenced() -> Iterator[None]:
    """No progress output and no :func:`info_line` lines inside the block (the ``--quiet`` switch)."""
    global _silenced
    previous, _silenced = _silenced, True
    try:
        yield
    finally:
        _silenced = previous


def info_line(*parts) -> None:
    """``print(*parts)`` to stdout (flushed) unless :func:`silenced`: a line about the run, not a result."""
    if not _silenced:
        print(*parts, flush=True)


def progress_bar(iterable: Optional[Iterable] = None, *, desc: str, total: Optional[int] = None, unit: str = "it",
                 initial: int = 0, enabled: bool = True, stream: Optional[TextIO] = None, heartbeat: Optional[float] = None):
    """A progress display over ``iterable`` (or updated by hand with ``update(n)``) for ``total``
    items (default ``len(iterable)``): tqdm when ``stream`` (default stderr) is a terminal,
    else :class:`LineProgress` (with ``heartbeat``: also a line at the first update or postfix
    change once that many seconds have passed since the last line); nothing when not ``enabled``
    or inside :func:`silenced`. The result iterates, and has ``update``, ``set_postfix`` and
    ``close`` and is a context manager."""
    from tqdm import tqdm

    stream = sys.stderr if stream is None else stream
    if not enabled or _silenced:
        return tqdm(iterable, total=total, disable=True)
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)
    if _is_terminal(stream):
        return tqdm(iterable, desc=desc, total=total, unit=unit, initial=initial, file=stream)
    return LineProgress(iterable, desc=desc, total=total, unit=unit, initial=initial, stream=stream, heartbeat=heartbeat)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class LineProgress:
    """Plain-line progress for a log: ``desc: 3/10 unit (30%) 4.2 s [loss=0.1]`` when it starts,
    at every tenth of ``total`` and at the end (without a total: at the start and the end); with a
    ``heartbeat`` (seconds) also at the first ``update`` or ``set_postfix`` that comes that long
    after the last line."""

    def __init__(self, iterable: Optional[Iterable], *, desc: str, total: Optional[int], unit: str, initial: int, stream: TextIO,
                 heartbeat: Optional[float] = None):
        self.iterable, self.desc, self.total, self.unit, self.stream = iterable, desc, total, unit, stream
        self.n, self.postfix, self.started, self.closed, self.heartbeat = initial, "", time.monotonic(), False, heartbeat
        self.shown = self.shown_n = -1  # the tenth and count last written
        self._write()

    def _due(self) -> bool:
        return self.heartbeat is not None and time.monotonic() - self.written >= self.heartbeat

    def _tenth(self) -> int:
        return min(STEPS, self.n * STEPS // self.total) if self.total else 0

    def _write(self) -> None:
        count = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        share = f" ({100 * self.n // self.total}%)" if self.total else ""
        postfix = f" [{self.postfix}]" if self.postfix else ""
        self.written = time.monotonic()
        print(f"{self.desc}: {count} {self.unit}{share} {self.written - self.started:.1f} s{postfix}", file=self.stream, flush=True)
        self.shown, self.shown_n = self._tenth(), self.n

    def update(self, n: int = 1) -> None:
        self.n += n
        if (self.total and self._tenth() > self.shown) or self._due():
            self._write()

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())
        if self._due():
            self._write()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.n != self.shown_n:
                self._write()

    def __iter__(self):
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
