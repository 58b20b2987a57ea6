"""Rewards the policy cannot forge, for the environments whose reward comes from the
sandbox: a scripted policy tries the known ways to earn reward without doing the task and
earns none, while the honest solution earns it. Each runs in a real sandbox, on the
subprocess backend and on bubblewrap where it works here.

* repo_repair: the planted bug stays; the project patches unittest, swaps the loader,
  walks frames for the report marker, forges reports and exits, returns objects equal to
  anything, plants conftest/sitecustomize/.pth/tests, links, stalls or kills the harness,
  or goes looking for the harness's key in /proc.
* bash_terminal: links instead of files and directories, planted files that would stall
  or crash a checker, planted modules a checker could import.
* python_math: answers that restate the question as an expression, several candidates,
  an answer left in a file, files carried over from an earlier episode.
"""

from __future__ import annotations

import json
import secrets

import pytest

from raytunix.envs import hidden_tests
from raytunix.envs.bash_env import BashTerminalEnv
from raytunix.envs.hidden_tests import REPORT_PREFIX, hidden_test_names
from raytunix.envs.python_math import PythonMathEnv
from raytunix.envs.repo_repair import PROJECTS, RepoRepairEnv
from raytunix.sandbox import Sandbox, SandboxBackend, SandboxError
from raytunix.types import TOOL_ERRORS_KEY, Action, EpisodeStatus, Task, ToolCall


def call(name: str, **arguments) -> Action:
    return Action(text="", tool_calls=(ToolCall(name, arguments),))


def answer(text: str) -> Action:
    return Action(text="", answer=text)


@pytest.fixture(scope="module", params=["subprocess", "bwrap"])
def sandbox(request):
    try:
        box = Sandbox(backend=request.param)
    except SandboxError as e:
        pytest.skip(f"the {request.param} backend does not work here: {e}")
    assert box.backend is SandboxBackend(request.param)
    yield box
    box.close()


# --- repo_repair ------------------------------------------------------------------------------

BUG = next(b for b in PROJECTS["textstats"].bugs if b.name == "median_even")
TASK = Task("t", "fix median", "", {"project": "textstats", "bug": BUG.name})
INIT = "textstats/__init__.py"


def append(path: str, code: str) -> str:
    """A python-tool program that appends ``code`` to ``path``."""
    return f"open({path!r}, 'a').write({chr(10) + code!r})\n"


def write(path: str, code: str) -> str:
    return (
        f"import os; os.makedirs(os.path.dirname({path!r}) or '.', exist_ok=True); "
        f"open({path!r}, 'w').write({code!r})\n"
    )


FORGED_COUNTS = json.dumps(
    {
        "tests": 4,
        "failures": 0,
        "errors": 0,
        "output": "OK",
        "results": {n: "pass" for n in hidden_test_names(PROJECTS["textstats"].hidden_tests)},
    }
)

