"""Progress of a long loop: a tqdm bar on a terminal, a plain line every few seconds elsewhere.

A tqdm bar written into a pipe or a log file becomes one line per refresh; this writes, when the
stream is not a TTY (pipeline logs, CI), one readable line every ``every_s`` seconds and one at
:meth:`ProgressLine.close`::

    progress = ProgressLine("train", total=257, unit="step")
    for batch in batches:
        ...
        progress.update()
        progress.set_status("11,234 samples/s, loss 0.6931")
    progress.close()

    train: step 120/257 (47%) 11,234 samples/s, loss 0.6931, eta 12 s     # every 10 s
    train: step 257/257 (100%) 11,301 samples/s, loss 0.6702, in 23 s     # at close

Without a ``total`` (the work is not known) the line is ``train: step 120 ...`` with no eta.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm


def format_seconds(seconds: float) -> str:
    """``12 s``, ``3 min 05 s``, ``1 h 02 min``: a duration for a log line."""
    s = max(int(round(seconds)), 0)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class ProgressLine:
    """Counts ``n`` of ``total`` units; tqdm on a TTY ``stream``, plain lines otherwise.

    ``label`` is the word before the count in plain lines (default: ``unit``, as in
    ``step 120/257``); ``label=""`` puts the unit after it (``15/20 s``). ``every_s``: seconds
    between plain lines (0: one per :meth:`update`). ``disable``: nothing at all (other ranks,
    ``--no-progress``). ``stream`` defaults to ``sys.stderr`` at construction.
    """

    def __init__(
        self,
        desc: str,
        *,
        total: int | None = None,
        unit: str = "step",
        label: str | None = None,
        initial: int = 0,
        every_s: float = 10.0,
        stream: TextIO | None = None,
        disable: bool = False,
    ) -> None:
        self.desc, self.total, self.unit, self.n = desc, total, unit, initial
        self.label = unit if label is None else label
        self.every_s, self.disable = every_s, disable
        self.stream = sys.stderr if stream is None else stream
        self.status = ""
        self._initial, self._start = initial, time.perf_counter()
        self._last_line = self._start
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self._bar: tqdm | None = None
        if self.tty and not disable:
            self._bar = tqdm(
                desc=desc, total=total, unit=unit, initial=initial, file=self.stream, leave=True
            )

    def update(self, n: int = 1) -> None:
        """``n`` more units done; a plain line when ``every_s`` has passed since the last."""
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.perf_counter()
        if not self.disable and now - self._last_line >= self.every_s:
            self._last_line = now
            self._write(self.line(now))

    def set_status(self, status: str) -> None:
        """Text after the count (rates, loss): the bar's postfix, or the plain line's tail."""
        self.status = status
        if self._bar is not None:
            self._bar.set_postfix_str(status)

    def line(self, now: float | None = None, *, final: bool = False) -> str:
        """The plain line for the current count, e.g. ``train: step 120/257 (47%) ..., eta 12 s``."""
        elapsed = (time.perf_counter() if now is None else now) - self._start
        count = f"{self.n}" if self.total is None else f"{self.n}/{self.total}"
        count = f"{self.label} {count}" if self.label else f"{count} {self.unit}"
        parts = [f"{self.desc}: {count}"]
        if self.total:
            parts.append(f" ({100 * self.n // self.total}%)")
        if self.status:
            parts.append(f" {self.status}")
        done = self.n - self._initial
        if final:
            parts.append(f", in {format_seconds(elapsed)}")
        elif self.total is not None and done > 0 and elapsed > 0:
            eta = max(self.total - self.n, 0) * elapsed / done
            parts.append(f", eta {format_seconds(eta)}")
        return "".join(parts)

    def close(self) -> None:
        """End the bar, or write the last plain line (the final count and the time taken)."""
        if self._bar is not None:
            self._bar.close()
        elif not self.disable:
            self._write(self.line(final=True))
        self.disable = True  # a second close writes nothing

    def _write(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()
