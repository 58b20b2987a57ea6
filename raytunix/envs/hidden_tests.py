"""Hidden tests whose verdict the code under test cannot write.

``run_hidden_tests`` runs a ``unittest`` module of hidden tests against a Python project
the model edited, in a sandbox, so that nothing the project does decides the reward:

1. **A pristine copy.** Only the project's source files (``*.py`` under its source
   directories, regular files, no symbolic links; never ``conftest.py``,
   ``sitecustomize.py``, ``usercustomize.py``, ``__pycache__``, ``.pth`` files or a planted
   ``tests/``) are read out of the episode's work dir and written into a fresh work dir of
   their own (a new user id or a new namespace: no process of the episode reaches it).
2. **The tests run in a process the project never enters.** The harness (the standard
   library only, ``python3 -I -S``, given on stdin) runs every hidden test itself, with the
   project's modules replaced by stand-ins; each call a test makes into the project goes
   to a separate server process that imports the project, one server per test, and only
   JSON data comes back (numbers, strings, lists, tuples, dicts, sets; any other object
   stays in the server, as a handle). So the assertions, the test runner, the loader and
   the counts live where the project's code cannot patch them, and an object with a
   forged ``__eq__`` never reaches a comparison: the harness compares its own copies.
3. **A report the project cannot write.** The harness's secrets (the hidden test source
   and a per-run key) reach it in a file that it reads and deletes, and it makes itself
   non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``), before any project code runs: processes
   of the same user cannot read its memory, its open files or ptrace it. Its report is
   signed with that key (HMAC-SHA256); a line without a valid signature, whatever it says,
   is ignored. A project that kills or stalls the harness, floods the output or exits
   early leaves no signed report, and that scores 0.
4. **Every test counted.** The host lists the hidden tests from their source (``ast``);
   the verdict is a pass only when the signed report names exactly those tests and each
   passed.

What the hidden tests may do: module-level ``unittest.TestCase`` classes with ``test*``
methods that call the project's functions and classes (``from pkg import f``,
``import pkg.mod``) and read attributes of what they return; values cross as data,
exceptions by their built-in class (a project's ``class BadInput(ValueError)`` arrives as
``ValueError``). Not supported: a test that compares a project object itself (rather
than data read from it), truth-tests one, or reads a module-level constant without a
call. The bound on isolation is the sandbox's: with the ``process`` isolation level (no
bubblewrap, host user not root) episodes share the host user and this guarantee does not
hold.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import hmac
import json
import re
import secrets
from typing import Sequence

from raytunix.envs.tool_task import collect_sources, write_files
from raytunix.sandbox import SandboxSession

SEALED_FILE = ".raytunix-hidden-tests.json"
REPORT_PREFIX = "@@hidden-tests@@ "
DEFAULT_TEST_TIMEOUT_S = 5.0  # one hidden test, calls into the project included
# What may be copied into the pristine tree: Python source files with a module's name.
_SOURCE_NAME = r"[A-Za-z_][A-Za-z0-9_]*\.py"
_NOT_SOURCE = ("conftest.py", "sitecustomize.py", "usercustomize.py")


@dataclasses.dataclass(frozen=True)
class HiddenTestReport:
    """The outcome of one run of the hidden tests.

    Attributes:
      passed: every hidden test ran and passed (the reward's condition).
      expected: the hidden tests' names (``Class.method``), from their source.
      results: ``{name: "pass" | "fail" | "error"}`` from the signed report ({} if none).
      output: the tail of the failures' tracebacks, or why there is no report.
      not_copied: paths in the work dir's source directories that were left out of the
        pristine copy, each with the reason.
    """

    passed: bool
    expected: tuple[str, ...]
    results: dict[str, str]
    output: str
    not_copied: tuple[str, ...] = ()

    @property
    def tests(self) -> int:
        return len(self.results)

    @property
    def failures(self) -> int:
        return sum(1 for outcome in self.results.values() if outcome == "fail")

    @property
    def errors(self) -> int:
        """Tests that errored, plus hidden tests the report does not name."""
        missing = sum(1 for name in self.expected if name not in self.results)
        return sum(1 for outcome in self.results.values() if outcome == "error") + missing


def hidden_test_names(source: str) -> tuple[str, ...]:
    """The tests of a ``unittest`` module, ``Class.method`` for each ``test*`` method of a
    module-level class, in source order (what ``unittest``'s default loader runs there).

    Raises:
      ValueError: ``source`` does not parse, or holds no test.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise ValueError(f"the hidden tests do not parse: {e}") from None
    names = tuple(
        f"{node.name}.{item.name}"
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        for item in node.body
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
        and item.name.startswith("test")
    )
    if not names:
        raise ValueError(
            "the hidden tests hold no test: expected module-level "
            "unittest.TestCase classes with test* methods"
        )
    return names


def run_hidden_tests(
    session: SandboxSession,
    *,
    source_dirs: Sequence[str],
    tests: str,
    packages: Sequence[str],
    test_timeout_s: float = DEFAULT_TEST_TIMEOUT_S,
) -> HiddenTestReport:
    """Runs the hidden ``tests`` against the project in ``session``'s work dir (see the
    module docstring for how the verdict is kept out of the project's reach).

    Args:
      session: the episode's work dir, holding the project as the model left it.
      source_dirs: the work dir's directories of project source (e.g. ``["textstats"]``);
        only ``*.py`` files under them are copied.
      tests: the hidden tests, a ``unittest`` module's source.
      packages: the top-level module names of the project that ``tests`` imports; their
        imports become stand-ins that call into the project's server.
      test_timeout_s: deadline of one hidden test, seconds (> 0); past it the test errors.
        The sandbox's wall-clock limit bounds the whole run.

    Returns:
      a ``HiddenTestReport``; ``passed`` is False for anything the project caused (a
      failing, hanging or crashing test, a killed harness, no signed report).

    Raises:
      ValueError: bad ``source_dirs``, ``packages``, ``tests`` or ``test_timeout_s``.
      RuntimeError: the harness failed before any project code ran (a fault of the host,
        not of the policy), or the source files could not be read out.
      SandboxUnavailable: the sandbox cannot serve the calls.
    """
    for name in packages:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"package {name!r} is not a top-level module name")
    if not packages:
        raise ValueError("packages is empty; name the project's top-level modules")
    if not (isinstance(test_timeout_s, (int, float)) and 0 < test_timeout_s <= 3600):
        raise ValueError(f"test_timeout_s={test_timeout_s!r} must be seconds in (0, 3600]")
    expected = hidden_test_names(tests)
    files, not_copied = collect_sources(
        session, source_dirs, name_pattern=_SOURCE_NAME, exclude=_NOT_SOURCE
    )
    key = secrets.token_hex(32)
    sealed = {
        "key": key,
        "tests": tests,
        "packages": list(packages),
        "test_timeout_s": float(test_timeout_s),
    }
    pristine = SandboxSession(session.client, name="hidden-tests")
    try:
        write_files(pristine, {**files, SEALED_FILE: json.dumps(sealed)})
        result = pristine.run(["python3", "-I", "-S", "-"], stdin=_HARNESS)
    finally:
        pristine.close()
    report = _signed_report(result.stdout, key)
    if report is None:
        why = (
            f"the hidden tests left no signed report (exit {result.exit_code}, limit "
            f"{result.killed_by_limit.value if result.killed_by_limit else None}, stdout "
            f"{'cut' if result.stdout_truncated else 'whole'}); the project stopped, "
            f"stalled or flooded the harness. stderr: {result.stderr[-1000:]}"
        )
        return HiddenTestReport(False, expected, {}, why, tuple(not_copied))
    if "harness_error" in report:
        raise RuntimeError(
            f"the hidden-test harness failed before running any project "
            f"code: {report['harness_error']}"
        )
    results = {str(k): str(v) for k, v in dict(report.get("results", {})).items()}
    passed = sorted(results) == sorted(expected) and all(
        outcome == "pass" for outcome in results.values()
    )
    output = str(report.get("output", ""))
    if sorted(results) != sorted(expected):
        output = (
            f"the harness ran {sorted(results)}, not the hidden tests {sorted(expected)}\n" + output
        )
    return HiddenTestReport(passed, expected, results, output[-2000:], tuple(not_copied))


def _signed_report(stdout: str, key: str) -> dict | None:
    """The first line of ``stdout`` that is ``REPORT_PREFIX <hmac> <json>`` with a valid
    HMAC-SHA256 of the JSON under ``key``, decoded; None if there is none."""
    for line in stdout.splitlines():
        if not line.startswith(REPORT_PREFIX):
            continue
        signature, _, body = line[len(REPORT_PREFIX) :].partition(" ")
        want = hmac.new(bytes.fromhex(key), body.encode(), hashlib.sha256).hexdigest()
        if hmac.compare_digest(signature, want):
            try:
                report = json.loads(body)
            except ValueError:
                continue
            if isinstance(report, dict):
                return report
    return None


# The server: imports the project and answers the harness's calls, one JSON line each way
# on a copy of its stdin/stdout; the project's own prints go to stderr (discarded).
# Untrusted by design: whatever it does, only data comes back.
_SERVER = r'''
import builtins, importlib, json, os, sys, traceback
_in = os.fdopen(os.dup(0), "r", encoding="utf-8")
_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
_null = os.open(os.devnull, os.O_RDWR)
os.dup2(_null, 0)
os.dup2(2, 1)
sys.path.append(os.getcwd())
_objects = {}

def enc(v, depth=0):
    t = type(v)
    if v is None or t in (bool, int, float, str):
        return v
    if depth < 50:
        try:
            if t is list:
                return [enc(x, depth + 1) for x in v]
            if t is tuple:
                return {"t": [enc(x, depth + 1) for x in v]}
            if t in (set, frozenset):
                return {"s": [enc(x, depth + 1) for x in v]}
            if t is dict:
                return {"d": [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]}
        except _Unencodable:
            pass
    if depth:
        raise _Unencodable()
    handle = len(_objects) + 1
    _objects[handle] = v
    return {"h": handle, "type": t.__name__}

class _Unencodable(Exception):
    pass

def enc_top(v):
    try:
        return enc(v)
    except _Unencodable:
        handle = len(_objects) + 1
        _objects[handle] = v
        return {"h": handle, "type": type(v).__name__}

def dec(v):
    if isinstance(v, list):
        return [dec(x) for x in v]
    if isinstance(v, dict):
        if "t" in v: return tuple(dec(x) for x in v["t"])
        if "s" in v: return set(dec(x) for x in v["s"])
        if "d" in v: return {dec(k): dec(x) for k, x in v["d"]}
        if "h" in v: return _objects[v["h"]]
        if "n" in v: return resolve(v)
    return v

def resolve(ref):
    try:
        obj = importlib.import_module(ref["n"])
    except BaseException as e:
        raise ImportError(f"importing the project failed: {type(e).__name__}: {e}") from e
    for name in ref["p"]:
        obj = getattr(obj, name)
    return obj

def serve(req):
    op = req["op"]
    target = dec(req["target"])
    if op == "call":
        return target(*dec(req["args"]), **{k: dec(x) for k, x in req["kwargs"].items()})
    if op == "getattr":
        return getattr(target, req["name"])
    if op == "setattr":
        setattr(target, req["name"], dec(req["value"]))
        return None
    if op == "getitem":
        return target[dec(req["key"])]
    if op == "len":
        return len(target)
    if op == "iter":
        return list(target)
    raise ValueError(f"unknown op {op!r}")

for line in _in:
    try:
        answer = {"v": enc_top(serve(json.loads(line)))}
    except BaseException as e:
        answer = {"raise": [c.__name__ for c in type(e).__mro__],
                  "message": (str(e) + "\n" + "".join(traceback.format_exception(e)[-3:]))[-1500:]}
    _out.write(json.dumps(answer) + "\n")
    _out.flush()
'''

# The harness: the trusted side. Reads and deletes its sealed file and turns non-dumpable
# before starting any server; never imports anything from the work dir.
_HARNESS = r'''
import builtins, ctypes, hashlib, hmac, importlib.abc, importlib.machinery, io, json, os
import select, signal, subprocess, sys, time, traceback, types, unittest

SEALED_FILE = %(sealed)r
PREFIX = %(prefix)r
SERVER = %(server)r
MAX_LINE = 1 << 20

def emit(key, report):
    body = json.dumps(report)
    mac = hmac.new(bytes.fromhex(key), body.encode(), hashlib.sha256).hexdigest()
    sys.stdout.write(PREFIX + mac + " " + body + "\n")
    sys.stdout.flush()

try:
    with open(SEALED_FILE, encoding="utf-8") as f:
        SEALED = json.load(f)
    os.unlink(SEALED_FILE)
except Exception as e:
    sys.stderr.write("cannot read the sealed file: %%r\n" %% (e,))
    sys.exit(3)
KEY = SEALED.pop("key")
try:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
except Exception as e:
    emit(KEY, {"harness_error": "cannot make the harness non-dumpable: %%r" %% (e,)})
    sys.exit(3)
TIMEOUT = SEALED["test_timeout_s"]


class ProjectError(Exception):
    """The project's server failed a call (died, stalled, answered garbage)."""


class Server:
    def __init__(self, deadline):
        self.deadline = deadline
        self.buffer = b""
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", SERVER],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True)

    def request(self, message):
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):
            raise ProjectError("the project's process is gone (it exited or was killed)")
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            wait = self.deadline - time.monotonic()
            if wait <= 0:
                self.close()
                raise ProjectError("the test did not finish within %%g s" %% TIMEOUT)
            ready, _, _ = select.select([fd], [], [], wait)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise ProjectError("the project's process exited during a call")
            self.buffer += chunk
            if len(self.buffer) > MAX_LINE:
                self.close()
                raise ProjectError("the project's answer is longer than %%d bytes" %% MAX_LINE)
        line, _, self.buffer = self.buffer.partition(b"\n")
        try:
            answer = json.loads(line)
            if "v" in answer:
                return decode(answer["v"])
            names, message = list(answer["raise"]), str(answer["message"])
        except ProjectError:
            raise
        except Exception as e:
            raise ProjectError("the project's process answered garbage: %%r" %% (e,))
        for name in names:
            cls = getattr(builtins, str(name), None)
            if isinstance(cls, type) and issubclass(cls, Exception):
                raise cls(message)
        raise ProjectError("the project raised %%s: %%s" %% (names[:1], message))

    def close(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


CURRENT = []  # the running test's server, started on its first call


def server():
    if not CURRENT:
        raise ProjectError("the project was called outside a test")
    if CURRENT[0] is None:
        CURRENT[0] = Server(time.monotonic() + TIMEOUT)
    return CURRENT[0]


def decode(v):
    if isinstance(v, list):
        return [decode(x) for x in v]
    if isinstance(v, dict):
        if set(v) == {"t"}:
            return tuple(decode(x) for x in v["t"])
        if set(v) == {"s"}:
            return set(decode(x) for x in v["s"])
        if set(v) == {"d"}:
            return {decode(k): decode(x) for k, x in v["d"]}
        if set(v) == {"h", "type"} and type(v["h"]) is int:
            return Remote({"h": v["h"]}, str(v["type"]))
        raise ProjectError("the project's process answered an unknown value")
    if v is None or type(v) in (bool, int, float, str):
        return v
    raise ProjectError("the project's process answered an unknown value")


def encode(v):
    if isinstance(v, Remote):
        return object.__getattribute__(v, "_ref")
    if v is None or type(v) in (bool, int, float, str):
        return v
    if type(v) is list:
        return [encode(x) for x in v]
    if type(v) is tuple:
        return {"t": [encode(x) for x in v]}
    if type(v) in (set, frozenset):
        return {"s": [encode(x) for x in v]}
    if type(v) is dict:
        return {"d": [[encode(k), encode(x)] for k, x in v.items()]}
    raise TypeError("a hidden test passed %%s to the project; only data and project "
                    "objects can be passed" %% type(v).__name__)


class Remote:
    """A name in the project (lazy: resolved in the test's server on use) or an object
    living in the server (a handle). Compared by identity; no truth value."""

    __slots__ = ("_ref", "_type")

    def __init__(self, ref, type_name):
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_type", type_name)

    def _ask(self, op, **fields):
        return server().request({"op": op, "target": object.__getattribute__(self, "_ref"),
                                 **fields})

    def __call__(self, *args, **kwargs):
        return self._ask("call", args=[encode(a) for a in args],
                         kwargs={str(k): encode(v) for k, v in kwargs.items()})

    def __getattr__(self, name):
        ref = object.__getattribute__(self, "_ref")
        if name.startswith("__"):
            raise AttributeError(name)
        if "n" in ref:
            return Remote({"n": ref["n"], "p": ref["p"] + [name]}, "name")
        return self._ask("getattr", name=name)

    def __setattr__(self, name, value):
        self._ask("setattr", name=name, value=encode(value))

    def __getitem__(self, key):
        return self._ask("getitem", key=encode(key))

    def __len__(self):
        length = self._ask("len")
        if type(length) is not int:
            raise ProjectError("len() of a project object is not an int")
        return length

    def __iter__(self):
        return iter(self._ask("iter"))

    def __bool__(self):
        raise TypeError("a hidden test truth-tested a project object; compare data read "
                        "from it instead")

    def __repr__(self):
        return "<project %%s>" %% object.__getattribute__(self, "_type")


class StandIn(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Remote({"n": self.__name__, "p": [name]}, "name")


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, packages):
        self.packages = set(packages)

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.packages:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def main():
    sys.meta_path.insert(0, StandInFinder(SEALED["packages"]))
    module = types.ModuleType("hidden_tests")
    try:
        exec(compile(SEALED["tests"], "hidden_tests.py", "exec"), module.__dict__)
    except Exception as e:
        return {"results": {}, "output": "the hidden tests failed to load: %%r" %% (e,)}
    suite = unittest.defaultTestLoader.loadTestsFromModule(module)

    def flatten(s):
        for item in s:
            if isinstance(item, unittest.TestSuite):
                yield from flatten(item)
            else:
                yield item

    results, output = {}, io.StringIO()
    for test in flatten(suite):
        name = test.id().split(".", 1)[-1]
        result = unittest.TestResult()
        CURRENT[:] = [None]
        try:
            test.run(result)
        finally:
            if CURRENT[0] is not None:
                CURRENT[0].close()
            CURRENT[:] = []
        if result.testsRun != 1 or result.skipped or result.expectedFailures:
            outcome = "error"
        elif result.errors:
            outcome = "error"
        elif result.failures or result.unexpectedSuccesses:
            outcome = "fail"
        else:
            outcome = "pass"
        results[name] = outcome
        for _, text in result.errors + result.failures:
            output.write("%%s: %%s\n%%s\n" %% (outcome.upper(), name, text[-1500:]))
    return {"results": results, "output": output.getvalue()[-4000:]}


try:
    REPORT = main()
except Exception:
    REPORT = {"results": {}, "output": "the harness failed: " + traceback.format_exc()[-1500:]}
emit(KEY, REPORT)
''' % {"sealed": SEALED_FILE, "prefix": REPORT_PREFIX, "server": _SERVER}