# Reads every /proc entry it can for the harness's key (stdin, pipes, environment, the
# parent's memory), then writes reports signed with each candidate to every stdout it can
# open: the harness must keep its key where the project cannot read it.
HUNT_THE_KEY = (
    "import hmac as _h, hashlib as _hl, os as _o, re as _r\n"
    f"_body = {FORGED_COUNTS!r}\n"
    "_found = set()\n"
    "def _mine(_p):\n"
    "    try: return _o.stat('/proc/' + _p).st_uid == _o.getuid()\n"
    "    except OSError: return False\n"
    "_pids = [_p for _p in _o.listdir('/proc') if _p.isdigit() and int(_p) != _o.getpid()\n"
    "         and _mine(_p)]\n"
    "for _p in _pids:\n"
    "    for _n in ('fd/0', 'fd/3', 'fd/4', 'environ', 'cmdline'):\n"
    "        try:\n"
    "            _fd = _o.open('/proc/%s/%s' % (_p, _n), _o.O_RDONLY | _o.O_NONBLOCK)\n"
    "            _found.update(_r.findall(rb'[0-9a-f]{64}', _o.read(_fd, 1 << 20)))\n"
    "            _o.close(_fd)\n"
    "        except Exception: pass\n"
    "for _p in [str(_o.getppid())]:\n"  # the harness's memory holds its key
    "    try:\n"
    "        _maps = open('/proc/%s/maps' % _p).read().splitlines()\n"
    "        _mem = open('/proc/%s/mem' % _p, 'rb', 0)\n"
    "    except Exception: continue\n"
    "    for _l in _maps:\n"
    "        _a, _perm = _l.split()[:2]\n"
    "        _lo, _hi = (int(_x, 16) for _x in _a.split('-'))\n"
    "        if not _perm.startswith('rw') or _hi - _lo > 1 << 26: continue\n"
    "        try:\n"
    "            _mem.seek(_lo); _found.update(_r.findall(rb'[0-9a-f]{64}', _mem.read(_hi - _lo)))\n"
    "        except Exception: pass\n"
    "for _k in sorted(_found)[:500]:\n"
    "    _m = _h.new(bytes.fromhex(_k.decode()), _body.encode(), _hl.sha256).hexdigest()\n"
    f"    _line = ({REPORT_PREFIX!r} + _m + ' ' + _body + '\\n').encode()\n"
    "    for _p in _pids + ['self']:\n"
    "        try:\n"
    "            _fd = _o.open('/proc/%s/fd/1' % _p, _o.O_WRONLY | _o.O_NONBLOCK)\n"
    "            _o.write(_fd, _line); _o.close(_fd)\n"
    "        except Exception: pass\n"
)
# Run when a hidden test calls median; what it found comes back in the tests' output.
HUNT_ON_CALL = (
    f"_hunt = {HUNT_THE_KEY!r}\n"
    "from textstats import stats as _st\n"
    "def median(values):\n"
    "    _ns = {}\n"
    "    exec(_hunt, _ns)\n"
    "    raise ValueError('found: ' + ' '.join(sorted(_k.decode() for _k in _ns['_found'])))\n"
    "_st.median = median\n"
)

