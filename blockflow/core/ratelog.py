"""Log lines that hostile input can trigger, bounded: at most ``burst`` lines per ``window``
seconds per limiter, then one line saying how many were suppressed.

A flood of forged messages must not become a flood of log lines (issue 12: one attacker wrote
334,047 lines). Used where a message from outside the deployment makes a process log.
"""
from __future__ import annotations

import logging
import time


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, burst: int = 10, window: float = 10.0):
        self.logger, self.burst, self.window = logger, burst, window
        self._start = time.monotonic()
        self._count = 0
        self._suppressed = 0

    def log(self, level: int, msg: str, *args, exc_info=False) -> None:
        now = time.monotonic()
        if now - self._start >= self.window:
            if self._suppressed:
                self.logger.warning("%d similar messages suppressed in the last %.0f s", self._suppressed,
                                    now - self._start)
            self._start, self._count, self._suppressed = now, 0, 0
        if self._count < self.burst:
            self._count += 1
            self.logger.log(level, msg, *args, exc_info=exc_info)
        else:
            self._suppressed += 1

    def warning(self, msg: str, *args) -> None:
        self.log(logging.WARNING, msg, *args)

    def info(self, msg: str, *args) -> None:
        self.log(logging.INFO, msg, *args)

    def exception(self, msg: str, *args) -> None:
        self.log(logging.ERROR, msg, *args, exc_info=True)
