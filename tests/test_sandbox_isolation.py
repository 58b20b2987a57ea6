"""What the sandbox keeps from the code it runs, on every backend and host user it can
have: the host's secrets (a parent's environment, the host user's files, loopback
services), the host's files at cleanup (whatever links a command left), the disk (a
budget per work dir) and the processes a run starts (whatever session they move to).
Each test backs a row of the README's table ("Sandboxed tools").

Scenarios run in a fresh child process, so each probes the backends itself: with
bubblewrap on PATH ("bwrap") or without it ("fallback": the subprocess backend and the
namespaces its launcher builds), as the user running the tests and, when that is root,
as the unprivileged user ``nobody`` too (when it is not root, it is the unprivileged one).
"""

from __future__ import annotations

import json
import os
import pwd
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile

import pytest

import raytunix
from raytunix.sandbox import IsolationLevel, Sandbox, SandboxError, SandboxLimit, SandboxLimits
from raytunix.sandbox import sandbox as sandbox_module

ROOT = os.geteuid() == 0
PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(raytunix.__file__)))
try:
    NOBODY = pwd.getpwnam("nobody")
except KeyError:
    NOBODY = None

USERS = [pytest.param("root", marks=pytest.mark.skipif(not ROOT, reason="needs root")), "nobody"]
PATHS = [
    "fallback",
    pytest.param(
        "bwrap",
        marks=pytest.mark.skipif(
            shutil.which("bwrap") is None, reason="bubblewrap is not installed"
        ),
    ),
]


def _path(kind: str) -> str:
    path = os.environ.get("PATH") or os.defpath
    if kind == "bwrap":
        return path
    return os.pathsep.join(
        d for d in path.split(os.pathsep) if d and shutil.which("bwrap", path=d) is None
    )


def _uid(user: str) -> int:
    if user == "nobody" and ROOT:
        if NOBODY is None:
            pytest.skip("there is no user 'nobody' on this host")
        return NOBODY.pw_uid
    return os.getuid()


def _give(path: str, user: str) -> None:
    if ROOT and user == "nobody":
        os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)


_NOBODY_PYTHON: list = []