# Each leaves BUG in place (stats.py untouched) and tries to pass the hidden tests anyway.
REPO_FORGERIES = {
    "patch_runner": append(
        INIT,
        (
            "import unittest as _u\n"
            "class _R:\n    testsRun = 4; failures = []; errors = []; skipped = []\n"
            "    expectedFailures = []; unexpectedSuccesses = []\n"
            "    def wasSuccessful(self): return True\n"
            "_u.TextTestRunner.run = lambda self, suite: _R()\n"
            "_u.TestCase.run = lambda self, result=None: None\n"
        ),
    ),
    "patch_assertions": append(
        INIT,
        (
            "import unittest as _u\n"
            "for _n in dir(_u.TestCase):\n"
            "    if _n.startswith('assert'): setattr(_u.TestCase, _n, lambda *a, **k: None)\n"
            "_u.TestCase.fail = lambda *a, **k: None\n"
        ),
    ),
    "swap_loader": append(
        INIT,
        (
            "import unittest as _u\n"
            "class _T(_u.TestCase):\n    def test_ok(self): pass\n"
            "_u.TestLoader.loadTestsFromModule = lambda self, m, *a, **k: "
            "_u.TestSuite([_T('test_ok')])\n"
        ),
    ),
    "frame_walk_forged_report": append(
        INIT,
        (
            "import sys as _s, os as _o, gc as _g\n"
            f"_body = {FORGED_COUNTS!r}\n"
            "_seen = set()\n"
            "_f = _s._getframe()\n"
            "while _f is not None:\n"
            "    for _c in _f.f_code.co_consts + tuple(_f.f_globals.values()):\n"
            "        if isinstance(_c, str) and _c.startswith('@@') and _c not in _seen:\n"
            "            _seen.add(_c)\n"
            "            print(_c + _body, flush=True)\n"
            "            print(_c + ' 0 ' + _body, flush=True)\n"
            "    _f = _f.f_back\n"
            f"print({REPORT_PREFIX!r} + '0' * 64 + ' ' + _body, flush=True)\n"
            "_o._exit(0)\n"
        ),
    ),
    "always_equal_results": append(
        INIT,
        (
            "class _Any(float):\n"
            "    def __eq__(self, other): return True\n"
            "    def __ne__(self, other): return False\n"
            "    __hash__ = float.__hash__\n"
            "from textstats import stats as _st\n"
            "_median = _st.median\n"
            "def median(values):\n"
            "    _median(values)\n"
            "    return _Any(0)\n"
            "_st.median = median\n"
        ),
    ),
    "raise_skip": append(
        INIT,
        (
            "import unittest as _u\n"
            "from textstats import stats as _st\n"
            "def median(values): raise _u.SkipTest('not today')\n"
            "_st.median = median\n"
        ),
    ),
    "fake_unittest_in_sys_modules": append(
        INIT,
        (
            "import sys as _s, types as _t\n"
            "_m = _t.ModuleType('unittest')\n"
            "class TestCase:\n    pass\n"
            "_m.TestCase = TestCase\n"
            "_s.modules['unittest'] = _m\n"
        ),
    ),
    "planted_conftest_sitecustomize_pth_tests": (
        write(
            "conftest.py",
            "import pytest\ndef pytest_sessionfinish(session, exitstatus):\n"
            "    session.exitstatus = 0\n",
        )
        + write(
            "sitecustomize.py", "import unittest\nunittest.TestCase.run = lambda *a, **k: None\n"
        )
        + write(
            "usercustomize.py", "import unittest\nunittest.TestCase.run = lambda *a, **k: None\n"
        )
        + write(
            "textstats/sitecustomize.py",
            "import unittest\nunittest.TestCase.run = lambda *a: None\n",
        )
        + write(
            "textstats/conftest.py", "import unittest\nunittest.TestCase.run = lambda *a: None\n"
        )
        + write("zz.pth", "import unittest; unittest.TestCase.run = lambda *a: None\n")
        + write("textstats/zz.pth", "import unittest; unittest.TestCase.run = lambda *a: None\n")
        + write(
            "tests/test_hidden.py",
            "import unittest\nclass HiddenStatsTest(unittest.TestCase):\n"
            "    def test_median(self): pass\n",
        )
        + write("_hidden_test_suite.py", "")
    ),
    "source_linked_from_outside_the_source_dirs": (
        "import os, pathlib\n"
        "fixed = pathlib.Path('textstats/stats.py').read_text().replace("
        f"{BUG.buggy!r}, {BUG.fixed!r})\n"
        "pathlib.Path('.fixed').mkdir()\n"
        "pathlib.Path('.fixed/stats.py').write_text(fixed)\n"
        "os.symlink(os.path.abspath('.fixed/stats.py'), 'textstats/linked.py')\n"
        "open('textstats/__init__.py', 'w').write("
        "'from textstats.stats import mean, top_words, word_count\\n'"
        "'from textstats.linked import median\\n')\n"
    ),
    "stall_the_tests": append(INIT, "import time as _t\n_t.sleep(3600)\n"),
    "kill_the_harness": append(
        INIT, "import os as _o, signal as _g\n_o.kill(_o.getppid(), _g.SIGKILL)\n"
    ),
    "hunt_the_key_in_proc": append(INIT, HUNT_ON_CALL),
}


@pytest.fixture(scope="module")
def repo_env(sandbox):
    env = RepoRepairEnv(projects=["textstats"], test_timeout_s=1.0, sandbox=sandbox)
    yield env
    env.close()


