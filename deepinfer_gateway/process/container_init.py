"""The init a container lacks, when this process is PID 1.

In a container started without an init (Kubernetes has no `--init`), the entrypoint is PID 1:
the kernel delivers it no signal it has not installed a handler for, and every orphaned
process of the container is re-parented to it, to stay a zombie unless PID 1 waits for it.
The gateway's own code waits only for its own children. So as PID 1 the command forks: the
parent stays a minimal init (as tini does) that forwards stop signals to the child, reaps
every process that ends, and exits with the child's status; the child runs the command.
Anywhere else (an init present, a shell, a test) nothing changes.
"""

from __future__ import annotations

import os
import signal

FORWARDED = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                       signal.SIGUSR2, signal.SIGWINCH})
WATCHED = FORWARDED | {signal.SIGCHLD}


def become_init_if_pid1() -> int | None:
    """As PID 1: fork; the child returns None and goes on as the command, the parent returns
    the child's exit status once the child has ended. Not PID 1: None at once."""
    if os.getpid() != 1:
        return None
    # Blocked from before the fork: a signal that arrives before the parent waits is kept
    # pending, not lost (and blocked, PID 1 gets signals it has no handler for).
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)
    child = os.fork()
    if child == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        return None
    return supervise(child)


def supervise(child: int) -> int:
    """Forward stop signals to `child`, reap every process that ends; the child's status."""
    while True:
        info = signal.sigwaitinfo(WATCHED)
        if info.si_signo != signal.SIGCHLD:
            try:
                os.kill(child, info.si_signo)
            except ProcessLookupError:
                pass  # already gone: its SIGCHLD is pending
            continue
        status = reap(child)
        if status is not None:
            return status


def reap(child: int) -> int | None:
    """Wait for every process that has ended; `child`'s exit status (128 + signal when a
    signal ended it) once it is among them."""
    status = None
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # no child left at all
            return status if status is not None else 0
        if pid == 0:
            return status
        if pid == child:
            code = os.waitstatus_to_exitcode(wait_status)
            status = code if code >= 0 else 128 - code