def _as_nobody() -> list[str]:
    """``setpriv`` to nobody and the first interpreter nobody can run that imports this
    raytunix; a skip where there is none."""
    setpriv = shutil.which("setpriv")
    if NOBODY is None:
        pytest.skip("there is no user 'nobody' on this host")
    if setpriv is None:
        pytest.skip("setpriv is not installed; it runs the scenarios as nobody")
    head = [setpriv, f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups"]
    if not _NOBODY_PYTHON:
        # It must also start itself again by its sys.executable, as the launcher does.
        check = (
            "import subprocess, sys, raytunix.sandbox, raytunix\n"
            "subprocess.run([sys.executable, '-I', '-S', '-c', 'pass'], check=True)\n"
            "print(raytunix.__file__)"
        )
        for python in dict.fromkeys(
            [
                sys.executable,
                os.path.realpath(sys.executable),
                "/usr/bin/python3",
                shutil.which("python3") or "",
            ]
        ):
            if not python:
                continue
            done = subprocess.run(
                head + [python, "-c", check],
                capture_output=True,
                text=True,
                env={"PYTHONPATH": PROJECT, "PATH": os.defpath},
                cwd="/",
            )
            if done.returncode == 0 and os.path.realpath(done.stdout.strip()) == os.path.realpath(
                raytunix.__file__
            ):
                _NOBODY_PYTHON.append(python)
                break
        else:
            _NOBODY_PYTHON.append(None)
    if _NOBODY_PYTHON[0] is None:
        pytest.skip(f"no interpreter that nobody can run imports raytunix from {PROJECT}")
    return head + [_NOBODY_PYTHON[0]]


def scenario(
    code: str,
    user: str,
    path_kind: str,
    env: dict | None = None,
    wrapper: list[str] | None = None,
    timeout: float = 300,
) -> dict:
    """Runs ``code`` (prints one ``RESULT:`` JSON line) in a child process as ``user``
    with the PATH of ``path_kind``; returns the JSON."""
    argv = _as_nobody() if user == "nobody" and ROOT else [sys.executable]
    environ = {
        "PATH": _path(path_kind),
        "PYTHONPATH": PROJECT,
        "LANG": "C.UTF-8",
        "HOME": "/nonexistent",
        "JAX_PLATFORMS": "cpu",
        "PYTHONDONTWRITEBYTECODE": "1",
        **(env or {}),
    }
    proc = subprocess.run(
        (wrapper or []) + argv + ["-c", code],
        env=environ,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT:"):
            out = json.loads(line[len("RESULT:") :])
            if path_kind == "bwrap" and out.get("backend") not in (None, "bwrap"):
                pytest.skip(f"bubblewrap does not work here: {out.get('why')}")
            return out
    raise AssertionError(
        f"no RESULT (rc {proc.returncode}): {proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )


@pytest.fixture
def scratch():
    """A directory under the system temp dir that nobody can traverse to."""
    path = tempfile.mkdtemp(prefix="raytunix-isolation-")
    os.chmod(path, 0o755)
    yield path
    sandbox_module._remove_tree(path)


def victim(directory: str, user: str, name: str = "victim.txt") -> str:
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write("shared with the team\n")
    os.chmod(path, 0o644)
    _give(path, user)
    return path


# -- cleanup never follows a link ------------------------------------------------------

CLEANUP = r'''
import json, os, stat
from raytunix.sandbox import Sandbox
sb = Sandbox(backend="auto", root_dir=os.environ["CASE_ROOT"])
ws = sb.open_workspace("t")
r = sb.run(ws, ["sh", "-c", os.environ["CASE_COMMAND"]])
sb.close_workspace(ws)
print("RESULT:" + json.dumps({"backend": sb.backend.value, "why": sb.fallback_reason,
                              "exit_code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr}))
sb.close()
'''


@pytest.mark.parametrize("user", USERS)
@pytest.mark.parametrize("path_kind", PATHS)
def test_closing_a_work_dir_leaves_a_symlinked_host_file_alone(scratch, user, path_kind):
    base = os.path.join(scratch, "home")
    os.mkdir(base)
    _give(base, user)
    target = victim(base, user)
    command = f"mkdir t && ln -s {target} t/l && chmod 555 t && ls -l t"
    out = scenario(
        CLEANUP,
        user,
        path_kind,
        env={"CASE_ROOT": os.path.join(base, "sb"), "CASE_COMMAND": command},
    )
    assert out["exit_code"] == 0 and "l -> " in out["stdout"], out
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o644


@pytest.mark.parametrize("user", USERS)
def test_removing_a_tree_changes_nothing_that_its_links_reach(scratch, user):
    """What a command could leave (hard links to host files, symlinks to files and to
    directories, directories closed to their owner), removed by the host user."""
    outside = os.path.join(scratch, "outside")
    os.mkdir(outside)
    _give(outside, user)
    target = victim(outside, user)
    home = os.path.join(scratch, "home")
    os.mkdir(home)
    _give(home, user)
    tree = os.path.join(home, "tree")
    os.mkdir(tree)
    _give(tree, user)
    build = (
        f"cd {shlex.quote(tree)} && mkdir -p d/e && ln {target} d/hard && "
        f"ln -s {target} d/soft && ln -s {outside} d/dirlink && ln -s {outside} e && "
        "chmod 0 d/e && chmod 555 d"
    )
    code = (
        "import json, os, subprocess; from raytunix.sandbox.sandbox import _remove_tree\n"
        f"subprocess.run(['sh', '-c', {build!r}], check=True)\n"
        f"_remove_tree({tree!r})\n"
        f"print('RESULT:' + json.dumps({{'gone': not os.path.lexists({tree!r})}}))\n"
    )
    out = scenario(code, user, "bwrap")
    st = os.stat(target)
    assert out["gone"]
    assert (stat.S_IMODE(st.st_mode), st.st_nlink, st.st_uid) == (0o644, 1, _uid(user))
    assert sorted(os.listdir(outside)) == ["victim.txt"]
    assert stat.S_IMODE(os.stat(outside).st_mode) == 0o755


def test_a_root_dir_that_is_a_link_or_someone_elses_is_refused(scratch):
    link = os.path.join(scratch, "link")
    os.symlink(scratch, link)
    with pytest.raises(SandboxError, match="is a symbolic link"):
        Sandbox(root_dir=link)
    shared = os.path.join(scratch, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o777)
    with pytest.raises(SandboxError, match="no one else can write"):
        Sandbox(root_dir=shared)
    if ROOT and NOBODY is not None:
        planted = os.path.join(scratch, "planted")
        os.mkdir(planted, 0o755)
        os.chown(planted, NOBODY.pw_uid, NOBODY.pw_gid)
        with pytest.raises(SandboxError, match=f"owned by uid {NOBODY.pw_uid}"):
            Sandbox(root_dir=planted)


# -- secrets, host files and loopback are out of reach ---------------------------------

SECRETS = r'''
import json, os, socket
from raytunix.sandbox import Sandbox, SandboxError
listener = socket.socket(); listener.bind(("127.0.0.1", 0)); listener.listen(8)
try:
    sb = Sandbox(backend="auto", root_dir=os.environ["CASE_ROOT"])
except SandboxError as e:
    print("RESULT:" + json.dumps({"refused": str(e)})); raise SystemExit
probe = """
import json, os, socket
r = {}
def attempt(key, fn):
    try:
        r[key] = fn()
    except OSError as e:
        r[key] = None
attempt("parent_environ", lambda: open("/proc/%d/environ" % os.getppid(), "rb").read().decode(errors="replace"))
attempt("init_environ", lambda: open("/proc/1/environ", "rb").read().decode(errors="replace"))
attempt("token", lambda: open(TOKEN).read())
attempt("loopback", lambda: socket.create_connection(("127.0.0.1", PORT), 2).close() or "connected")
attempt("pids", lambda: sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
attempt("home", lambda: os.listdir(os.path.dirname(TOKEN)))
print(json.dumps(r))
""".replace("TOKEN", repr(os.environ["CASE_TOKEN"])).replace("PORT", str(listener.getsockname()[1]))
result = sb.run_once(["python3", "-I", "-c", probe])
seen = json.loads(result.stdout.strip().splitlines()[-1]) if result.stdout.strip() else {"error": result.stderr}
print("RESULT:" + json.dumps({"backend": sb.backend.value, "isolation": sb.isolation.value,
                              "why": sb.fallback_reason, "seen": seen, "me": os.getpid()}))
sb.close()
'''


@pytest.fixture(scope="module")
def secrets_seen():
    cache = {}

    def get(user, path_kind):
        if (user, path_kind) not in cache:
            base = tempfile.mkdtemp(prefix="raytunix-isolation-secrets-")
            os.chmod(base, 0o755)
            _give(base, user)
            os.mkdir(os.path.join(base, ".ray"), 0o700)
            _give(os.path.join(base, ".ray"), user)
            token = os.path.join(base, ".ray", "auth_token")
            with open(token, "w") as f:
                f.write("ray-cluster-token-0xC0FFEE")
            os.chmod(token, 0o600)
            _give(token, user)
            try:
                cache[user, path_kind] = scenario(
                    SECRETS,
                    user,
                    path_kind,
                    env={
                        "CASE_ROOT": os.path.join(base, "sb"),
                        "CASE_TOKEN": token,
                        "HF_TOKEN": "hf_sekrit_from_the_job_env",
                        "HOME": base,
                    },
                )
            finally:
                sandbox_module._remove_tree(base)
        return cache[user, path_kind]

    return get


@pytest.mark.parametrize("user", USERS)
@pytest.mark.parametrize("path_kind", PATHS)
def test_secrets_files_and_loopback_are_out_of_reach_or_the_sandbox_refuses(
    secrets_seen, user, path_kind
):
    out = secrets_seen(user, path_kind)
    if "refused" in out:  # a host without namespaces: refused by default, naming the key
        assert "allow_weak_isolation" in out["refused"]
        return
    seen = out["seen"]
    assert "error" not in seen, out
    assert out["isolation"] == IsolationLevel.NAMESPACES.value
    assert "hf_sekrit" not in (seen["parent_environ"] or "")
    assert "hf_sekrit" not in (seen["init_environ"] or "")
    assert seen["token"] is None and seen["home"] is None
    assert seen["loopback"] is None


@pytest.mark.parametrize("user", USERS)
@pytest.mark.parametrize("path_kind", PATHS)
def test_the_host_processes_are_not_visible(secrets_seen, user, path_kind):
    out = secrets_seen(user, path_kind)
    if "refused" in out:
        pytest.skip("this host cannot isolate; the sandbox refused")
    pids = out["seen"]["pids"]
    # Its own PID namespace: its init, the interpreter and little else; not the host's.
    assert pids and max(pids) < 10, pids


def test_a_run_cannot_write_to_the_hosts_shared_temp_dirs(tmp_path):
    with Sandbox(backend="subprocess") as box:
        if box.isolation is not IsolationLevel.NAMESPACES:
            pytest.skip(f"needs namespaces; this host gives {box.isolation.value}")
        marker = f"raytunix-isolation-{os.getpid()}"
        result = box.run_once(
            [
                "sh",
                "-c",
                f"echo x > /tmp/{marker} && echo x > /dev/shm/{marker} && cat /tmp/{marker}",
            ]
        )
    assert result.ok and result.stdout == "x\n"
    assert not os.path.exists(f"/tmp/{marker}") and not os.path.exists(f"/dev/shm/{marker}")


# -- a disk budget per work dir --------------------------------------------------------

BOMB = r'''
import dataclasses, json, os
from raytunix.sandbox import Sandbox, SandboxLimits
fs = os.environ["CASE_FS"]
def free():
    st = os.statvfs(fs); return st.f_bavail * st.f_frsize
limits = SandboxLimits(wall_time_s=60.0, cpu_time_s=60.0, max_workdir_bytes=128 << 20)
sb = Sandbox(limits, backend="auto", root_dir=os.path.join(fs, "sandbox"))
ws = sb.open_workspace("bomb")
bomb = ("import os\nn = 0\ntry:\n    for i in range(24):\n"
        "        open('f%d' % i, 'wb').write(b'0' * (60 << 20)); n += 1\n"
        "except OSError as e:\n    print('stopped after', n, 'files:', e)\n")
r = sb.run(ws, ["python3", "-I", "-c", bomb])
free_after_run = free()
import jax, jax.numpy as jnp
from raytunix.learner.checkpoint import Checkpointer
from raytunix.learner.train_state import TrainState
state = TrainState(params={"w": jnp.zeros((4 << 20,), jnp.float32)}, opt_state={},
                   step=jnp.asarray(1, jnp.int32), rng=jax.random.key_data(jax.random.key(0)))
ck = Checkpointer(os.path.join(fs, "runs", "checkpoints"))
ck.save(1, state, {"step": 1}); ck.wait_until_finished()
sb.close_workspace(ws)
print("RESULT:" + json.dumps({"backend": sb.backend.value, "why": sb.fallback_reason,
    "size": os.statvfs(fs).f_blocks * os.statvfs(fs).f_frsize, "free_after_run": free_after_run,
    "stdout": r.stdout, "limits_hit": [x.value for x in r.limits_hit], "steps": ck.all_steps()}))
sb.close()
'''


def _private_tmpfs(fs: str) -> list[str]:
    unshare, mount = shutil.which("unshare"), shutil.which("mount")
    if not (ROOT and unshare and mount):
        pytest.skip("mounting a tmpfs in a private mount namespace needs root, unshare, mount")
    return [
        unshare,
        "-m",
        "--propagation",
        "private",
        "--",
        shutil.which("sh"),
        "-c",
        f'{shlex.quote(mount)} -t tmpfs -o size=1g raytunix-isolation "$0" && exec "$@"',
        fs,
    ]


@pytest.mark.slow
@pytest.mark.parametrize("path_kind", PATHS)
def test_one_run_cannot_fill_the_file_system_of_the_work_dirs(scratch, path_kind):
    out = scenario(
        BOMB,
        "root",
        path_kind,
        env={"CASE_FS": scratch},
        wrapper=_private_tmpfs(scratch),
        timeout=400,
    )
    assert out["size"] == 1 << 30, out  # it ran on the 1 GiB tmpfs
    assert out["free_after_run"] >= out["size"] // 2, out
    assert "stopped after 2 files" in out["stdout"] and "disk" in out["limits_hit"], out
    assert out["steps"] == [1], out  # the learner's checkpoint beside it is written


@pytest.fixture(scope="module")
def budgeted():
    if not ROOT:
        pytest.skip("the disk budget is enforced where the sandbox runs as root")
    with Sandbox(SandboxLimits(max_workdir_bytes=4 << 20), backend="auto") as box:
        yield box


def test_a_full_disk_budget_fails_that_command_as_a_limit_hit(budgeted):
    ws = budgeted.open_workspace("budget")
    try:
        first = budgeted.run(ws, ["sh", "-c", "head -c 3000000 /dev/zero > a"])
        assert first.ok and first.limits_hit == ()
        # The budget is of the work dir, across runs: 3 MB more does not fit in 4 MiB.
        second = budgeted.run(ws, ["sh", "-c", "head -c 3000000 /dev/zero > b"])
        assert second.killed_by_limit is SandboxLimit.DISK and "No space left" in second.stderr
        # Freeing space makes room again; the work dir keeps serving.
        third = budgeted.run(ws, ["sh", "-c", "rm a b && head -c 3000000 /dev/zero > c && echo ok"])
        assert third.ok and third.stdout == "ok\n"
    finally:
        budgeted.close_workspace(ws)


def test_many_empty_files_hit_the_budget_too(budgeted):
    ws = budgeted.open_workspace("inodes")
    try:
        result = budgeted.run(
            ws,
            python_code("import os\nfor i in range(100000):\n    open('f%d' % i, 'w').close()\n"),
        )
        assert result.killed_by_limit is SandboxLimit.DISK, result
        assert len(os.listdir(budgeted.workspace_path(ws))) < 10000
    finally:
        budgeted.close_workspace(ws)


def test_a_sandbox_that_cannot_enforce_the_budget_says_so_at_start(scratch):
    code = (
        "import json, os; from raytunix.sandbox import Sandbox\n"
        f"sb = Sandbox(root_dir={os.path.join(scratch, 'sb')!r}, allow_weak_isolation=True)\n"
        "print('RESULT:' + json.dumps({'missing': sb.disk_budget_missing, "
        "'all': list(sb.missing_guarantees)})); sb.close()\n"
    )
    _give(scratch, "nobody")
    out = scenario(code, "nobody", "bwrap")
    assert "root" in out["missing"] and any(m.startswith("disk budget") for m in out["all"])


def python_code(code: str) -> list[str]:
    return ["python3", "-I", "-c", code]


# -- processes that leave their session end with the run -------------------------------

ESCAPE = r'''
import json, os, threading, time
from raytunix.sandbox import Sandbox
tag = os.environ["CASE_TAG"]
def alive():  # the two sleeps that left the run's session
    found = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and open("/proc/%s/cmdline" % p).read().startswith("sleep\0" + tag):
                found.append(int(p))
        except OSError:
            pass
    return found
sb = Sandbox(backend="auto", root_dir=os.environ["CASE_ROOT"])
ws = sb.open_workspace("escape")
# A new session, and a double fork whose middle process exits at once.
escape = ("setsid sh -c 'cd /; exec sleep %s1' </dev/null >/dev/null 2>&1 & "
          "(sh -c 'exec sleep %s2' </dev/null >/dev/null 2>&1 &) ; sleep 0.5; echo started" % (tag, tag))
r = sb.run(ws, ["sh", "-c", escape])
after_run = alive()
# A run still going when its work dir is closed.
late = []
t = threading.Thread(target=lambda: late.append(sb.run(ws, ["sh", "-c", escape + "; sleep 60"],
                                                       limits=sb.limits.__class__(wall_time_s=120.0))))
t.start()
deadline = time.monotonic() + 60
while len(alive()) < 2 and time.monotonic() < deadline and t.is_alive():
    time.sleep(0.05)
during = alive()
sb.close_workspace(ws)
t.join(60)
# The kills are sent by then; on a loaded machine one landed after close returned (a
# SIGKILLed process leaves /proc when the kernel has torn it down): a few seconds' grace.
deadline = time.monotonic() + 10
while alive() and time.monotonic() < deadline:
    time.sleep(0.05)
print("RESULT:" + json.dumps({"backend": sb.backend.value, "why": sb.fallback_reason,
    "stdout": r.stdout, "after_run": after_run, "during": during, "after_close": alive(),
    "late": [x.exit_code for x in late], "late_stderr": [x.stderr[-500:] for x in late]}))
sb.close()
'''


@pytest.mark.parametrize("user", USERS)
@pytest.mark.parametrize("path_kind", PATHS)
def test_processes_that_leave_their_session_end_with_the_run_and_the_work_dir(
    scratch, user, path_kind
):
    tag = f"{os.getpid() % 1000}.{len(user)}{len(path_kind)}"  # an argv no one else has
    base = os.path.join(scratch, "home")
    os.mkdir(base)
    _give(base, user)
    out = scenario(
        ESCAPE, user, path_kind, env={"CASE_ROOT": os.path.join(base, "sb"), "CASE_TAG": tag}
    )
    assert out["stdout"] == "started\n", out
    assert out["after_run"] == [], out
    assert len(out["during"]) == 2 and out["after_close"] == [], out


@pytest.mark.skipif(not ROOT, reason="a work dir has a user id of its own only as root")
def test_without_namespaces_a_root_host_still_kills_escaped_processes_by_user_id(monkeypatch):
    # As in a container without CAP_SYS_ADMIN: neither bubblewrap nor the launcher's
    # namespaces work, and weak isolation is accepted.
    monkeypatch.setattr(
        sandbox_module,
        "_PROBES",
        {
            sandbox_module._Mode(sandbox_module.SandboxBackend.BWRAP, True): "not here",
            sandbox_module._Mode(
                sandbox_module.SandboxBackend.SUBPROCESS, True, isolate=True
            ): "unshare: Operation not permitted",
        },
    )
    tag = f"{os.getpid() % 1000}.77"
    with Sandbox(backend="auto", allow_weak_isolation=True) as box:
        assert box.isolation is IsolationLevel.USER
        result = box.run_once(
            [
                "sh",
                "-c",
                f"setsid sh -c 'cd /; exec sleep {tag}1' </dev/null >/dev/null 2>&1 & echo started",
            ]
        )
    assert result.stdout == "started\n"
    left = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).find(tag) >= 0]
    assert left == []


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return ""
