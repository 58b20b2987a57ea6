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
  isolate: run the command in namespaces of its own, without bubblewrap (see
    ``_isolate``): {"user_ns": make a user namespace first (a host user other than root),
    "ro": [host paths bound read-only], "links": [[target, path], ...] symlinks,
    "workdir": the work dir (bound read-write at its own path), "tmp_bytes": size of the
    private /tmp and /dev/shm}. The launcher stays outside as the waiting parent; its
    child is the first process of a new PID namespace, so every process the command
    starts, in whatever session, dies with it.
  no_new_privs: set ``PR_SET_NO_NEW_PRIVS`` (no setuid gain through ``exec``).
Exit status 127 with a message on stderr when the command cannot be started, 126 when
its namespaces cannot be built (the message says which step failed).
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
_PR_SET_NO_NEW_PRIVS = 38
_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME, _MS_STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
_MNT_DETACH = 2
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_LIBC = ctypes.CDLL(None, use_errno=True)
# pivot_root has no libc wrapper; its syscall number by architecture.
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217, "riscv64": 41}.get(
    os.uname().machine
)


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
            sys.stderr.write(
                "%d processes of user %d still alive\n" % (_processes(uid, live_only=True), uid)
            )
            return 1
        time.sleep(0.002)


def _call(what, result):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, "%s: %s" % (what, os.strerror(err)))


def _enc(value):
    return None if value is None else value.encode()


def _mount(source, target, fstype, flags, data=None):
    _call(
        "mount %s on %s" % (source or fstype or "-", target),
        _LIBC.mount(_enc(source), _enc(target), _enc(fstype), ctypes.c_ulong(flags), _enc(data)),
    )


def _kept_flags(path):
    """The flags of the mount that holds ``path`` which a user namespace may not drop
    (``mount(2)``: EPERM on a remount that clears a locked flag)."""
    f = os.statvfs(path).f_flag
    flags = 0
    for st, ms in (
        (os.ST_NOSUID, _MS_NOSUID),
        (os.ST_NODEV, _MS_NODEV),
        (os.ST_NOEXEC, _MS_NOEXEC),
        (os.ST_RDONLY, _MS_RDONLY),
        (os.ST_NODIRATIME, _MS_NODIRATIME),
    ):
        if f & st:
            flags |= ms
    if f & os.ST_NOATIME:
        flags |= _MS_NOATIME
    elif f & os.ST_RELATIME:
        flags |= _MS_RELATIME
    else:
        flags |= _MS_STRICTATIME
    return flags


def _bind(source, target, read_only, extra=_MS_NOSUID | _MS_NODEV):
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    _mount(source, target, None, _MS_BIND | _MS_REC)
    flags = _kept_flags(target) | extra | (_MS_RDONLY if read_only else 0)
    _mount(None, target, None, _MS_BIND | _MS_REMOUNT | flags)


