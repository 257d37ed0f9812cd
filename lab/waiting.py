"""A wait that speaks: what a process waits for, where, and for how long it will.

A process that waits in silence looks hung. Every wait of the lab that may last (a client
dialing its coordinator, a stage joining the RPC world, a run waiting for another process's
tiny-model build) says so within `FIRST_S` of starting to wait and every `EVERY_S` after:

    waiting for the coordinator at 127.0.0.1:29510 (cluster.connect_timeout_s=10 +
    fed.wait_clients_s=120): 3 s so far of 130 s

A poll loop calls `Wait.tick()` on each turn; a call that blocks (a file lock, torch's
rendezvous) runs inside `speaking(wait)`, whose thread ticks for it. The clock is injectable, so
a test moves time instead of sleeping.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

FIRST_S = 3.0
"""The first line comes this long after the wait began (a wait that ends sooner says nothing)."""
EVERY_S = 30.0
"""Then a line this often."""


class Wait:
    """One wait: what for, where, its limit and the config key that sets it.

    `progress`, when given, is asked for a short text on every line (another process's build
    at 40%, steps done): a wait on work shows how the work goes, not only that time passes.
    """

    def __init__(
        self,
        what: str,
        *,
        where: str = "",
        limit_s: float | None = None,
        key: str = "",
        progress: Callable[[], str] | None = None,
        say: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        first_s: float = FIRST_S,
        every_s: float = EVERY_S,
    ) -> None:
        self.what, self.where, self.limit_s, self.key = what, where, limit_s, key
        self.progress = progress
        self.say = say or (lambda line: log.info("%s", line))
        self.clock = clock
        self.first_s, self.every_s = first_s, every_s
        self.started = clock()
        self._next = self.started + first_s
        self.said = 0

    def line(self, now: float | None = None) -> str:
        """What the wait says at `now`: what, where, how long it may last, how long so far."""
        now = self.clock() if now is None else now
        text = f"waiting for {self.what}"
        if self.where:
            text += f" at {self.where}"
        if self.key:
            text += f" ({self.key})"
        text += f": {_seconds(now - self.started)} so far"
        if self.limit_s is not None:
            text += f" of {_seconds(self.limit_s)}"
        if self.progress is not None:
            shown = self.progress()
            if shown:
                text += f"; {shown}"
        return text

    def tick(self) -> bool:
        """Say the line if it is due (FIRST_S after the start, then every EVERY_S); True if said."""
        now = self.clock()
        if now < self._next:
            return False
        self.say(self.line(now))
        self.said += 1
        self._next = now + self.every_s
        return True


def _seconds(value: float) -> str:
    value = max(0.0, value)
    if value < 120:
        return f"{value:.0f} s"
    minutes, seconds = divmod(round(value), 60)
    return f"{minutes} min {seconds:02d} s"


@contextlib.contextmanager
def speaking(wait: Wait, *, poll_s: float = 1.0) -> Iterator[Wait]:
    """Tick `wait` from a thread of its own while the block runs (a call that blocks)."""
    done = threading.Event()

    def ticker() -> None:
        while not done.wait(poll_s):
            try:
                wait.tick()
            except Exception:  # a progress reader that fails must not end the wait
                log.debug("a wait's line failed", exc_info=True)

    thread = threading.Thread(target=ticker, name=f"wait: {wait.what}", daemon=True)
    thread.start()
    try:
        yield wait
    finally:
        done.set()
        thread.join(timeout=5)
