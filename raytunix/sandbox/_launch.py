"""The first process of every sandboxed run: sets its limits, drops to the run's user,
then becomes the command (``execvp``). Also the sweeper that kills every process of a
sandbox user.

Run as ``python -I -S -c <this file's text> <spec JSON> [argv...]``, never imported:
the sandbox's caller may have threads, and limits or a user switch set between ``fork``
and ``exec`` in such a process can deadlock (Python's ``preexec_fn`` warning). A fresh
interpreter has one thread. Only the standard library, and nothing from raytunix, so it
runs wherever that interpreter can.

Spec keys:
  rlimits: [[name, soft, hard], ...] set with ``resource.setrlimit`` (name as in
    ``resource``, e.g. "RLIMIT_AS").
  nproc: the process limit, or null to leave it.
  nproc_on_top: add the processes the run's user already has to ``nproc``:
    ``RLIMIT_NPROC`` counts every process of the user, zombies of earlier runs not yet
    reaped by the host's init included, and for a shared user all of its processes, so
    a bare limit could stop the run before it starts.
  uid, gid: switch to this user and group (after the limits; needs root), or null.
  sweep_uid: instead of running anything, switch to this user and SIGKILL all of its
    processes until none is left (``kill(-1)`` as that user reaches each of them in one
    pass that ``fork`` cannot race, so a fork bomb cannot outrun it). Prints how many
    live processes of the user it found (0: it killed nothing).
Exit status 127 with a message on stderr when the command cannot be started.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import time
import warnings  # noqa: F401 - os.execvp imports it, and after the user switch the
# standard library may be out of reach (root's home, for one, is closed to others)

_PR_SET_PDEATHSIG = 1


def _setrlimit(which, soft, hard):
    try:
        resource.setrlimit(which, (soft, hard))
    except ValueError:  # over this user's hard limit, which only root may raise: keep it
        cap = resource.getrlimit(which)[1]
        resource.setrlimit(which, (min(soft, cap), min(hard, cap)))


def _become(uid, gid):
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def _processes(uid, live_only):
    """Processes whose real (``live_only``: any) user id is ``uid``, this one excluded;
    ``live_only`` also leaves out zombies, which ``RLIMIT_NPROC`` still counts until they
    are reaped. (``kill(-1)`` cannot tell whether any is left: it succeeds whenever any
    other process exists.)"""
    me = str(os.getpid())
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or entry == me:
            continue
        try:
            with open("/proc/" + entry + "/status") as f:
                fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        except (OSError, ValueError):
            continue
        uids = fields.get("Uid", "").split()
        if live_only:
            if fields.get("State", "Z").split()[0] != "Z" and str(uid) in uids:
                count += 1
        elif uids[:1] == [str(uid)]:
            count += 1
    return count


def _sweep(uid):
    _become(uid, uid)
    sys.stdout.write("%d\n" % _processes(uid, live_only=True))
    sys.stdout.flush()
    deadline = time.monotonic() + 10.0
    while True:
        os.kill(-1, signal.SIGKILL)  # every process of this user but this one, atomically
        if not _processes(uid, live_only=True):
            return 0
        if time.monotonic() > deadline:
            sys.stderr.write("%d processes of user %d still alive\n"
                             % (_processes(uid, live_only=True), uid))
            return 1
        time.sleep(0.002)


def _main():
    spec = json.loads(sys.argv[1])
    argv = sys.argv[2:]
    if spec.get("sweep_uid") is not None:
        return _sweep(spec["sweep_uid"])
    for name, soft, hard in spec.get("rlimits", ()):
        _setrlimit(getattr(resource, name), soft, hard)
    nproc = spec.get("nproc")
    if nproc is not None:
        if spec.get("nproc_on_top"):
            uid = spec.get("uid")
            nproc += _processes(os.getuid() if uid is None else uid, live_only=False)
        _setrlimit(resource.RLIMIT_NPROC, nproc, nproc)
    if spec.get("uid") is not None:
        _become(spec["uid"], spec["gid"])
    # Die with the sandbox's process (set after the user switch, which clears it).
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # Python ignores these two; a command
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # expects the defaults
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        sys.stderr.write("sandbox: cannot run %r: %s\n" % (argv[0], e.strerror))
        return 127


sys.exit(_main())
