"""The text-to-SQL tool and answer check are bounded in memory, time and output: a query,
through the ``sql`` tool or as the final answer, cannot make the environment's process
allocate hundreds of MB (its peak RSS grows by less than 100 MB, or the query is refused),
and the tool's observation is small and says what was cut.

Each memory check runs in a fresh child process (the env actor's stand-in) that reports
its peak RSS (``ru_maxrss``) before and after one step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from raytunix.envs import sql_worker
from raytunix.envs.sql_env import SQLQueryTool, TextToSQLEnv, database_path, run_query
from raytunix.tools.base import ToolError
from raytunix.types import Action, ToolCall

MB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_STEP = r'''
import json, os, resource
from raytunix.envs.sql_env import TextToSQLEnv
from raytunix.types import Action, ToolCall
query, via = os.environ["QUERY"], os.environ["VIA"]
env = TextToSQLEnv(query_timeout_s=2.0)
env.reset(env.tasks("train", 1, seed=0)[0])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
if via == "tool":
    step = env.step(Action(text="", tool_calls=(ToolCall("sql", {"query": query}),)))
else:
    step = env.step(Action(text="", answer=query))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("RESULT:" + json.dumps({"rss_growth": after - before, "observation": step.observation,
      "tool_errors": step.info.get("tool_errors"), "error": step.info.get("error"),
      "reward": step.reward}))
'''


def _step_in_child(query: str, via: str) -> dict:
    env = {
        **os.environ,
        "QUERY": query,
        "VIA": via,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    out = subprocess.run(
        [sys.executable, "-c", _STEP],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT:")), None)
    assert line is not None, out.stderr[-3000:]
    return json.loads(line[len("RESULT:") :])


def test_a_tool_observation_of_a_20_mb_value_is_small():
    out = _step_in_child("SELECT zeroblob(20000000)", "tool")
    assert len(out["observation"]) <= 4000
    assert out["tool_errors"] == {"tool_exception": 1} and "zeroblob" in out["observation"]


# The case's value bombs (functions that make large values from small arguments), and
# bombs made of allowed parts: a sort, a DISTINCT and a group_concat over a cross join.
BOMBS = [
    "SELECT length(hex(zeroblob(200000000)))",
    "SELECT length(printf('%.*c', 400000000, 'x'))",
    "SELECT count(*) FROM (SELECT a.order_date || b.order_date || c.order_date AS k "
    "FROM orders a, orders b, orders c ORDER BY k)",
    "SELECT count(*) FROM (SELECT DISTINCT a.id * 1000000 + b.id * 1000 + c.id "
    "FROM orders a, orders b, orders c)",
    "SELECT length(group_concat(a.order_date || b.order_date)) FROM orders a, orders b, orders c",
]


@pytest.mark.slow
@pytest.mark.parametrize("via", ["tool", "answer"])
@pytest.mark.parametrize("query", BOMBS)
def test_one_query_cannot_allocate_hundreds_of_mb_in_the_env_process(query, via):
    out = _step_in_child(query, via)
    assert out["rss_growth"] < 100 * MB, out
    if via == "tool":
        assert sum(out["tool_errors"].values()) == 1, out  # refused, with the reason
        assert len(out["observation"]) <= 4000
    else:
        assert out["reward"] == 0.0 and out["error"], out


def test_the_tool_shows_capped_rows_cells_and_characters_and_says_so():
    tool = SQLQueryTool(database_path(0), show_rows=5, max_cell_chars=30, max_chars=400)
    text = tool.run("SELECT id, group_concat(order_date) FROM orders GROUP BY customer_id")
    assert len(text) <= 400
    assert "showing 5 of" in text and "values cut at 30 characters" in text
    wide = tool.run("SELECT " + ", ".join(f"'{'y' * 25}' AS c{i}" for i in range(40)))
    assert len(wide) <= 400 and "output cut at 400 characters" in wide
    assert tool.run("SELECT x'00ff'").splitlines()[1] == "x'00ff'"
    assert tool.run("SELECT name FROM products WHERE 0").splitlines()[1] == "(no rows)"
    with pytest.raises(ValueError, match="max_chars"):
        SQLQueryTool(database_path(0), max_chars=10)


def test_results_over_the_row_or_byte_bound_are_errors_not_truncations():
    path = database_path(0)
    with pytest.raises(ToolError, match="more than 5 rows"):
        run_query(path, "SELECT * FROM orders", max_rows=5)
    with pytest.raises(ToolError, match="over 1,000 bytes"):
        run_query(path, "SELECT order_date FROM orders", max_result_bytes=1000)
    with pytest.raises(ToolError, match="too big"):  # SQLITE_LIMIT_LENGTH
        run_query(
            path,
            "SELECT length(group_concat(a.order_date || b.order_date)) FROM orders a, orders b",
        )


def test_a_helper_that_does_not_answer_in_time_is_killed_and_replaced():
    pool = sql_worker.SQLWorkerPool(max_workers=1)
    path = database_path(0)
    try:
        # The progress handler would stop this at the deadline; a deadline of ~0 left to
        # the handler and a grace of 0 make the parent's kill the one that acts.
        grace, sql_worker.KILL_GRACE_S = sql_worker.KILL_GRACE_S, -0.5
        try:
            with pytest.raises(sql_worker.QueryFailed, match="deadline") as caught:
                pool.execute(
                    path,
                    "SELECT COUNT(*) FROM orders a, orders b, orders c, orders d",
                    timeout_s=1.0,
                    max_rows=10,
                    max_result_bytes=1000,
                )
            assert caught.value.kind == "timeout"
        finally:
            sql_worker.KILL_GRACE_S = grace
        columns, rows, tables = pool.execute(
            path, "SELECT COUNT(*) FROM orders", timeout_s=2.0, max_rows=10, max_result_bytes=1000
        )
        assert rows == [(300,)]  # a fresh helper answered
    finally:
        pool.close()


def test_functions_outside_the_list_and_recursive_ctes_are_refused_by_name():
    env = TextToSQLEnv(max_tool_errors=10)
    env.reset(env.tasks("train", 1, seed=0)[0])
    for query, words in [
        ("SELECT randomblob(5)", "randomblob() is not allowed"),
        ("SELECT printf('%d', 1)", "printf() is not allowed"),
        ("SELECT load_extension('x')", "load_extension() is not allowed"),
        (
            "WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x FROM r) SELECT x FROM r LIMIT 1",
            "recursive",
        ),
        ("SELECT " + "1 + " * 6000 + "1", "characters"),
    ]:
        step = env.step(Action(text="", tool_calls=(ToolCall("sql", {"query": query}),)))
        assert words in step.observation, (query[:60], step.observation)
    allowed = "SELECT upper(name), round(avg(price), 2) FROM products GROUP BY name LIMIT 1"
    ok = env.step(Action(text="", tool_calls=(ToolCall("sql", {"query": allowed}),)))
    assert not ok.info["tool_errors"], ok.observation
