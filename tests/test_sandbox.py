"""The sandbox keeps a command in its work dir, off the network and inside its limits, and
reports what stopped it. Every test runs on both backends where bubblewrap works here
("auto" picks it) and on the subprocess fallback; properties only namespaces give are
checked where the backend gives them and skipped, with the reason, where it does not."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time

import pytest

from raytunix.sandbox import (
    IsolationLevel,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxLimit,
    SandboxLimits,
    WorkspaceLost,
)
from raytunix.sandbox import sandbox as sandbox_module

SANDBOX_UID = sandbox_module.SANDBOX_UID_BASE

# Small limits keep the bombs short and harmless to a shared 2-core machine. The deadline
# is roomy where a test is about another limit (a loaded machine may start a command
# slowly), and 1 s where the deadline is the point.
BOMB = SandboxLimits(
    wall_time_s=20.0,
    cpu_time_s=1.0,
    memory_bytes=64 << 20,
    max_processes=16,
    max_file_bytes=1 << 20,
    max_output_bytes=4096,
)
DEADLINE = dataclasses.replace(BOMB, wall_time_s=1.0)
FORK_BOMB = "import os\nwhile True:\n    os.fork()\n"
MEMORY_BOMB = "chunks = []\nwhile True:\n    chunks.append(bytearray(8 << 20))\n"


@pytest.fixture(scope="module", params=["auto", "subprocess"])
def sandbox(request):
    # Weak isolation allowed: these tests are about limits and reports, and check an
    # isolation property only where the backend gives it (``require``).
    with Sandbox(
        SandboxLimits(wall_time_s=20.0), backend=request.param, allow_weak_isolation=True
    ) as box:
        yield box


@pytest.fixture
def workspace(sandbox):
    ws = sandbox.open_workspace("test")
    yield ws
    sandbox.close_workspace(ws)


def require(sandbox, *levels: IsolationLevel, what: str) -> None:
    if sandbox.isolation not in levels:
        pytest.skip(
            f"{what} needs isolation {[level.value for level in levels]}; this "
            f"{sandbox.backend.value} sandbox gives {sandbox.isolation.value!r}"
            + (f" (bubblewrap: {sandbox.fallback_reason})" if sandbox.fallback_reason else "")
        )


def processes_in(path: str) -> list[int]:
    """Host pids whose working directory is ``path`` (bubblewrap's included)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/cwd").startswith(path):
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def python(code: str) -> list[str]:
    return ["python3", "-I", "-c", code]


def test_a_command_runs_with_its_stdin_and_reports_its_output_and_backend(sandbox, workspace):
    result = sandbox.run(
        workspace,
        ["sh", "-c", "cat; echo to-stderr >&2; exit 3"],
        stdin="from stdin\n",
        env={"GREETING": "hi"},
    )
    assert (result.exit_code, result.stdout, result.stderr) == (3, "from stdin\n", "to-stderr\n")
    assert result.killed_by_limit is None and result.limits_hit == () and not result.ok
    assert result.backend is sandbox.backend and result.isolation is sandbox.isolation
    assert (
        sandbox.run(workspace, ["sh", "-c", "echo $GREETING"], env={"GREETING": "hi"}).stdout
        == "hi\n"
    )


def test_the_callers_environment_is_not_passed_on(sandbox, workspace, monkeypatch):
    monkeypatch.setenv("RAYTUNIX_SECRET_TOKEN", "s3cret")
    result = sandbox.run(workspace, ["env"])
    assert "s3cret" not in result.stdout
    assert f"HOME={sandbox.workspace_path(workspace)}" in result.stdout.splitlines()


def test_files_persist_in_the_work_dir_until_it_is_closed(sandbox):
    ws = sandbox.open_workspace("persist")
    path = sandbox.workspace_path(ws)
    assert sandbox.run(ws, ["sh", "-c", "echo 42 > answer.txt && pwd"]).stdout == path + "\n"
    assert sandbox.run(ws, ["cat", "answer.txt"]).stdout == "42\n"
    sandbox.close_workspace(ws)
    assert not os.path.exists(path)
    with pytest.raises(WorkspaceLost, match="not open"):
        sandbox.run(ws, ["true"])
    sandbox.close_workspace(ws)  # twice is fine


def test_a_missing_command_exits_127(sandbox, workspace):
    result = sandbox.run(workspace, ["no-such-command-here"])
    assert result.exit_code == 127 and "no-such-command-here" in result.stderr


def test_cannot_reach_the_network(sandbox, workspace):
    require(sandbox, IsolationLevel.NAMESPACES, what="blocking the network")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        result = sandbox.run(
            workspace,
            python(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"),
        )
    finally:
        server.close()
    assert result.exit_code != 0
    assert "Connection refused" in result.stderr or "unreachable" in result.stderr


def test_cannot_write_to_the_system(sandbox, workspace):
    require(
        sandbox,
        IsolationLevel.NAMESPACES,
        IsolationLevel.USER,
        what="a read-only system for a root host",
    )
    for target in ("/usr/raytunix-sandbox-probe", "/etc/raytunix-sandbox-probe"):
        result = sandbox.run(workspace, ["sh", "-c", f"echo x > {target}"])
        assert result.exit_code != 0, target
        assert not os.path.exists(target)


def test_writes_outside_the_work_dir_never_reach_the_host(sandbox, workspace, tmp_path):
    require(sandbox, IsolationLevel.NAMESPACES, what="a private /tmp and hidden host dirs")
    host_file = tmp_path / "planted.txt"
    sandbox_root = os.path.dirname(sandbox.workspace_path(workspace))
    script = (
        f"echo x > /tmp/scratch.txt && cat /tmp/scratch.txt; "
        f"echo x > {host_file}; echo x > {sandbox_root}/../planted.txt; ls /root"
    )
    result = sandbox.run(workspace, ["sh", "-c", script])
    assert result.stdout == "x\n"  # its own /tmp works; the host paths are not there
    assert not host_file.exists()
    assert not os.path.exists(os.path.join(os.path.dirname(sandbox_root), "planted.txt"))
    assert not os.path.exists("/tmp/scratch.txt") or os.stat("/tmp/scratch.txt").st_size != 2


def test_cannot_read_another_episodes_files(sandbox):
    require(sandbox, IsolationLevel.NAMESPACES, IsolationLevel.USER, what="keeping episodes apart")
    mine, theirs = sandbox.open_workspace("mine"), sandbox.open_workspace("theirs")
    try:
        assert sandbox.run(theirs, ["sh", "-c", "echo secret-42 > secret.txt"]).ok
        secret = os.path.join(sandbox.workspace_path(theirs), "secret.txt")
        result = sandbox.run(mine, ["sh", "-c", f"cat {secret}; ls {os.path.dirname(secret)}"])
        assert "secret-42" not in result.stdout and "secret.txt" not in result.stdout
        assert result.exit_code != 0
    finally:
        sandbox.close_workspace(mine)
        sandbox.close_workspace(theirs)


def test_a_fork_bomb_is_contained_and_leaves_no_process(sandbox, workspace):
    result = sandbox.run(workspace, python(FORK_BOMB), limits=BOMB)
    assert result.killed_by_limit in (SandboxLimit.WALL_TIME, SandboxLimit.PROCESSES)
    assert SandboxLimit.PROCESSES in result.limits_hit  # forks failed against the limit
    assert processes_in(sandbox.workspace_path(workspace)) == []
    assert sandbox.run(workspace, ["echo", "still here"]).stdout == "still here\n"


def fork_count(pause_s: float = 0.0) -> list[str]:
    """Forks children that stay until it cannot fork any more, ``pause_s`` apart; prints
    how many it made."""
    return python(
        "import os, time\nn = 0\ntry:\n    for _ in range(40):\n"
        "        if os.fork() == 0:\n            time.sleep(10)\n            os._exit(0)\n"
        f"        n += 1\n        time.sleep({pause_s})\nexcept OSError:\n    pass\nprint(n)\n"
    )


def test_the_process_limit_holds(sandbox, workspace):
    result = sandbox.run(workspace, fork_count(), limits=BOMB)
    # 16 processes at most, the interpreter (and bubblewrap's two) included.
    assert 0 < int(result.stdout) < BOMB.max_processes
    assert processes_in(sandbox.workspace_path(workspace)) == []


def test_the_process_limit_holds_right_after_a_run_whose_processes_were_killed(sandbox, workspace):
    # The killed leftovers are zombies until the host's init reaps them (a second or two
    # on some hosts). Counted into the next run's limit and then reaped during it, they
    # had given it that many processes more (CI saw 19 forks under a limit of 16).
    leave = "import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n        time.sleep(60)\n"
    assert sandbox.run(workspace, python(leave), limits=BOMB).ok
    # Forks spread over 4 s, so that reaping lands while this run still forks.
    result = sandbox.run(workspace, fork_count(pause_s=0.1), limits=BOMB)
    assert 0 < int(result.stdout) < BOMB.max_processes


def test_the_process_limit_holds_right_after_many_short_runs(sandbox, workspace):
    # bubblewrap's own init outlived its outer process, and each run left it to the host's
    # init as a zombie for a second or two: 17 of them let a run fork 29 under 16.
    for _ in range(10):
        assert sandbox.run(workspace, ["true"], limits=BOMB).ok
    result = sandbox.run(workspace, fork_count(pause_s=0.1), limits=BOMB)
    assert 0 < int(result.stdout) < BOMB.max_processes


def test_a_run_whose_work_dir_is_closed_while_it_waits_to_start_raises_workspace_lost(
    sandbox, monkeypatch
):
    ws = sandbox.open_workspace("closing")
    if sandbox._workspaces[ws].uid is None:
        sandbox.close_workspace(ws)
        pytest.skip("only a work dir with a user id of its own waits for reaping")
    monkeypatch.setattr(
        sandbox_module, "_await_reaped", lambda uid, timeout_s: sandbox.close_workspace(ws)
    )
    monkeypatch.setattr(
        sandbox_module,
        "_KILLED_UIDS",  # as after a kill
        {sandbox._workspaces[ws].uid},
    )
    with pytest.raises(WorkspaceLost, match="was closed before this run started"):
        sandbox.run(ws, ["echo", "hi"])


def test_a_host_whose_init_never_reaps_costs_one_wait_and_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(sandbox_module, "_REAPING_STALLS", False)
    looks = []
    monkeypatch.setattr(sandbox_module, "_zombies", lambda uid: looks.append(uid) or 3)
    with caplog.at_level(logging.WARNING, logger=sandbox_module.__name__):
        sandbox_module._await_reaped(SANDBOX_UID, timeout_s=0.2)  # never reaped
        first = len(looks)
        sandbox_module._await_reaped(SANDBOX_UID, timeout_s=5.0)
    assert first > 1 and len(looks) == first  # the next run does not even look
    [warning] = [r.getMessage() for r in caplog.records if "not reaped" in r.getMessage()]
    assert "--init" in warning and "max_processes" in warning


def test_a_memory_bomb_is_contained(sandbox, workspace):
    result = sandbox.run(workspace, python(MEMORY_BOMB), limits=BOMB)
    assert result.killed_by_limit is SandboxLimit.MEMORY
    assert "MemoryError" in result.stderr
    assert sandbox.run(workspace, ["echo", "still here"]).stdout == "still here\n"


def test_an_infinite_loop_is_killed_at_the_wall_clock_deadline(sandbox, workspace):
    result = sandbox.run(workspace, ["sh", "-c", "while :; do :; done & sleep 60"], limits=DEADLINE)
    assert result.timed_out and result.killed_by_limit is SandboxLimit.WALL_TIME
    assert result.signal == 9 and result.exit_code == 137
    assert processes_in(sandbox.workspace_path(workspace)) == []


def test_a_busy_loop_is_stopped_by_its_cpu_limit(sandbox, workspace):
    limits = SandboxLimits(wall_time_s=120.0, cpu_time_s=1.0)  # CPU, not wall, time ends it
    result = sandbox.run(workspace, python("while True: pass"), limits=limits)
    assert result.killed_by_limit is SandboxLimit.CPU_TIME and not result.timed_out
    assert result.signal == 24  # SIGXCPU


def test_100_mb_of_output_is_cut_and_counted(sandbox, workspace):
    result = sandbox.run(workspace, ["head", "-c", "100000000", "/dev/zero"], limits=BOMB)
    assert result.exit_code == 0 and result.stdout_bytes == 100_000_000
    assert result.stdout_truncated and len(result.stdout) == BOMB.max_output_bytes
    assert result.limits_hit == (SandboxLimit.OUTPUT,) and result.killed_by_limit is None


def test_a_file_larger_than_the_limit_is_refused(sandbox, workspace):
    result = sandbox.run(
        workspace, ["sh", "-c", "head -c 3000000 /dev/zero > big.bin"], limits=BOMB
    )
    assert result.killed_by_limit is SandboxLimit.FILE_SIZE
    assert (
        os.path.getsize(os.path.join(sandbox.workspace_path(workspace), "big.bin"))
        <= BOMB.max_file_bytes
    )
    # Inside a longer command the shell goes on, and only its report tells of the limit.
    result = sandbox.run(
        workspace, ["sh", "-c", "head -c 3000000 /dev/zero > big.bin; echo on"], limits=BOMB
    )
    assert result.stdout == "on\n" and SandboxLimit.FILE_SIZE in result.limits_hit


def test_background_processes_end_with_the_command(sandbox, workspace):
    result = sandbox.run(workspace, ["sh", "-c", "sleep 30 & echo started"])
    assert result.stdout == "started\n" and not result.timed_out
    assert processes_in(sandbox.workspace_path(workspace)) == []


def test_closing_a_work_dir_kills_what_runs_in_it(sandbox):
    ws = sandbox.open_workspace("closing")
    path = sandbox.workspace_path(ws)
    results = []
    runner = threading.Thread(target=lambda: results.append(sandbox.run(ws, ["sleep", "30"])))
    runner.start()
    for _ in range(1200):
        if processes_in(path):
            break
        time.sleep(0.05)
    sandbox.close_workspace(ws)
    runner.join(timeout=20)
    assert not runner.is_alive() and results[0].exit_code != 0
    assert processes_in(path) == [] and not os.path.exists(path)


@pytest.mark.parametrize(
    "call, fragment",
    [
        (dict(argv=[]), "argv must be a non-empty list"),
        (dict(argv="ls -la"), "argv must be a non-empty list"),
        (dict(argv=["echo", "a\0b"]), "without NUL"),
        (dict(argv=["echo"], env={"BAD-NAME": "x"}), "not a valid variable name"),
        (dict(argv=["echo"], env={"X": 3}), "must be a string"),
        (dict(argv=["echo"], stdin=3), "stdin must be bytes or str"),
        (dict(argv=[""]), r"argv\[0\] is empty"),
        (dict(argv=["echo", "x" * 200_000]), "over the kernel's 131072-byte limit"),
        (dict(argv=["echo"], limits={"wall_time_s": 1}), "limits must be a SandboxLimits"),
    ],
)
def test_malformed_calls_are_refused_by_name(sandbox, workspace, call, fragment):
    kwargs = dict(call)
    with pytest.raises(ValueError, match=fragment):
        sandbox.run(workspace, kwargs.pop("argv"), **kwargs)


@pytest.mark.parametrize(
    "field, value",
    [
        ("wall_time_s", 0),
        ("cpu_time_s", float("inf")),
        ("memory_bytes", 1 << 20),
        ("max_processes", 0),
        ("max_output_bytes", 0),
        ("max_file_bytes", -1),
        ("wall_time_s", float("inf")),
        ("wall_time_s", "3"),
        ("max_processes", 2.5),
        ("max_processes", None),
        ("memory_bytes", 1 << 70),
        ("cpu_time_s", True),
    ],
)
def test_limits_out_of_range_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"SandboxLimits.{field}="):
        SandboxLimits(**{field: value})


def test_a_bad_backend_name_is_refused():
    with pytest.raises(ValueError, match="backend='docker' is not one of auto, bwrap, subprocess"):
        Sandbox(backend="docker")


def test_bwrap_asked_for_where_it_cannot_run_is_an_error(monkeypatch):
    monkeypatch.setattr(sandbox_module, "_PROBES", {})
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name: None)
    with pytest.raises(SandboxError, match="bwrap is not installed"):
        Sandbox(backend="bwrap")


