"""Runs the model's SQL in a helper process with memory, time and output bounds.

Every query the text-to-SQL environment runs for the model (its ``sql`` tool, and its final
answer) goes through ``SQLWorkerPool.execute``: one of a few helper processes (this file
run as a script, standard library only) opens the database read-only and runs it. The
bounds, each of which holds on its own:

* **SQLite's own limits** (``Connection.setlimit``): one string or blob at most
  ``MAX_VALUE_BYTES``, SQL text at most ``MAX_SQL_CHARS``, no attached databases, shallow
  expressions, few columns and compound terms; ``PRAGMA hard_heap_limit`` caps all of
  SQLite's memory in the helper and ``temp_store = MEMORY`` keeps sorts and temp tables
  under it (nothing is written to disk).
* **An authorizer**: reads only; functions only from ``ALLOWED_FUNCTIONS`` (no
  ``zeroblob``, ``randomblob``, ``printf`` ...: functions that make large values from small
  arguments); no recursive CTEs (rows without end). It records the tables the query reads.
* **Address space**: the helper runs under ``RLIMIT_AS`` (``WORKER_MEMORY_BYTES``) and
  ``RLIMIT_FSIZE`` 0, so whatever escapes the limits above fails there, not in the
  environment's process.
* **Time**: a progress handler stops the query at its deadline, and the parent kills the
  helper if no answer comes ``KILL_GRACE_S`` later (one expensive step that the handler
  cannot interrupt), then starts a fresh one.
* **Output**: at most ``max_rows`` rows and ``max_result_bytes`` (UTF-8 bytes of text and
  blobs, 16 per number) come back; more is an error, not a truncation.

The reference for these choices is SQLite's "Defense Against The Dark Arts" page
(sqlite.org/security.html): lower ``SQLITE_LIMIT_LENGTH``, a hard heap limit, an
authorizer that limits functions, a progress handler, and a separate process where those
are not enough.
"""

from __future__ import annotations

import base64
import json
import os
import select
import sqlite3
import subprocess
import sys
import threading
import time
from typing import Any

MAX_VALUE_BYTES = 1_000_000  # SQLITE_LIMIT_LENGTH: the largest string or blob, bytes
MAX_SQL_CHARS = 20_000  # SQLITE_LIMIT_SQL_LENGTH
HEAP_LIMIT_BYTES = 64 << 20  # PRAGMA hard_heap_limit in the helper
WORKER_MEMORY_BYTES = 512 << 20  # RLIMIT_AS of the helper
KILL_GRACE_S = 1.0  # past the deadline, the parent kills a helper that has not answered
MAX_WORKERS = 4  # helpers per process; more concurrent queries wait for one

ALLOWED_FUNCTIONS = frozenset(
    {
        # aggregates
        "count",
        "sum",
        "total",
        "avg",
        "min",
        "max",
        "group_concat",
        # window functions
        "row_number",
        "rank",
        "dense_rank",
        "percent_rank",
        "cume_dist",
        "ntile",
        "lag",
        "lead",
        "first_value",
        "last_value",
        "nth_value",
        # scalars that make values no larger than their arguments
        "abs",
        "round",
        "length",
        "lower",
        "upper",
        "substr",
        "substring",
        "trim",
        "ltrim",
        "rtrim",
        "replace",
        "instr",
        "coalesce",
        "ifnull",
        "nullif",
        "iif",
        "like",
        "glob",
        "typeof",
        "sign",
        "date",
        "time",
        "datetime",
        "julianday",
        "strftime",
        "unixepoch",
        "likely",
        "unlikely",
        "likelihood",
        "quote",
        "hex",
        "unicode",
        "char",
        "floor",
        "ceil",
        "ceiling",
        "trunc",
        "sqrt",
        "pow",
        "power",
        "mod",
        "exp",
        "ln",
        "log",
        "log10",
        "log2",
    }
)
"""Functions a query may call (lower case). ``hex`` and ``replace`` can grow a value a few
times over, but never past ``MAX_VALUE_BYTES``."""

