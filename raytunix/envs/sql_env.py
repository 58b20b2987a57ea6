"""Text-to-SQL over a real SQLite database: the model may explore it with an ``sql`` tool,
then answers with one query; the reward compares that query's result sets with the gold
query's, on the task's database and on other instances of it that the model never sees.

The database (customers, products, orders) is generated from ``db_seed`` into a file in
each process that uses it (the same seed gives the same rows everywhere), together with
``VARIANTS`` more instances: the same tables and the same names of cities, categories and
products, other rows and sizes. The model's query must give the gold query's result on
every instance, so writing down values seen through the tool (``SELECT 42``) earns
nothing; a query that computes the answer from the tables earns 1.

Every query the model writes runs in a helper process, read-only, with memory, time and
output bounds (``raytunix.envs.sql_worker``): SQLite's length limits and a heap limit, an
authorizer that allows reads and a list of functions only, no recursive CTEs, a deadline
kept by a progress handler and by killing the helper, ``RLIMIT_AS``. The tool's
observation is capped in rows, cell width and characters, and says so.
"""

from __future__ import annotations

import atexit
import collections
import datetime
import os
import random
import shutil
import sqlite3
import tempfile
import threading
from typing import Any, Callable

from raytunix.envs.base import answered_demonstration
from raytunix.envs.sql_worker import QueryFailed, SQLWorkerPool
from raytunix.envs.tool_task import ToolTaskEnv, draw_tasks
from raytunix.registry import register
from raytunix.tools.base import Tool, ToolError
from raytunix.types import Task, ToolErrorKind

SCHEMA = (
    "Tables: customers(id, name, city); products(id, name, category, price); "
    "orders(id, customer_id, product_id, quantity, order_date 'YYYY-MM-DD')."
)

# Sizes (customers, products, orders) of the instances an answer is also checked on; they
# differ from the task's (40, 24, 300) so that counts and per-category figures differ too.
VARIANTS = ((34, 18, 260), (45, 21, 340), (38, 15, 220))

CITIES = ("Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Quebec", "Tunis", "Perth")
FIRST = (
    "Ana",
    "Ben",
    "Chen",
    "Dara",
    "Eli",
    "Fatima",
    "Goran",
    "Hana",
    "Ivan",
    "Jun",
    "Kofi",
    "Lea",
    "Mei",
    "Nina",
    "Omar",
    "Pia",
    "Raj",
    "Sara",
    "Tom",
    "Uma",
)
LAST = ("Silva", "Berg", "Okoro", "Tanaka", "Novak", "Rossi", "Haddad", "Kim", "Moreau", "Diaz")
CATEGORIES = {
    "kitchen": ("kettle", "toaster", "blender", "pan", "knife set", "teapot"),
    "garden": ("rake", "hose", "shovel", "planter", "seed tray", "watering can"),
    "office": ("stapler", "desk lamp", "notebook", "monitor stand", "pen set", "chair mat"),
    "outdoor": ("tent", "lantern", "backpack", "sleeping bag", "compass", "water bottle"),
}
MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)

MAX_ROWS = 10_000  # rows a query may return (tool or answer)
MAX_RESULT_BYTES = 1_000_000  # bytes of text and blobs a query may return
_DB_LOCK = threading.Lock()
_DB_PATHS: dict[tuple[int, int, int, int], str] = {}
_POOL = SQLWorkerPool()
atexit.register(_POOL.close)


def database_path(db_seed: int, customers: int = 40, products: int = 24, orders: int = 300) -> str:
    """Path of this process's SQLite file for ``db_seed`` and the sizes, built on first
    use (in a temp dir deleted at exit) and shared by every env of the process."""
    key = (db_seed, customers, products, orders)
    with _DB_LOCK:
        if key not in _DB_PATHS:
            directory = tempfile.mkdtemp(prefix="raytunix-sql-")
            atexit.register(shutil.rmtree, directory, ignore_errors=True)
            path = os.path.join(directory, "shop.sqlite")
            _build_database(path, random.Random(f"sql-db/{key}"), customers, products, orders)
            _DB_PATHS[key] = path
        return _DB_PATHS[key]


