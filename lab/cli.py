"""How a command ends: one line for a problem the user can fix, a traceback only for a bug.

`python -m <module>` runs inside `reported()`. A `UserError` (a bad setting, a model that is not
there, a refused secret, a peer that went away) prints `error: <what and what to do>` on stderr
and exits 2; Ctrl-C prints what was kept and how to go on, and exits 130. Anything else is a bug
and keeps its traceback. `HYDRA_FULL_ERROR=1` shows every traceback, user errors included.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


class UserError(Exception):
    """A problem the user can fix from its message alone: shown as one line, no traceback."""


class ConfigError(UserError, ValueError):
    """A setting out of range, of the wrong kind, or one the experiment does not read."""


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types a command reports as one line (netproto's own included)."""
    from netproto.errors import AuthenticationError, ListenError

    return (UserError, AuthenticationError, ListenError)


def full_errors() -> bool:
    """True when the user asked for every traceback (`HYDRA_FULL_ERROR=1`)."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


@contextlib.contextmanager
def reported(
    *, interrupted: str | Callable[[], str] = "interrupted; nothing of this run is kept"
) -> Iterator[None]:
    """Run a command's body: user errors become one line and exit 2, Ctrl-C prints
    `interrupted` (a function: what it returns then, so it can say what was really kept) and
    exits 130, bugs raise as they are."""
    if threading.current_thread() is threading.main_thread():
        # a command started as a shell's background job (`cmd &`, a script without job
        # control) inherits SIGINT ignored, and Python keeps it so: `kill -INT` would then do
        # nothing and the run would go on to its end. Ctrl-C's meaning holds however it started
        # (and the roles it launches inherit the default, not the ignore).
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if full_errors():
        yield
        return
    try:
        yield
    except user_errors() as exc:
        sys.stdout.flush()
        # one line, unless the error quotes a failed role's log: its lines follow
        print(f"error: {str(exc).strip() or type(exc).__name__}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None
    except KeyboardInterrupt:
        sys.stdout.flush()
        said = interrupted() if callable(interrupted) else interrupted
        print(f"\n{said}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
