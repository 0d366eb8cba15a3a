"""Progress lines on stderr for long loads (rate-limited, silent when disabled)."""

from __future__ import annotations

import sys
import time


class Progress:
    """Prints `label: i/n (pct%)` at most every `interval` seconds, and once when done."""

    def __init__(self, label: str, total: int, enabled: bool = True, interval: float = 0.5):
        self.label, self.total, self.enabled, self.interval = (
            label,
            max(total, 1),
            enabled,
            interval,
        )
        self._last = 0.0
        self._start = time.monotonic()

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < self.total and (now - self._last < self.interval or not sys.stderr.isatty()):
            return  # logs get only the final line; terminals get a live one
        self._last = now
        pct = 100.0 * done / self.total
        end = "\n" if done >= self.total else "\r"
        took = f" in {now - self._start:.1f}s" if done >= self.total else ""
        print(
            f"{self.label}: {done}/{self.total} ({pct:.0f}%){took}",
            end=end,
            file=sys.stderr,
            flush=True,
        )
