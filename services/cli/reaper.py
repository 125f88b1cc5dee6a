"""A watchdog process that removes a stack's temp dir however its launcher ends, SIGKILL included.

    launcher ── pipe: the write end is the launcher's alone ──▶ reaper (its stdin)
                "pid <n>" for each server process the launcher starts or restarts

The kernel closes the pipe when the launcher exits, whatever ended it, and not before: no other
process holds the write end (Python creates pipes non-inheritable and Popen closes every other
descriptor in the children). At end of file the reaper waits for the servers it was told of to
exit (PR_SET_PDEATHSIG sent them SIGTERM, or the launcher stopped them), SIGKILLs one still
running after ``_GRACE_S`` (the same process: its start time is checked, never a reused pid), then
removes the dirs it was given. A launcher that stops normally removes them itself and closes the
pipe; the reaper then finds nothing left to do.

The reaper runs in its own session, without a parent-death signal, and ignores SIGINT, SIGTERM and
SIGHUP: a terminal's Ctrl-C or hang-up reaches the launcher, which cleans up, while the reaper
stays to clean up after a launcher that could not. Only a SIGKILL of the reaper itself defeats
it; ``sweep_orphaned_dirs`` (run at every start) removes what such a stack left.

    python -m services.cli.reaper DIR...     (started by ``DirReaper``)
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

__all__ = ["STACK_DIR_PREFIX", "DirReaper", "make_stack_dir", "sweep_orphaned_dirs"]

# A stack's temp dir: <tmp>/llmserve-up-<launcher pid>-<random>, holding each server's own dir.
STACK_DIR_PREFIX = "llmserve-up-"
_GRACE_S = 10.0  # how long servers get to exit on their SIGTERM before SIGKILL


def make_stack_dir() -> str:
    """A new temp dir for one stack's servers, named after this (the launcher's) pid."""
    return tempfile.mkdtemp(prefix=f"{STACK_DIR_PREFIX}{os.getpid()}-")


def sweep_orphaned_dirs(tmp_dir: str | None = None) -> list[str]:
    """Remove stack dirs whose launcher no longer runs (only a stack whose reaper was SIGKILLed
    too leaves one). A dir whose pid is alive, or is not ours to remove, is left alone. Returns
    what was removed."""
    removed = []
    pattern = os.path.join(tmp_dir or tempfile.gettempdir(), f"{STACK_DIR_PREFIX}*")
    for path in glob.glob(pattern):
        pid_text = os.path.basename(path)[len(STACK_DIR_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit() or _exists(int(pid_text)) or not os.access(path, os.W_OK):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


class DirReaper:
    """The launcher's side: start the reaper for ``dirs``, tell it each server pid, close it."""

    def __init__(self, dirs: list[str]) -> None:
        self.dirs = list(dirs)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.cli.reaper", *self.dirs],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's signals reach the launcher, not the reaper
        )

    def watch(self, pid: int) -> None:
        """A server process whose exit the reaper waits for before removing the dirs."""
        stdin = self.process.stdin
        if stdin is None or stdin.closed:
            return
        with contextlib.suppress(BrokenPipeError, OSError):  # a dead reaper: nothing to tell
            stdin.write(f"pid {pid}\n".encode())
            stdin.flush()

    def close(self, timeout: float = 5.0) -> None:
        """Our own clean-up is done (or failed): the reaper does what is left, then exits."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            with contextlib.suppress(BrokenPipeError, OSError):
                self.process.stdin.close()
        # Past the timeout it still waits for a server slow to exit; it finishes on its own.
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), which tells it from a later process
    given the same pid; None if there is no such process (or it is a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_gone(watched: list[tuple[int, str]], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    while True:
        alive = [(pid, start) for pid, start in watched if _start_time(pid) == start]
        if not alive:
            return
        if time.monotonic() > deadline:
            for pid, _ in alive:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    watched: list[tuple[int, str]] = []
    for line in sys.stdin.buffer:  # until the launcher is gone
        parts = line.split()
        if len(parts) == 2 and parts[0] == b"pid" and parts[1].isdigit():
            start = _start_time(int(parts[1]))
            if start is not None:
                watched.append((int(parts[1]), start))
    _wait_gone(watched, _GRACE_S)
    if not any(os.path.exists(path) for path in argv):
        return 0  # the launcher cleaned up itself
    # Twice: a server the launcher was still starting (not yet told of) may write while it exits.
    for pause_s in (0.05, 1.0):
        time.sleep(pause_s)
        for path in argv:
            shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
