"""A tiny dependency-free progress bar with an ETA, drawn on stderr only when it is a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO

_WIDTH = 28
_REDRAW_S = 0.1


class ProgressBar:
    """``with ProgressBar(total, "profiling") as bar: bar.advance(note=op)``.

    Draws nothing when ``enabled`` is False or ``stream`` is not a TTY, so it is safe in pipes,
    logs and tests.
    """

    def __init__(self, total: int, label: str, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total = max(total, 0)
        self.label = label
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled and self.total > 0 and _isatty(self._stream)
        self._start_s = time.monotonic()
        self._last_draw_s = 0.0
        self._last_len = 0

    def advance(self, n: int = 1, note: str = "") -> None:
        self.done = min(self.done + n, self.total)
        now = time.monotonic()
        if self._enabled and (now - self._last_draw_s >= _REDRAW_S or self.done == self.total):
            self._draw(now, note)

    def close(self) -> None:
        if self._enabled and self._last_len:
            self._stream.write("\n")
            self._stream.flush()
            self._last_len = 0

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _draw(self, now: float, note: str) -> None:
        self._last_draw_s = now
        frac = self.done / self.total
        filled = int(frac * _WIDTH)
        elapsed_s = now - self._start_s
        eta = _clock(elapsed_s / self.done * (self.total - self.done)) if self.done else "--:--"
        line = (f"{self.label} [{'#' * filled}{'.' * (_WIDTH - filled)}] {self.done}/{self.total} "
                f"{frac:4.0%} {_clock(elapsed_s)} eta {eta} {note}")[:120]
        self._stream.write("\r" + line.ljust(self._last_len))
        self._stream.flush()
        self._last_len = len(line)


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