def without_namespaces(monkeypatch) -> None:
    """As on a host where neither bubblewrap nor the launcher can make namespaces
    (bubblewrap missing, user namespaces off, no CAP_SYS_ADMIN): both probes failed."""
    root = os.geteuid() == 0
    monkeypatch.setattr(
        sandbox_module,
        "_PROBES",
        {
            sandbox_module._Mode(SandboxBackend.BWRAP, root): "bwrap is not installed",
            sandbox_module._Mode(
                SandboxBackend.SUBPROCESS, root, isolate=True
            ): "unshare: Operation not permitted",
        },
    )
    monkeypatch.setattr(sandbox_module, "_WARNED", set())


def test_a_host_that_cannot_isolate_refuses_untrusted_code_naming_what_is_missing(monkeypatch):
    without_namespaces(monkeypatch)
    for backend in ("auto", "subprocess"):
        with pytest.raises(SandboxError) as refused:
            Sandbox(backend=backend)
        message = str(refused.value)
        assert "network" in message and "allow_weak_isolation" in message
        assert "unshare: Operation not permitted" in message  # why the namespaces failed


def test_weak_isolation_when_allowed_is_reported_in_every_result_and_warned_about_once(
    monkeypatch, caplog
):
    without_namespaces(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="raytunix.sandbox.sandbox"):
        boxes = [Sandbox(backend="subprocess", allow_weak_isolation=True) for _ in range(2)]
    warnings = [r for r in caplog.records if "allow_weak_isolation" in r.getMessage()]
    assert len(warnings) == 1 and "network" in warnings[0].getMessage()
    result = boxes[0].run_once(["true"])
    assert result.backend is SandboxBackend.SUBPROCESS
    assert result.isolation is (IsolationLevel.USER if os.getuid() == 0 else IsolationLevel.PROCESS)
    for box in boxes:
        box.close()


def test_the_subprocess_backend_builds_its_own_namespaces_where_it_can():
    try:
        box = Sandbox(backend="subprocess")
    except SandboxError as e:
        pytest.skip(f"no namespaces can be made here: {e}")
    with box:
        result = box.run_once(["sh", "-c", "hostname; ls /"])
    assert box.isolation is IsolationLevel.NAMESPACES and result.isolation is box.isolation
    hostname, *top = result.stdout.split()
    assert hostname == "sandbox"  # its own UTS namespace
    # A root of its own: the system read-only, its /dev, /proc and /tmp; no /root, /home.
    assert {"usr", "etc", "dev", "proc", "tmp"} <= set(top)
    assert set(top) <= {
        "usr",
        "etc",
        "dev",
        "proc",
        "tmp",
        "bin",
        "sbin",
        "lib",
        "lib32",
        "lib64",
        "libx32",
    }, top


@pytest.mark.skipif(os.geteuid() != 0, reason="only a root host runs commands as other users")
def test_a_root_dir_closed_to_the_sandbox_users_is_refused(tmp_path):
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    with pytest.raises(SandboxError, match="closed to other users"):
        Sandbox(root_dir=str(closed / "work"))