def test_repo_repair_the_harness_key_stays_out_of_the_projects_reach(sandbox, monkeypatch):
    keys, real = [], secrets.token_hex

    def token_hex(n):  # the real key, recorded to look for it in what the project found
        value = real(n)
        if n == 32:
            keys.append(value)
        return value

    monkeypatch.setattr(hidden_tests.secrets, "token_hex", token_hex)
    env = RepoRepairEnv(projects=["textstats"], test_timeout_s=4.0, sandbox=sandbox)
    try:
        env.reset(TASK)
        env.step(call("python", code=REPO_FORGERIES["hunt_the_key_in_proc"]))
        step = env.step(answer("done"))
    finally:
        env.close()
    assert step.reward == 0.0 and "found: " in step.info["test_output"], step.info
    assert len(keys) == 1 and keys[0] not in step.info["test_output"]


@pytest.mark.slow
@pytest.mark.parametrize("forgery", sorted(REPO_FORGERIES))
def test_repo_repair_forgeries_that_leave_the_bug_score_zero(repo_env, forgery):
    repo_env.reset(TASK)
    edit = repo_env.step(call("python", code=REPO_FORGERIES[forgery]))
    assert edit.info[TOOL_ERRORS_KEY] == {}, edit.observation
    # The premise: the bug is still in the source the model left.
    left = repo_env.step(call("bash", command="cat textstats/stats.py"))
    assert BUG.buggy in left.observation
    step = repo_env.step(answer("done"))
    assert step.status is EpisodeStatus.COMPLETED, step.info
    assert (step.reward, step.info["correct"]) == (0.0, False), (forgery, step.info)
    assert step.info["failures"] + step.info["errors"] > 0, step.info


def test_repo_repair_honest_fixes_score_one_whatever_else_they_print(repo_env):
    repo_env.reset(TASK)
    fix = (
        "import pathlib; p = pathlib.Path('textstats/stats.py'); "
        f"p.write_text(p.read_text().replace({BUG.buggy!r}, {BUG.fixed!r}))"
    )
    repo_env.step(call("python", code=fix))
    step = repo_env.step(answer("done"))
    assert (step.reward, step.info["tests"], step.info["failures"], step.info["errors"]) == (
        1.0,
        4,
        0,
        0,
    ), step.info
    # A fix through a new module of the package, with prints on import and in calls.
    repo_env.reset(TASK)
    helper = (
        "print('helper loaded')\n\ndef middle(ordered):\n    n = len(ordered)\n"
        "    print('middle of', n)\n    if n % 2 == 1:\n        return ordered[n // 2]\n"
        "    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2\n"
    )
    repo_env.step(
        call(
            "python",
            code=write("textstats/helpers/mid.py", helper)
            + write("textstats/helpers/__init__.py", ""),
        )
    )
    patch = (
        "import pathlib, re; p = pathlib.Path('textstats/stats.py'); t = p.read_text()\n"
        "t = re.sub(r'    middle = n // 2\\n.*?return \\(ordered.*?\\) / 2\\n', "
        "'    from textstats.helpers.mid import middle\\n    return middle(ordered)\\n', "
        "t, flags=re.S)\n"
        "p.write_text(t)\n"
    )
    repo_env.step(call("python", code=patch))
    shown = repo_env.step(
        call("bash", command="python3 -c 'import textstats as t; print(t.median([4, 1, 3, 2]))'")
    )
    assert shown.observation.splitlines()[-1] == "2.5", shown.observation
    step = repo_env.step(answer("done"))
    assert (step.reward, step.info["tests"]) == (1.0, 4), step.info


def test_repo_repair_a_fix_that_also_plants_things_still_scores_one(repo_env):
    # Planted files are left out of the pristine copy; they neither help nor hurt a fix.
    repo_env.reset(TASK)
    fix = (
        "import pathlib; p = pathlib.Path('textstats/stats.py'); "
        f"p.write_text(p.read_text().replace({BUG.buggy!r}, {BUG.fixed!r}))\n"
        + write("sitecustomize.py", "raise SystemExit(1)\n")
        + write("textstats/conftest.py", "raise SystemExit(1)\n")
    )
    repo_env.step(call("python", code=fix))
    step = repo_env.step(answer("done"))
    assert step.reward == 1.0, step.info
    assert any("conftest.py" in entry for entry in step.info["not_copied"]), step.info


