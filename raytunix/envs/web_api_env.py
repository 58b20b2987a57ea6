"""An environment whose tool calls a web API: a small shop catalogue served over HTTP on
localhost by the env's own process, and an ``http_get`` tool that calls it with timeouts
and bounded retries. Questions need the API's data (prices) to be answered.

    <|user|>What do 3 kettle and 2 lantern cost in total, in dollars? ...
    <|assistant|><tool_call>{"name": "http_get", "arguments": {"path": "/items?name=kettle"}}</tool_call>
    <|tool|>{"sku": "K-104", "name": "kettle", "price_cents": 2499, "stock": 7}
    ...
    <|assistant|><answer>104.95</answer>

The API (JSON bodies):

* ``GET /items`` — ``{"items": [names]}``
* ``GET /items?name=<name>`` and ``GET /items/<sku>`` — one item: ``sku``, ``name``,
  ``price_cents``, ``stock``; 404 ``{"error": ...}`` if there is none.
* anything else — 404; a malformed query — 400.
"""

from __future__ import annotations

import atexit
import http.client
import http.server
import json
import random
import socket
import threading
import time
import urllib.parse
from typing import Any

from raytunix.data.answers import score_answer
from raytunix.envs.tool_task import ToolTaskEnv, draw_tasks
from raytunix.registry import register
from raytunix.rollout.faults import Backoff
from raytunix.tools.base import Tool, ToolError
from raytunix.types import Task, ToolErrorKind

ITEMS = (
    "kettle",
    "lantern",
    "stapler",
    "teapot",
    "compass",
    "hammock",
    "notebook",
    "rake",
    "blender",
    "umbrella",
    "backpack",
    "candle",
    "mirror",
    "pillow",
    "scissors",
    "whisk",
)


def make_catalogue(seed: int) -> dict[str, dict[str, Any]]:
    """``{sku: item}`` for ``seed``: every name in ``ITEMS`` with a price of 1-60 dollars
    (in cents) and a stock count."""
    rng = random.Random(f"web_api/catalogue/{seed}")
    catalogue = {}
    for i, name in enumerate(ITEMS):
        sku = f"{name[0].upper()}-{100 + i}"
        catalogue[sku] = {
            "sku": sku,
            "name": name,
            "price_cents": rng.randint(100, 6000),
            "stock": rng.randint(0, 20),
        }
    return catalogue


class ShopServer:
    """The shop API on ``127.0.0.1`` at an ephemeral port, served by a
    ``ThreadingHTTPServer`` in a daemon thread.

    Args:
      catalogue: ``{sku: item}`` (``make_catalogue``).
      failure_rate: fraction of requests answered ``503`` at random, in [0, 1) (to
        exercise the client's retries).
      latency_s: delay before each answer, seconds (>= 0).

    Attributes:
      base_url: ``http://127.0.0.1:<port>``.
      requests: requests served so far (all answers, failures included).
    """

    def __init__(
        self,
        catalogue: dict[str, dict[str, Any]],
        failure_rate: float = 0.0,
        latency_s: float = 0.0,
    ) -> None:
        if not 0 <= failure_rate < 1:
            raise ValueError(f"failure_rate={failure_rate!r} must be in [0, 1)")
        if not latency_s >= 0:
            raise ValueError(f"latency_s={latency_s!r} must be >= 0 seconds")
        self.catalogue = catalogue
        self.by_name = {item["name"]: item for item in catalogue.values()}
        self.failure_rate, self.latency_s = failure_rate, latency_s
        self.requests = 0
        self._rng = random.Random(0)
        self._lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                status, body = server._answer(self.path)
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (its timeout); nothing to answer

            def log_message(self, *args: Any) -> None:  # no access log on stderr
                pass

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="shop-api", daemon=True
        )
        self._thread.start()

    def _answer(self, path: str) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self.requests += 1
            fail = self._rng.random() < self.failure_rate
        if self.latency_s:
            time.sleep(self.latency_s)
        if fail:
            return 503, {"error": "service unavailable, try again"}
        url = urllib.parse.urlsplit(path)
        try:
            query = urllib.parse.parse_qs(url.query, strict_parsing=bool(url.query))
        except ValueError:
            return 400, {"error": f"malformed query string {url.query!r}"}
        if url.path == "/items":
            if not query:
                return 200, {"items": sorted(self.by_name)}
            if set(query) != {"name"} or len(query["name"]) != 1:
                return 400, {"error": f"/items takes one parameter, name; got {sorted(query)}"}
            item = self.by_name.get(query["name"][0].strip().lower())
            if item is None:
                return 404, {"error": f"no item named {query['name'][0]!r}; GET /items lists them"}
            return 200, item
        if url.path.startswith("/items/"):
            item = self.catalogue.get(url.path[len("/items/") :])
            if item is None:
                return 404, {"error": f"no item with sku {url.path[len('/items/') :]!r}"}
            return 200, item
        return 404, {"error": f"no endpoint {url.path!r}; try GET /items or /items?name=<name>"}

    def close(self) -> None:
        """Stops serving and closes the socket."""
        self._httpd.shutdown()
        self._httpd.server_close()