_LIMITS = {
    "SQLITE_LIMIT_LENGTH": MAX_VALUE_BYTES,
    "SQLITE_LIMIT_SQL_LENGTH": MAX_SQL_CHARS,
    "SQLITE_LIMIT_COLUMN": 100,
    "SQLITE_LIMIT_EXPR_DEPTH": 100,
    "SQLITE_LIMIT_COMPOUND_SELECT": 20,
    "SQLITE_LIMIT_FUNCTION_ARG": 8,
    "SQLITE_LIMIT_ATTACHED": 0,
    "SQLITE_LIMIT_LIKE_PATTERN_LENGTH": 1000,
    "SQLITE_LIMIT_VARIABLE_NUMBER": 10,
    "SQLITE_LIMIT_TRIGGER_DEPTH": 1,
    "SQLITE_LIMIT_WORKER_THREADS": 0,
}
_RECURSIVE = getattr(sqlite3, "SQLITE_RECURSIVE", 33)


class QueryFailed(Exception):
    """A query the helper refused or that failed; ``kind`` is ``"timeout"``,
    ``"bad_arguments"`` or ``"error"``."""

    def __init__(self, message: str, kind: str = "error") -> None:
        super().__init__(message)
        self.kind = kind


# -- the helper's side -------------------------------------------------------------------


def _value_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, bytes):
        return len(value)
    return 16


def run_one(
    path: str, query: str, timeout_s: float, max_rows: int, max_result_bytes: int
) -> dict[str, Any]:
    """Runs ``query`` read-only on the database at ``path`` with every in-process bound of
    the module docstring, in the calling process (the helper calls it; a test may too).

    Returns:
      ``{"columns": [str], "rows": [[value]], "tables": [str]}``: the tables are those the
      query read.

    Raises:
      QueryFailed: refused (a write, a function outside ``ALLOWED_FUNCTIONS``, a recursive
        CTE, several statements), failed, past ``timeout_s`` (kind ``"timeout"``), or its
        result is over ``max_rows`` rows or ``max_result_bytes``.
    """
    _check_query_text(query)
    authorizer = _ReadOnlyAuthorizer()
    deadline = time.monotonic() + timeout_s
    conn = _connect_bounded(path, authorizer, deadline)
    try:
        try:
            cursor = conn.execute(query)
            rows = _fetch_bounded(cursor, max_rows, max_result_bytes)
        except sqlite3.Error as e:
            if time.monotonic() > deadline:
                raise QueryFailed(
                    f"the query ran past its {timeout_s:g} s deadline and was stopped; simplify it",
                    "timeout",
                ) from None
            raise QueryFailed(_failure_message(e, authorizer.refused)) from None
        except sqlite3.Warning as e:  # "You can only execute one statement at a time."
            raise QueryFailed(str(e)) from None
        columns = [d[0] for d in cursor.description or ()]
        return {"columns": columns, "rows": rows, "tables": sorted(authorizer.tables)}
    finally:
        conn.close()


def _check_query_text(query: str) -> None:
    """Raises ``QueryFailed`` (kind ``"bad_arguments"``) for an empty query or one over
    ``MAX_SQL_CHARS`` characters, before any database is opened."""
    if not query.strip():
        raise QueryFailed("the query is empty; write one SELECT statement", "bad_arguments")
    if len(query) > MAX_SQL_CHARS:
        raise QueryFailed(
            f"the query is {len(query):,} characters, over the {MAX_SQL_CHARS:,} "
            "allowed; write a shorter one",
            "bad_arguments",
        )


