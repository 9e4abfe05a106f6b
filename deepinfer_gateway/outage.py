"""Degrade-don't-fail bookkeeping for optional shared state (Redis): count every failed
call, log once when an outage starts and once when it ends."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class Outage:
    def __init__(self, component: str, fallback: str, on_error: Callable[[], None] | None = None):
        self.component = component
        self.fallback = fallback  # what the component does meanwhile, for the log line
        self._on_error = on_error
        self.active = False

    def failed(self, exc: Exception) -> None:
        if self._on_error is not None:
            self._on_error()
        if not self.active:
            log.warning("%s: Redis unavailable (%s); %s until it returns", self.component, exc, self.fallback)
        self.active = True

    def ok(self) -> None:
        if self.active:
            log.info("%s: Redis is back", self.component)
        self.active = False