def test_hidden_test_names_list_every_test_method_and_refuse_none():
    names = hidden_test_names(PROJECTS["cart"].hidden_tests)
    assert names == (
        "HiddenCartTest.test_add_accumulates",
        "HiddenCartTest.test_bulk_discount_at_threshold",
        "HiddenCartTest.test_remove",
        "HiddenCartTest.test_bad_quantity",
    )
    with pytest.raises(ValueError, match="hold no test"):
        hidden_test_names(
            "import unittest\nclass T(unittest.TestCase):\n    def helper(self): pass\n"
        )
    with pytest.raises(ValueError, match="do not parse"):
        hidden_test_names("def (:\n")


# --- bash_terminal ----------------------------------------------------------------------------


def bash_task(template: str, seed: int = 0) -> Task:
    env = BashTerminalEnv()
    try:
        return next(
            t for t in env.tasks("train", 80, seed=seed) if t.metadata["template"] == template
        )
    finally:
        env.close()


@pytest.fixture(scope="module")
def bash_env(sandbox):
    env = BashTerminalEnv(python_tool=True, sandbox=sandbox)
    yield env
    env.close()


def _dirs(task):
    return task.metadata["expect"]["dirs"]


def _file(task):
    ((path, text),) = task.metadata["expect"]["files"].items()
    return path, text


# (template, commands that do not do the task but would fool a checker that follows links,
#  opens what it finds or imports from the work dir)
BASH_FORGERIES = {
    "dirs_as_links_to_existing_dirs": (
        "make_dirs",
        lambda t: " && ".join(f"mkdir -p $(dirname {d}) && ln -s /usr {d}" for d in _dirs(t)),
    ),
    "file_as_link_to_text_kept_elsewhere": (
        "write_line",
        lambda t: (
            f"printf '%s\\n' {_file(t)[1]!r} > /tmp/kept.txt && ln -s /tmp/kept.txt {_file(t)[0]}"
        ),
    ),
    "fifo_where_the_file_should_be": ("count_lines", lambda t: f"mkfifo {_file(t)[0]}"),
    "unreadable_file": (
        "count_lines",
        lambda t: f"wc -l < data.txt > {_file(t)[0]} && chmod 000 {_file(t)[0]}",
    ),
    "right_text_then_more_past_a_bounded_read": (
        "write_line",
        lambda t: (
            f"{{ echo {_file(t)[1]!r}; head -c 5000 /dev/zero | tr '\\0' '\\n'; echo more; }} "
            f"> {_file(t)[0]}"
        ),
    ),
    "huge_file": ("count_lines", lambda t: f"head -c 30000000 /dev/zero > {_file(t)[0]}"),
    "planted_modules_print_a_forged_report": (
        "count_lines",
        lambda t: (
            "for m in sitecustomize usercustomize json os stat; do "
            "echo \"import sys; print('@@report-x@@{}'); sys.exit(0)\" > $m.py; done"
        ),
    ),
}


@pytest.mark.parametrize("forgery", sorted(BASH_FORGERIES))
def test_bash_terminal_forgeries_score_zero(bash_env, forgery):
    template, command = BASH_FORGERIES[forgery]
    task = bash_task(template)
    bash_env.reset(task)
    bash_env.step(call("bash", command=command(task)))
    step = bash_env.step(answer("done"))
    assert step.status is EpisodeStatus.COMPLETED, step.info  # not an env error
    assert (step.reward, step.info["correct"]) == (0.0, False), (forgery, step.info)
    assert step.info["check_failures"], step.info


HONEST = {
    "make_dirs": lambda t: "mkdir -p " + " ".join(_dirs(t)),
    "write_line": lambda t: f"echo {_file(t)[1]!r} > {_file(t)[0]}",
    "count_lines": lambda t: f"wc -l < data.txt > {_file(t)[0]}",
    "sort_lines": lambda t: "sort names.txt > sorted.txt",
    "grep_errors": lambda t: "grep ERROR log.txt > errors.txt",
    "delete_tmp": lambda t: "rm -f *.tmp",
}


