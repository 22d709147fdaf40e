"""Reading a child process's stderr in tests without blocking: waits for a
line stay bounded even when the child falls silent."""

from __future__ import annotations

import threading
import time


class Stderr:
    """The lines a child writes to stderr, read on a thread so waits stay bounded."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.lines.append("")  # EOF marker
            self._changed.notify_all()

    def count(self, needle: str) -> int:
        """The lines so far that contain needle."""
        with self._changed:
            return self._count(needle)

    def _count(self, needle: str) -> int:
        return sum(needle in line for line in self.lines)

    def wait_for(self, needle: str, timeout: float, after: int = 0) -> None:
        """Wait until more than `after` lines contain needle (or fail, with the lines)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._count(needle) <= after:
                if self.lines and self.lines[-1] == "":
                    raise AssertionError(f"exited before {needle!r}:\n{self.text()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {needle!r} within {timeout:.0f}s:\n{self.text()}")
                self._changed.wait(left)

    def text(self) -> str:
        return "".join(self.lines[-200:])