class _ReadOnlyAuthorizer:
    """sqlite's authorizer callback for one query: allows reading and the functions in
    ``ALLOWED_FUNCTIONS``, denies everything else (writes, other functions, recursive
    CTEs), and keeps what it saw.

    Attributes:
      tables: the ``main`` database's tables the query read.
      refused: why each denied action was denied, in order (the first one explains a
        failed query better than sqlite's "not authorized").
    """

    def __init__(self) -> None:
        self.tables: set[str] = set()
        self.refused: list[str] = []

    def __call__(self, action: int, arg1: Any, arg2: Any, db_name: Any, trigger: Any) -> int:
        if action == sqlite3.SQLITE_SELECT:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_READ:
            if db_name == "main":
                self.tables.add(arg1)
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION:
            if str(arg2).lower() in ALLOWED_FUNCTIONS:
                return sqlite3.SQLITE_OK
            self.refused.append(
                f"function {arg2}() is not allowed (allowed: "
                f"{', '.join(sorted(ALLOWED_FUNCTIONS))})"
            )
            return sqlite3.SQLITE_DENY
        if action == _RECURSIVE:
            self.refused.append("recursive CTEs are not allowed; no question needs one")
            return sqlite3.SQLITE_DENY
        self.refused.append("the database is read-only: only SELECT queries run")
        return sqlite3.SQLITE_DENY


def _connect_bounded(
    path: str, authorizer: _ReadOnlyAuthorizer, deadline: float
) -> sqlite3.Connection:
    """A read-only connection to ``path`` with ``_LIMITS``, no writes or untrusted schema
    functions, ``authorizer`` installed, and a progress handler that stops the query once
    ``time.monotonic()`` passes ``deadline``. The caller closes it."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
    try:
        for name, value in _LIMITS.items():
            if hasattr(sqlite3, name):
                conn.setlimit(getattr(sqlite3, name), value)
        conn.execute("PRAGMA query_only = ON")
        conn.execute("PRAGMA temp_store = MEMORY")
        conn.execute("PRAGMA trusted_schema = OFF")
        conn.set_authorizer(authorizer)
        # Checked every 1000 virtual-machine steps; one step is bounded by the limits above.
        conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 1000)
    except BaseException:
        conn.close()
        raise
    return conn


def _fetch_bounded(cursor: sqlite3.Cursor, max_rows: int, max_result_bytes: int) -> list[Any]:
    """The cursor's rows, raising ``QueryFailed`` as soon as there are more than
    ``max_rows`` or their values (``_value_bytes``) pass ``max_result_bytes``."""
    rows, size = [], 0
    for row in cursor:
        size += sum(_value_bytes(v) for v in row)
        rows.append(row)
        if len(rows) > max_rows:
            raise QueryFailed(f"the query returned more than {max_rows} rows; narrow it")
        if size > max_result_bytes:
            raise QueryFailed(
                f"the query's result is over {max_result_bytes:,} bytes; "
                "select fewer or shorter values"
            )
    return rows


def _failure_message(error: sqlite3.Error, refused: list[str]) -> str:
    """What to tell the agent about a failed query: the authorizer's first reason when it
    denied something, else sqlite's message with the bound it hit."""
    if refused:
        return refused[0]
    message = str(error)
    if "too big" in message:
        message += f" (a value may be at most {MAX_VALUE_BYTES:,} bytes)"
    elif "out of memory" in message:
        message += f" (a query may use at most {HEAP_LIMIT_BYTES >> 20} MiB)"
    return message


def _encode(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"blob": base64.b64encode(value).decode()}
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        return base64.b64decode(value["blob"])
    return value