def variant_paths(db_seed: int) -> list[str]:
    """Paths of the ``VARIANTS`` instances an answer on ``db_seed``'s database is also
    checked on (built on first use, as ``database_path``)."""
    return [database_path(db_seed, *sizes) for sizes in VARIANTS]


def _build_database(
    path: str, rng: random.Random, n_customers: int, n_products: int, n_orders: int
) -> None:
    conn = sqlite3.connect(path)
    try:
        conn.executescript(
            "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL);"
            "CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, "
            "category TEXT NOT NULL, price REAL NOT NULL);"
            "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL "
            "REFERENCES customers(id), product_id INTEGER NOT NULL REFERENCES products(id), "
            "quantity INTEGER NOT NULL, order_date TEXT NOT NULL);"
        )
        names = rng.sample([f"{first} {last}" for first in FIRST for last in LAST], n_customers)
        conn.executemany(
            "INSERT INTO customers VALUES (?, ?, ?)",
            [(i + 1, name, rng.choice(CITIES)) for i, name in enumerate(names)],
        )
        items = [(name, cat) for cat, names_ in CATEGORIES.items() for name in names_]
        items = rng.sample(items, min(n_products, len(items)))
        # Distinct prices: "the k most expensive" has one right order.
        prices = rng.sample(range(199, 20000), len(items))
        conn.executemany(
            "INSERT INTO products VALUES (?, ?, ?, ?)",
            [
                (i + 1, name, cat, price / 100)
                for i, ((name, cat), price) in enumerate(zip(items, prices))
            ],
        )
        # The last few customers never order, so "customers without orders" is never empty.
        buyers = max(1, n_customers - 3)
        start = datetime.date(2024, 1, 1)
        conn.executemany(
            "INSERT INTO orders VALUES (?, ?, ?, ?, ?)",
            [
                (
                    i + 1,
                    rng.randint(1, buyers),
                    rng.randint(1, len(items)),
                    rng.randint(1, 5),
                    (start + datetime.timedelta(days=rng.randrange(366))).isoformat(),
                )
                for i in range(n_orders)
            ],
        )
        conn.commit()
    finally:
        conn.close()


_KINDS = {"timeout": ToolErrorKind.TIMEOUT, "bad_arguments": ToolErrorKind.BAD_ARGUMENTS}


def run_query(
    path: str,
    query: str,
    *,
    timeout_s: float = 2.0,
    max_rows: int = MAX_ROWS,
    max_result_bytes: int = MAX_RESULT_BYTES,
) -> tuple[list[str], list[tuple]]:
    """Runs one SQL statement read-only on the database at ``path``, in a helper process
    with the bounds of ``raytunix.envs.sql_worker`` (memory, time, functions, output).

    Returns:
      ``(column names, rows)``.

    Raises:
      ToolError: the statement is not a single read-only query, calls a function outside
        ``sql_worker.ALLOWED_FUNCTIONS``, is recursive, malformed, fails, or returns more
        than ``max_rows`` rows or ``max_result_bytes`` bytes (kind ``TOOL_EXCEPTION``); it
        ran past ``timeout_s`` seconds (kind ``TIMEOUT``); it is empty or too long (kind
        ``BAD_ARGUMENTS``).
    """
    try:
        columns, rows, _ = _POOL.execute(
            path, query, timeout_s=timeout_s, max_rows=max_rows, max_result_bytes=max_result_bytes
        )
    except QueryFailed as e:
        raise ToolError(f"sql: {e}", _KINDS.get(e.kind, ToolErrorKind.TOOL_EXCEPTION)) from None
    return columns, rows


