"""A watchdog that takes down the local Ray cluster a driver started when the driver dies,
however it dies (``kill -9``, the OOM killer, a lost terminal).

``ray.init()`` without an address starts the cluster's processes (GCS server, raylet,
log monitor, dashboard and runtime-env agents, then one worker per actor) under the
driver. When the driver is SIGKILLed, the GCS server and the raylet die with it and the
workers follow their raylet, but on Ray 2.60 the dashboard and runtime-env agents first
try to report the raylet's death to the GCS server, which is gone too, and sit in that
call for its 60 s timeout. A run that is killed and resumed at once would share the host
with the old run's processes for that long.

    process = start_watchdog(context.address_info["session_dir"])   # after ray.init()

The watchdog is a process of its own (a thread would die with the driver). It holds the
read end of a pipe whose write end only the driver holds; the kernel closes that end when
the driver exits, so the watchdog sees end-of-file the moment the driver is gone. Until
then it notes, every ``interval_s``, the driver's descendants that belong to the Ray
session (those whose command line names the session directory, and everything below
them). At end-of-file it gives them ``grace_s`` seconds to exit, sends SIGTERM, then
SIGKILL to what is left, and exits. After a clean ``ray.shutdown()`` nothing is left and
it just exits.

It only ever signals processes it saw as the session's (psutil refuses a process whose
pid was reused), and it imports neither Ray nor JAX, so it starts in a fraction of a
second. Run as a script: ``python -P watchdog.py --driver-pid PID --session-dir DIR``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

import psutil

_started: list[subprocess.Popen] = []  # keeps the pipe's write end open while the driver lives


def start_watchdog(
    session_dir: str, grace_s: float = 2.0, interval_s: float = 0.5
) -> subprocess.Popen:
    """Starts the watchdog for this process (the driver) and the Ray session whose
    directory is ``session_dir``; returns its process.

    Args:
      session_dir: the session's directory (``ray.init(...).address_info["session_dir"]``).
      grace_s: seconds the session's processes get to exit on their own after the driver
        died, before SIGTERM (and SIGKILL one second later).
      interval_s: seconds between two looks at the driver's process tree.

    Raises:
      ValueError: ``session_dir`` is empty, or a time is not positive.
    """
    if not session_dir:
        raise ValueError("start_watchdog needs the Ray session directory; got an empty one")
    if not (grace_s > 0 and interval_s > 0):
        raise ValueError(f"grace_s={grace_s!r} and interval_s={interval_s!r} must be > 0 s")
    process = subprocess.Popen(
        # -P: this file's directory (raytunix/, which holds a types.py) stays off sys.path.
        [
            sys.executable,
            "-P",
            os.path.abspath(__file__),
            "--driver-pid",
            str(os.getpid()),
            "--session-dir",
            session_dir,
            "--grace-s",
            str(grace_s),
            "--interval-s",
            str(interval_s),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )  # Ctrl-C in the terminal is the driver's to handle
    _started.append(process)
    return process


def _session_tree(driver: psutil.Process, session_dir: str) -> dict[int, psutil.Process]:
    """The driver's descendants that belong to the session, by pid (this process left out)."""
    found: dict[int, psutil.Process] = {}
    try:
        children = driver.children(recursive=False)
    except psutil.Error:
        return found
    for child in children:
        try:
            if child.pid == os.getpid() or session_dir not in " ".join(child.cmdline()):
                continue
            found[child.pid] = child
            for below in child.children(recursive=True):
                found[below.pid] = below
        except psutil.Error:  # exited while we looked
            continue
    return found


def _still_running(processes) -> list[psutil.Process]:
    alive = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.Error:
            pass
    return alive


def watch(driver_pid: int, session_dir: str, grace_s: float, interval_s: float) -> int:
    """Runs until the driver is gone (stdin closes), then ends the session's processes;
    returns how many it had to signal."""
    driver = psutil.Process(driver_pid)
    known: dict[int, psutil.Process] = {}
    driver_gone = threading.Event()

    def wait_for_eof() -> None:
        while sys.stdin.buffer.read(4096):
            pass
        driver_gone.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    while not driver_gone.wait(interval_s):
        known.update(_session_tree(driver, session_dir))
        known = {pid: p for pid, p in known.items() if _still_running([p])}
    # What started since the last look: children of processes we know (new workers).
    for p in _still_running(list(known.values())):
        try:
            known.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.Error:
            pass
    targets = _still_running(known.values())
    if not targets:
        return 0
    alive = _wait_exit(targets, grace_s)
    for signal_name in ("terminate", "kill"):
        for p in alive:
            try:
                getattr(p, signal_name)()
            except psutil.Error:
                pass
        alive = _wait_exit(alive, 1.0)
        if not alive:
            break
    print(
        f"raytunix watchdog: the driver (pid {driver_pid}) is gone; ended the "
        f"{len(targets)} process(es) of its Ray session {session_dir} that outlived it"
        + (f" ({len(alive)} would not stop)" if alive else "")
        + ".",
        file=sys.stderr,
        flush=True,
    )
    return len(targets)


def _wait_exit(processes, timeout_s: float) -> list[psutil.Process]:
    """Waits up to ``timeout_s`` for ``processes`` to exit; returns those still running.
    A zombie counts as exited: the orphans' new parent may never reap them."""
    deadline = time.monotonic() + timeout_s
    alive = _still_running(processes)
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = _still_running(alive)
    return alive


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--driver-pid", type=int, required=True)
    parser.add_argument("--session-dir", required=True)
    parser.add_argument("--grace-s", type=float, default=2.0)
    parser.add_argument("--interval-s", type=float, default=0.5)
    args = parser.parse_args(argv)
    try:
        watch(args.driver_pid, args.session_dir, args.grace_s, args.interval_s)
    except psutil.NoSuchProcess:  # the driver was gone before we looked: nothing to guard
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
