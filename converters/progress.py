"""A dependency-free progress line for long conversions (stderr, redrawn in place)."""
from __future__ import annotations

import sys
import time
from typing import Callable


class ProgressBar:
    def __init__(self, enabled: bool = True, width: int = 30):
        self.enabled = enabled
        self.width = width
        self.started = time.perf_counter()
        self._last_draw = 0.0

    def stage(self, label: str) -> Callable[[int, int, str], None]:
        """A callback progress(done, total, item) that draws `label [####   ] done/total item`."""

        def update(done: int, total: int, item: str) -> None:
            now = time.perf_counter()
            if not self.enabled or (done < total and now - self._last_draw < 0.1):
                return
            self._last_draw = now
            filled = self.width * done // max(total, 1)
            bar = "#" * filled + " " * (self.width - filled)
            sys.stderr.write(f"\r{label:<22} [{bar}] {done}/{total} {now - self.started:6.1f}s {item[:28]:<28}")
            if done >= total:
                sys.stderr.write("\n")
            sys.stderr.flush()

        return update

    def done(self, message: str) -> None:
        if self.enabled:
            sys.stderr.write(f"{message}\n")
            sys.stderr.flush()