@pytest.mark.parametrize("template", sorted(HONEST))
def test_bash_terminal_honest_commands_score_one(bash_env, template):
    task = bash_task(template)
    bash_env.reset(task)
    bash_env.step(call("bash", command=HONEST[template](task)))
    step = bash_env.step(answer("done"))
    assert (step.reward, step.info["check_failures"]) == (1.0, []), step.info


def test_bash_terminal_a_dangling_link_is_not_absent(bash_env):
    task = bash_task("rename")
    (old,) = task.metadata["expect"]["absent"]
    ((new, _),) = task.metadata["expect"]["files"].items()
    bash_env.reset(task)
    bash_env.step(call("bash", command=f"mv {old} {new} && ln -s /nowhere {old}"))
    step = bash_env.step(answer("done"))
    assert step.reward == 0.0 and step.info["check_failures"] == [
        f"{old}: still exists (a symbolic link)"
    ], step.info
    bash_env.reset(task)
    bash_env.step(call("bash", command=f"mv {old} {new}"))
    assert bash_env.step(answer("done")).reward == 1.0


# --- python_math ------------------------------------------------------------------------------

SQUARES = Task(
    "t",
    "What is the sum of the squares of the integers from 1 to 24? Use python to compute it.",
    "4900",
    {"template": "sum_of_squares"},
)
GCD = Task("t", "What is the greatest common divisor of 84 and 120?", "12", {"template": "gcd"})
POWER = Task("t", "What is 2 to the power 10, modulo 1000?", "24", {"template": "modular_power"})


@pytest.fixture(scope="module")
def math_env(sandbox):
    env = PythonMathEnv(sandbox=sandbox)
    yield env
    env.close()


@pytest.mark.parametrize(
    "task, text",
    [
        (SQUARES, r"\sum_{i=1}^{24} i^2"),
        (SQUARES, r"\boxed{\sum_{i=1}^{24} i^{2}}"),
        (SQUARES, "24*25*49/6"),
        (GCD, r"\gcd(84, 120)"),
        (POWER, r"2^{10} - 1000"),
        (SQUARES, "4899 4900 4901"),
        (SQUARES, "4900 or 4901"),
        (SQUARES, "see answer.txt"),
        (SQUARES, ""),
    ],
)
def test_python_math_answers_that_are_not_the_number_score_zero(math_env, task, text):
    math_env.reset(task)
    # The answer left in a file of the work dir does not count either.
    math_env.step(call("python", code="open('answer.txt', 'w').write('4900')"))
    step = math_env.step(answer(text))
    assert (step.reward, step.info["correct"]) == (0.0, False), text


@pytest.mark.parametrize("text", ["4900", "4,900", r"\boxed{4900}", "4900.0", " 4900. "])
def test_python_math_the_computed_number_scores_one(math_env, text):
    math_env.reset(SQUARES)
    printed = math_env.step(call("python", code="print(sum(i * i for i in range(1, 25)))"))
    assert printed.observation == "4900"
    assert math_env.step(answer(text)).reward == 1.0


def test_python_math_nothing_carries_over_between_episodes(math_env):
    math_env.reset(SQUARES)
    math_env.step(call("python", code="open('notes.txt', 'w').write('4900')"))
    math_env.reset(SQUARES)
    step = math_env.step(call("python", code="import os; print(os.path.exists('notes.txt'))"))
    assert step.observation == "False"


def test_python_math_a_non_numeric_reference_keeps_the_math_answer_rule(math_env):
    math_env.reset(Task("t", "Which city is the capital of France?", "Paris"))
    assert math_env.step(answer("paris")).reward == 1.0
    math_env.reset(Task("t", "Which city is the capital of France?", "Paris"))
    assert math_env.step(answer("Lyon")).reward == 0.0