def _serve() -> None:
    """The helper: one JSON request per stdin line, one JSON answer per stdout line."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    probe = sqlite3.connect(":memory:")
    probe.execute(f"PRAGMA hard_heap_limit = {HEAP_LIMIT_BYTES}")  # process-wide
    probe.close()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            result = run_one(
                request["path"],
                request["query"],
                request["timeout_s"],
                request["max_rows"],
                request["max_result_bytes"],
            )
            result["rows"] = [[_encode(v) for v in row] for row in result["rows"]]
            answer = {"ok": result}
        except QueryFailed as e:
            answer = {"error": str(e), "kind": e.kind}
        except MemoryError:  # SQLite's heap limit (SQLITE_NOMEM) or RLIMIT_AS
            answer = {
                "error": "the query needs more memory than a query may use (SQLite "
                f"{HEAP_LIMIT_BYTES >> 20} MiB); use fewer rows or smaller values",
                "kind": "error",
            }
        except Exception as e:  # noqa: BLE001 - e.g. a query text SQLite cannot encode
            answer = {
                "error": f"the query could not run ({type(e).__name__}: {e})"[:500],
                "kind": "error",
            }
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


# -- the parent's side -------------------------------------------------------------------


class _Worker:
    def __init__(self) -> None:
        # -I -S: no user site, no PYTHON* variables, no site-packages; the helper needs only
        # the standard library. An empty environment: it has no use for the parent's.
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={},
            close_fds=True,
            start_new_session=True,
        )
        self._buffer = b""

    def ask(self, request: dict[str, Any], deadline: float, max_bytes: int) -> dict[str, Any]:
        """The helper's answer to ``request``; raises ``_Dead`` (after killing it) when it
        does not answer by ``deadline`` or says more than ``max_bytes``."""
        try:
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            self.kill()
            raise _Dead("died") from None
        fd = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise _Dead("timeout")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                self.kill()
                raise _Dead("died")
            self._buffer += chunk
            if len(self._buffer) > max_bytes:
                self.kill()
                raise _Dead("too_big")
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass


class _Dead(Exception):
    pass


class SQLWorkerPool:
    """Up to ``max_workers`` helper processes shared by the threads of one process; each
    query takes an idle one (or starts one), and a helper that failed is replaced."""

    def __init__(self, max_workers: int = MAX_WORKERS) -> None:
        self.max_workers = max_workers
        self._idle: list[_Worker] = []
        self._count = 0
        self._cond = threading.Condition()

    def execute(
        self, path: str, query: str, *, timeout_s: float, max_rows: int, max_result_bytes: int
    ) -> tuple[list[str], list[tuple], list[str]]:
        """Runs ``query`` on the database file ``path`` in a helper process.

        Args:
          timeout_s: deadline of the query, seconds (> 0).
          max_rows, max_result_bytes: the largest result accepted (see the module docstring).

        Returns:
          ``(column names, rows as tuples, names of the tables the query read)``.

        Raises:
          QueryFailed: as ``run_one``, or the helper was killed (past its deadline, kind
            ``"timeout"``; out of memory or over the output bound, kind ``"error"``).
        """
        worker = self._take()
        request = {
            "path": path,
            "query": query,
            "timeout_s": timeout_s,
            "max_rows": max_rows,
            "max_result_bytes": max_result_bytes,
        }
        try:
            answer = worker.ask(
                request,
                time.monotonic() + timeout_s + KILL_GRACE_S,
                4 * max_result_bytes + 64 * max_rows + (1 << 16),
            )
        except _Dead as e:
            self._discard()
            if str(e) == "timeout":
                raise QueryFailed(
                    f"the query ran past its {timeout_s:g} s deadline and was stopped; simplify it",
                    "timeout",
                ) from None
            raise QueryFailed(
                "the query was stopped: it needed more memory or output than a "
                f"query may use ({WORKER_MEMORY_BYTES >> 20} MiB, "
                f"{max_result_bytes:,} bytes of result)"
            ) from None
        self._give_back(worker)
        if "error" in answer:
            raise QueryFailed(answer["error"], answer["kind"])
        result = answer["ok"]
        rows = [tuple(_decode(v) for v in row) for row in result["rows"]]
        return result["columns"], rows, result["tables"]

    def _take(self) -> _Worker:
        with self._cond:
            while not self._idle and self._count >= self.max_workers:
                self._cond.wait()
            if self._idle:
                return self._idle.pop()
            self._count += 1
        try:
            return _Worker()
        except BaseException:
            self._discard()
            raise

    def _give_back(self, worker: _Worker) -> None:
        with self._cond:
            self._idle.append(worker)
            self._cond.notify()

    def _discard(self) -> None:
        with self._cond:
            self._count -= 1
            self._cond.notify()

    def close(self) -> None:
        """Stops the idle helpers (busy ones stop when their query ends and they exit)."""
        with self._cond:
            idle, self._idle = self._idle, []
            self._count -= len(idle)
        for worker in idle:
            worker.kill()


if __name__ == "__main__":
    _serve()