_SERVERS: dict[tuple[int, float, float], ShopServer] = {}
_SERVERS_LOCK = threading.Lock()


def shop_server(
    catalogue_seed: int, failure_rate: float = 0.0, latency_s: float = 0.0
) -> ShopServer:
    """This process's server for these settings, started on first use and shared by every
    env of the process (each episode builds a new env); stopped at exit."""
    key = (catalogue_seed, failure_rate, latency_s)
    with _SERVERS_LOCK:
        if key not in _SERVERS:
            _SERVERS[key] = ShopServer(make_catalogue(catalogue_seed), failure_rate, latency_s)
            atexit.register(_SERVERS[key].close)
        return _SERVERS[key]


class HTTPGetTool(Tool):
    """GET a path of one HTTP API and return the response body.

    Each attempt has a deadline (``timeout_s``); a ``5xx`` answer, a refused or reset
    connection and a timeout are retried after an exponential backoff with jitter
    (``raytunix.rollout.faults.Backoff``), ``max_attempts`` attempts in all. What still
    fails is a typed tool error naming the status and the server's message: ``TIMEOUT``
    when the last attempt timed out, ``BAD_ARGUMENTS`` for a path that is not a path or
    a ``400``, ``TOOL_EXCEPTION`` otherwise (``404``, ``5xx``, connection errors).

    Args:
      base_url: ``http://host:port`` every path is appended to (the host is fixed; the
        model chooses only the path).
      timeout_s: deadline of one attempt, seconds (> 0).
      backoff: retry schedule (default: 3 attempts, 0.05 s then 0.1 s).
      max_body_chars: longest body shown.
    """

    name = "http_get"
    description = (
        "GET a path of the shop API (GET /items lists items; GET /items?name=<name> "
        "gives one item's sku, price_cents and stock) and return the JSON body."
    )
    parameters = {
        "type": "object",
        "properties": {"path": {"type": "string", "description": "e.g. '/items?name=kettle'"}},
        "required": ["path"],
    }

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 2.0,
        backoff: Backoff | None = None,
        max_body_chars: int = 2000,
    ) -> None:
        url = urllib.parse.urlsplit(base_url)
        if url.scheme != "http" or not url.hostname or url.path not in ("", "/"):
            raise ValueError(f"base_url={base_url!r} must be http://host[:port]")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0 seconds")
        self.host, self.port = url.hostname, url.port or 80
        self.timeout_s = timeout_s
        self.backoff = backoff or Backoff(initial_delay_s=0.05, max_delay_s=1.0, max_attempts=3)
        self.max_body_chars = max_body_chars
        self._rng = random.Random()
        self.attempts = 0  # every attempt so far, retries included

    def run(self, path: str) -> str:
        if not path.startswith("/") or any(c.isspace() or ord(c) < 32 for c in path):
            raise ToolError(
                f"http_get: path {path[:80]!r} must start with '/' and hold no "
                "spaces or control characters, e.g. '/items?name=kettle'",
                ToolErrorKind.BAD_ARGUMENTS,
            )
        last_error, kind = "", ToolErrorKind.TOOL_EXCEPTION
        for attempt in range(self.backoff.max_attempts):
            if attempt:
                time.sleep(self.backoff.delay_s(attempt - 1, self._rng))
            self.attempts += 1
            try:
                status, body = self._get(path)
            except (TimeoutError, socket.timeout):
                last_error, kind = f"no answer within {self.timeout_s:g} s", ToolErrorKind.TIMEOUT
                continue
            except (ConnectionError, http.client.HTTPException, OSError) as e:
                last_error, kind = (
                    f"connection failed ({type(e).__name__}: {e})",
                    ToolErrorKind.TOOL_EXCEPTION,
                )
                continue
            if status >= 500:
                last_error, kind = (
                    f"server error {status}: {_message(body)}",
                    ToolErrorKind.TOOL_EXCEPTION,
                )
                continue
            if status >= 400:
                raise ToolError(
                    f"http_get {path}: {status} {_message(body)}",
                    ToolErrorKind.BAD_ARGUMENTS if status == 400 else ToolErrorKind.TOOL_EXCEPTION,
                )
            return body[: self.max_body_chars]
        raise ToolError(
            f"http_get {path}: {last_error} (after {self.backoff.max_attempts} attempts)", kind
        )

    def _get(self, path: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            conn.request("GET", path, headers={"Accept": "application/json"})
            response = conn.getresponse()
            return response.status, response.read(1 << 20).decode("utf-8", "replace")
        finally:
            conn.close()


def _message(body: str) -> str:
    try:
        return str(json.loads(body).get("error", body))[:200]
    except (ValueError, AttributeError):
        return body[:200]


@register("env", "web_api")
class WebAPIEnv(ToolTaskEnv):
    """Shopping questions answered with prices fetched from a web API on localhost.

    A question names 2-3 items with quantities and asks for the total in dollars; prices
    are only in the API. Each episode's env uses its process's ``ShopServer`` (one per
    setting, started on first use); the ``http_get`` tool calls it (``HTTPGetTool``:
    per-attempt timeout, retries with backoff on 5xx and connection errors, typed errors).
    An ``<answer>`` ends the episode: reward 1.0 if it is the total
    (``raytunix.data.answers.score_answer``, as a number: ``104.95``), else 0.0.

    Tasks: seeded by split and seed, train and held-out kept apart
    (``tool_task.split_of``); ``answer`` is the total with two decimals and the metadata
    holds the ``items`` ``{name: quantity}``.

    Args:
      catalogue_seed: seed of the prices (every actor serves the same catalogue).
      max_tool_errors: tool errors tolerated per episode (>= 0).
      request_timeout_s: deadline of one HTTP attempt, seconds (> 0).
      max_attempts: attempts per call, retries included (>= 1).
      failure_rate: fraction of requests the server fails with 503, in [0, 1).
      latency_s: server delay per request, seconds (>= 0).

    Raises:
      ValueError: a setting out of range.
    """

    default_agent = "tool"

    def __init__(
        self,
        catalogue_seed: int = 0,
        max_tool_errors: int = 2,
        request_timeout_s: float = 2.0,
        max_attempts: int = 3,
        failure_rate: float = 0.0,
        latency_s: float = 0.0,
    ) -> None:
        self.server = shop_server(catalogue_seed, failure_rate, latency_s)
        self.tool = HTTPGetTool(
            self.server.base_url,
            request_timeout_s,
            Backoff(initial_delay_s=0.05, max_delay_s=1.0, max_attempts=max_attempts),
        )
        super().__init__([self.tool], max_tool_errors=max_tool_errors, tool_timeout_s=None)

    def tasks(self, split: str, size: int, seed: int) -> list[Task]:
        def draw(rng: random.Random) -> tuple[str, str, dict]:
            names = rng.sample(ITEMS, rng.randint(2, 3))
            quantities = {name: rng.randint(1, 5) for name in names}
            total = sum(q * self.server.by_name[n]["price_cents"] for n, q in quantities.items())
            listed = ", ".join(f"{q} {n}" for n, q in quantities.items())
            return (
                f"What do {listed} cost in total, in dollars? Prices are in the shop API.",
                f"{total / 100:.2f}",
                {"items": quantities},
            )

        return draw_tasks(split, size, random.Random(f"web_api/{split}/{seed}"), draw)

    def _score(self, answer: str) -> tuple[float, dict[str, Any]]:
        correct = score_answer(self.task, answer) == 1.0
        return (1.0 if correct else 0.0), {"correct": correct}