def result_key(rows: list[tuple], ordered: bool) -> list | collections.Counter:
    """What two result sets are compared by: rows as tuples with numbers as floats rounded
    to 6 decimals (so 3 and 3.0 agree), in order if ``ordered``, else as a multiset.
    Column names are not compared."""

    def norm(value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return round(float(value), 6)
        return value

    normalized = [tuple(norm(v) for v in row) for row in rows]
    return normalized if ordered else collections.Counter(normalized)


class SQLQueryTool(Tool):
    """Runs a read-only SQL query on the environment's SQLite database (``run_query``) and
    shows the result: a header line of column names, then up to ``show_rows`` rows,
    ``|``-separated, each value cut at ``max_cell_chars`` characters and the whole at
    ``max_chars``; a last line says which of these caps cut something.

    Args:
      path: the database file.
      timeout_s: deadline of one query, seconds.
      show_rows: rows shown (the rest are counted).
      max_cell_chars: characters shown of one value.
      max_chars: characters of the whole observation (the last line included), >= 200.
    """

    name = "sql"
    description = "Run one read-only SQL query (SQLite) on the shop database and see its rows."
    parameters = {
        "type": "object",
        "properties": {
            "query": {
                "type": "string",
                "description": "e.g. 'SELECT name, price FROM products LIMIT 5'",
            }
        },
        "required": ["query"],
    }

    def __init__(
        self,
        path: str,
        timeout_s: float = 2.0,
        show_rows: int = 20,
        max_cell_chars: int = 200,
        max_chars: int = 4000,
    ) -> None:
        if max_chars < 200 or max_cell_chars < 1 or show_rows < 1:
            raise ValueError(
                f"show_rows={show_rows}, max_cell_chars={max_cell_chars} and "
                f"max_chars={max_chars} must be >= 1, >= 1 and >= 200"
            )
        self.path, self.timeout_s, self.show_rows = path, timeout_s, show_rows
        self.max_cell_chars, self.max_chars = max_cell_chars, max_chars

    def _cell(self, value: Any) -> tuple[str, bool]:
        text = value.hex() if isinstance(value, bytes) else str(value)
        if isinstance(value, bytes):
            text = f"x'{text}'"
        if len(text) <= self.max_cell_chars:
            return text, False
        return text[: self.max_cell_chars] + f"...(+{len(text) - self.max_cell_chars} chars)", True

    def run(self, query: str) -> str:
        columns, rows = run_query(self.path, query, timeout_s=self.timeout_s)
        notes, cut = [], False
        lines = [" | ".join(self._cell(c)[0] for c in columns)]
        for row in rows[: self.show_rows]:
            cells = [self._cell(value) for value in row]
            cut = cut or any(was_cut for _, was_cut in cells)
            lines.append(" | ".join(text for text, _ in cells))
        if not rows:
            lines.append("(no rows)")
        if len(rows) > self.show_rows:
            notes.append(f"showing {self.show_rows} of {len(rows)} rows")
        if cut:
            notes.append(f"values cut at {self.max_cell_chars} characters")
        text = "\n".join(lines)
        room = self.max_chars - 120  # for the note line
        if len(text) > room:
            text = text[:room]
            notes.append(f"output cut at {self.max_chars} characters")
        if notes:
            text += "\n(" + "; ".join(notes) + ")"
        return text


# A question template: (rng, connection) -> (question, gold SQL, ordered).
_Template = Callable[[random.Random, sqlite3.Connection], tuple[str, str, bool]]


def _column(conn: sqlite3.Connection, sql: str, *args: Any) -> list:
    """The first column of ``sql``'s rows."""
    return [row[0] for row in conn.execute(sql, args)]


def _orders_from_city(rng, conn):
    city = rng.choice(_column(conn, "SELECT DISTINCT city FROM customers ORDER BY city"))
    return (
        f"How many orders did customers from {city} place?",
        "SELECT COUNT(*) FROM orders o JOIN customers c ON o.customer_id = c.id "
        f"WHERE c.city = '{city}'",
        False,
    )


def _quantity_of_product(rng, conn):
    product = rng.choice(_column(conn, "SELECT name FROM products ORDER BY id"))
    return (
        f"What is the total quantity ordered of the {product}?",
        "SELECT SUM(o.quantity) FROM orders o JOIN products p ON o.product_id = p.id "
        f"WHERE p.name = '{product}'",
        False,
    )


def _cheaper_than(rng, conn):
    category = rng.choice(_column(conn, "SELECT DISTINCT category FROM products ORDER BY category"))
    price = rng.randint(20, 180)
    return (
        f"List the names of {category} products that cost less than {price}.",
        f"SELECT name FROM products WHERE category = '{category}' AND price < {price}",
        False,
    )


def _most_expensive(rng, conn):
    k = rng.randint(2, 4)
    return (
        f"List the names of the {k} most expensive products, most expensive first.",
        f"SELECT name FROM products ORDER BY price DESC LIMIT {k}",
        True,
    )


def _average_price(rng, conn):
    category = rng.choice(_column(conn, "SELECT DISTINCT category FROM products ORDER BY category"))
    return (
        f"What is the average price of {category} products, rounded to 2 decimals?",
        f"SELECT ROUND(AVG(price), 2) FROM products WHERE category = '{category}'",
        False,
    )


def _never_ordered(rng, conn):
    return (
        "List the names of customers who never placed an order.",
        "SELECT name FROM customers WHERE id NOT IN (SELECT customer_id FROM orders)",
        False,
    )


def _orders_in_month(rng, conn):
    month = rng.randint(1, 12)
    return (
        f"How many orders were placed in {MONTHS[month - 1]} 2024?",
        f"SELECT COUNT(*) FROM orders WHERE order_date LIKE '2024-{month:02d}-%'",
        False,
    )


def _big_orders_from_city(rng, conn):
    city = rng.choice(_column(conn, "SELECT DISTINCT city FROM customers ORDER BY city"))
    quantity = rng.randint(2, 5)
    return (
        f"How many orders of at least {quantity} units did customers from {city} place?",
        "SELECT COUNT(*) FROM orders o JOIN customers c ON o.customer_id = c.id "
        f"WHERE c.city = '{city}' AND o.quantity >= {quantity}",
        False,
    )


def _category_revenue_in_month(rng, conn):
    category = rng.choice(_column(conn, "SELECT DISTINCT category FROM products ORDER BY category"))
    month = rng.randint(1, 12)
    return (
        f"What was the revenue (quantity times price) of {category} products in "
        f"{MONTHS[month - 1]} 2024, rounded to 2 decimals?",
        "SELECT ROUND(SUM(o.quantity * p.price), 2) FROM orders o JOIN products p ON "
        f"o.product_id = p.id WHERE p.category = '{category}' AND o.order_date LIKE "
        f"'2024-{month:02d}-%'",
        False,
    )


def _products_per_category(rng, conn):
    return (
        "For each product category, how many products are in it? Give category and count.",
        "SELECT category, COUNT(*) FROM products GROUP BY category",
        False,
    )


TEMPLATES: dict[str, _Template] = {
    "big_orders_from_city": _big_orders_from_city,
    "category_revenue_in_month": _category_revenue_in_month,
    "orders_from_city": _orders_from_city,
    "quantity_of_product": _quantity_of_product,
    "cheaper_than": _cheaper_than,
    "most_expensive": _most_expensive,
    "average_price": _average_price,
    "never_ordered": _never_ordered,
    "orders_in_month": _orders_in_month,
    "products_per_category": _products_per_category,
}


@register("env", "text_to_sql")
class TextToSQLEnv(ToolTaskEnv):
    """Questions about a shop database answered with SQL (SQLite).

    A turn may call ``sql`` (``{"query": "SELECT ..."}``) to see rows, or answer with
    one query, ``<answer>SELECT ...</answer>``, which ends the episode. The reward is 1.0
    if the answer's result set equals the gold query's (``result_key``: order ignored
    unless the question asks for one, numbers compared as floats to 6 decimals, column
    names ignored) on the task's database and on each of the ``VARIANTS`` instances
    (``variant_paths``; the tool never reads those), else 0.0: an answer that writes down
    values instead of computing them from the tables matches at most the task's database.
    ``info["instances"]`` counts the instances compared, ``info["failed_instance"]``
    names the first that did not match (0 the task's, 1.. the variants). A failing,
    non-read-only or too slow answer scores 0 with the error in ``info["error"]``; the
    same from the tool is a tool error (kind ``tool_exception``, ``timeout`` past
    ``query_timeout_s``, ``bad_arguments`` for an empty query). The bounds on a query
    (memory, time, functions, output) are ``run_query``'s. Single-turn text-to-SQL is
    ``env.max_turns=1``.

    Tasks: drawn from ``TEMPLATES`` over the database's own values (cities, products,
    categories), keeping only questions whose gold result differs on at least one variant
    (else a literal would pass every instance), seeded by split and seed, train and
    held-out kept apart (``tool_task.split_of``; a template with a fixed question lands in
    one split only);
    metadata holds ``gold_sql``, ``ordered`` and ``template``; ``answer`` is the gold SQL.

    Args:
      db_seed: seed of the generated database (every actor builds the same one).
      max_tool_errors: tool errors tolerated per episode (>= 0).
      query_timeout_s: deadline of one query (tool call or answer), seconds (> 0).
      show_schema: put the tables and columns in the question (``SCHEMA``).

    Raises:
      ValueError: a non-positive ``query_timeout_s``, or see ``CalculatorMathEnv``.
    """

    default_agent = "tool"

    def __init__(
        self,
        db_seed: int = 0,
        max_tool_errors: int = 2,
        query_timeout_s: float = 2.0,
        show_schema: bool = True,
    ) -> None:
        if not query_timeout_s > 0:
            raise ValueError(f"query_timeout_s={query_timeout_s!r} must be > 0 seconds")
        self.db_path = database_path(db_seed)
        self.variant_paths = variant_paths(db_seed)
        self.query_timeout_s = query_timeout_s
        self.show_schema = show_schema
        super().__init__(
            [SQLQueryTool(self.db_path, query_timeout_s)],
            max_tool_errors=max_tool_errors,
            tool_timeout_s=None,
        )

    def tasks(self, split: str, size: int, seed: int) -> list[Task]:
        names = sorted(TEMPLATES)
        conn, *others = [
            sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            for path in [self.db_path, *self.variant_paths]
        ]

        def draw(rng: random.Random) -> tuple[str, str, dict]:
            # A question whose gold result is the same on every instance (no cheap product
            # anywhere, say) could be answered by a literal; such draws are skipped.
            for _ in range(1000):
                name = rng.choice(names)
                question, gold, ordered = TEMPLATES[name](rng, conn)
                key = result_key(conn.execute(gold).fetchall(), ordered)
                if any(
                    result_key(other.execute(gold).fetchall(), ordered) != key for other in others
                ):
                    break
            else:
                raise RuntimeError(
                    "no question tells the database instances apart; the "
                    "VARIANTS must differ from the task's database"
                )
            prompt = f"{SCHEMA}\n{question}" if self.show_schema else question
            return (
                prompt + " Answer with one SQL query.",
                gold,
                {"gold_sql": gold, "ordered": ordered, "template": name},
            )

        try:
            return draw_tasks(split, size, random.Random(f"text_to_sql/{split}/{seed}"), draw)
        finally:
            for c in (conn, *others):
                c.close()

    def demonstrate(self, task: Task) -> list[dict[str, str]] | None:
        """The expert answers the task's gold query (``metadata["gold_sql"]``) at once;
        None when the task has none or it does not score 1 (``answered_demonstration``)."""
        gold = task.metadata.get("gold_sql")
        return answered_demonstration(self, task, gold) if isinstance(gold, str) else None

    def _score(self, answer: str) -> tuple[float, dict[str, Any]]:
        ordered = bool(self.task.metadata.get("ordered"))
        rows = 0
        for instance, path in enumerate([self.db_path, *self.variant_paths]):
            _, gold = run_query(
                path, self.task.metadata["gold_sql"], timeout_s=max(self.query_timeout_s, 10.0)
            )
            try:
                _, got = run_query(path, answer, timeout_s=self.query_timeout_s)
            except ToolError as e:
                return 0.0, {
                    "correct": False,
                    "error": str(e),
                    "failed_instance": instance,
                    "instances": instance + 1,
                }
            if instance == 0:
                rows = len(got)
            if result_key(got, ordered) != result_key(gold, ordered):
                return 0.0, {
                    "correct": False,
                    "rows": rows,
                    "failed_instance": instance,
                    "instances": instance + 1,
                }
        return 1.0, {"correct": True, "rows": rows, "instances": 1 + len(self.variant_paths)}
