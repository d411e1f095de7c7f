"""An error every restart would meet again ends the job instead of a restart loop.

torchrun's elastic agent restarts the workers whenever one fails, up to ``--max-restarts`` times,
whatever the cause: it cannot tell a rank killed by the OS (a restart helps) from a start-up
check that fails the same way on every attempt (a layout the survivors of a lost node cannot hold,
a checkpoint of another model). For the second kind every rank prints its message and then
:func:`end_restarts` stops the agent itself with SIGTERM, the signal a launcher uses to end a job:
the agent stops its workers and exits non-zero without restarting them, and on a job of several
nodes every node's agent is ended by its own ranks, since the check fails the same everywhere.

Under this app's own launcher (``launch/train.py max_restarts=N``) the reason is also written to
``MALLEUS_DS_FATAL_FILE`` so the launcher's last line says why it did not restart.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

from .base import DistEnv

#: set by launch/train.py's launcher for its ranks: where a rank records why no restart helps
FATAL_FILE_ENV = "MALLEUS_DS_FATAL_FILE"

#: words in a parent's command line that mark it as an elastic agent
_AGENTS = ("torch.distributed.run", "torchrun", "torch/distributed/run.py", "deepspeed")


def agent_pid(ppid: int | None = None) -> int | None:
    """The elastic agent's pid: this process's parent, when its command line is torchrun's (or
    the deepspeed launcher's); None otherwise (never signal an unknown parent)."""
    ppid = os.getppid() if ppid is None else ppid
    try:
        cmd = Path(f"/proc/{ppid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return None
    return ppid if ppid > 1 and any(a in cmd for a in _AGENTS) else None


def record_fatal(message: str, path: str | None = None) -> None:
    """Write ``message`` to the launcher's fatal file (the first rank's message wins)."""
    path = os.environ.get(FATAL_FILE_ENV) if path is None else path
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(message.strip() + "\n")


def end_restarts(env: DistEnv, message: str, say) -> None:
    """After an error that every attempt would meet again (``message``): record it, and on the
    node's first rank stop the agent (module docstring). ``say(line)`` prints what is done,
    before the signal: the agent's SIGTERM to its workers may end this process right after."""
    if not env.restartable:
        return
    record_fatal(message)
    if env.local_rank != 0:
        return
    pid = agent_pid()
    if pid is None:
        say("[malleus_ds] this error recurs on every restart, but the parent process is not a "
            "torchrun agent this rank can stop: it may restart the job in vain")
        return
    say(f"[malleus_ds] this error recurs on every restart: stopping torchrun's agent (pid {pid}) "
        f"instead of letting it restart the job {env.max_restarts - env.restart} more time(s)")
    os.kill(pid, signal.SIGTERM)