def _build_root(iso):
    """Runs as the first process of the new PID namespace, in the new mount namespace:
    builds a root of its own (what bubblewrap's ``--ro-bind``, ``--dev``, ``--proc``,
    ``--tmpfs /tmp`` and ``--bind`` make) on a tmpfs and moves into it with
    ``pivot_root``; the host's other files are then out of reach."""
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing propagates back to the host
    _mount("tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=1m")
    os.chdir("/tmp")
    os.mkdir("newroot")
    _mount("newroot", "newroot", None, _MS_BIND | _MS_REC)
    os.mkdir("oldroot")
    if _SYS_PIVOT_ROOT is None:
        raise OSError(0, "pivot_root: unknown syscall number on %s" % os.uname().machine)
    _call("pivot_root", _LIBC.syscall(_SYS_PIVOT_ROOT, b"/tmp", b"oldroot"))
    os.chdir("/")
    for target, path in iso["links"]:
        os.symlink(target, "/newroot" + path)
    for path in iso["ro"]:
        _bind("/oldroot" + path, "/newroot" + path, read_only=True)
    size = "size=%d" % iso["tmp_bytes"]
    os.mkdir("/newroot/dev")
    _mount("tmpfs", "/newroot/dev", "tmpfs", _MS_NOSUID | _MS_NOEXEC, "mode=0755,size=64k")
    for name in _DEVICES:
        if os.path.exists("/oldroot/dev/" + name):
            _bind("/oldroot/dev/" + name, "/newroot/dev/" + name, read_only=False, extra=_MS_NOSUID)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, "/newroot/dev/" + name)
    for path in ("/newroot/dev/shm", "/newroot/tmp"):
        os.makedirs(path, exist_ok=True)
        _mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=1777," + size)
    _bind("/oldroot" + iso["workdir"], "/newroot" + iso["workdir"], read_only=False)
    os.mkdir("/newroot/proc")
    _mount("proc", "/newroot/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    _mount(None, "/newroot", None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    _mount(None, "/oldroot", None, _MS_REC | _MS_PRIVATE)
    _call("umount /oldroot", _LIBC.umount2(b"/oldroot", _MNT_DETACH))
    os.chdir("/newroot")
    _call("pivot_root", _LIBC.syscall(_SYS_PIVOT_ROOT, b".", b"."))
    _call("umount the old root", _LIBC.umount2(b".", _MNT_DETACH))
    os.chdir("/")
    name = b"sandbox"
    _call("sethostname", _LIBC.sethostname(name, len(name)))
    os.chdir(iso["workdir"])


def _isolate(iso):
    """Moves into new user (if asked), mount, PID, network, IPC and UTS namespaces and
    forks; returns in the child (the new PID namespace's first process, in its own root),
    while this process waits for it and exits as it did (128 + N for signal N). When the
    child ends, the kernel kills every other process of its PID namespace."""
    uid, gid = os.getuid(), os.getgid()
    flags = _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS
    _call("unshare", _LIBC.unshare((_CLONE_NEWUSER if iso["user_ns"] else 0) | flags))
    if iso["user_ns"]:  # the same ids inside; no capability survives the command's exec
        for name, text in (
            ("setgroups", "deny"),
            ("uid_map", "%d %d 1" % (uid, uid)),
            ("gid_map", "%d %d 1" % (gid, gid)),
        ):
            with open("/proc/self/" + name, "w") as f:
                f.write(text)
    child = os.fork()
    if child:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        while True:
            try:
                _, status = os.waitpid(child, 0)
                break
            except ChildProcessError:
                os._exit(126)
        code = os.waitstatus_to_exitcode(status)
        os._exit(128 - code if code < 0 else code)
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _build_root(iso)


def _main():
    spec = json.loads(sys.argv[1])
    argv = sys.argv[2:]
    if spec.get("sweep_uid") is not None:
        return _sweep(spec["sweep_uid"])
    nproc = spec.get("nproc")
    if nproc is not None and spec.get("nproc_on_top"):
        # Counted on the host's /proc, before a PID namespace would hide the rest.
        uid = spec.get("uid")
        nproc += _processes(os.getuid() if uid is None else uid, live_only=False)
    if spec.get("isolate"):
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        try:
            _isolate(spec["isolate"])
        except OSError as e:
            sys.stderr.write("sandbox: cannot isolate the run: %s\n" % e)
            sys.stderr.flush()
            os._exit(126)
    for name, soft, hard in spec.get("rlimits", ()):
        _setrlimit(getattr(resource, name), soft, hard)
    if nproc is not None:
        _setrlimit(resource.RLIMIT_NPROC, nproc, nproc)
    if spec.get("uid") is not None:
        _become(spec["uid"], spec["gid"])
    # Die with the sandbox's process (set after the user switch, which clears it).
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if spec.get("no_new_privs"):
        _LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # Python ignores these two; a command
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # expects the defaults
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        sys.stderr.write("sandbox: cannot run %r: %s\n" % (argv[0], e.strerror))
        return 127


sys.exit(_main())
