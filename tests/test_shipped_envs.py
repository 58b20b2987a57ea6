"""The shipped tool-using environments, stepped with scripted actions in this process (no
Ray, no model): Python-tool math, the bash terminal, text-to-SQL, the web-API shop and
repository repair. Each: a right answer scores 1, a wrong one 0, malformed and failing
calls come back as typed tool errors; sandboxed ones run in a local sandbox."""

from __future__ import annotations

import re
import socket

import pytest

from raytunix.envs import ENVS, make_env
from raytunix.envs.python_math import TEMPLATES as MATH_TEMPLATES, PythonMathEnv
from raytunix.envs.repo_repair import PROJECTS, RepoRepairEnv
from raytunix.envs.sql_env import TextToSQLEnv, result_key, run_query
from raytunix.envs.web_api_env import HTTPGetTool, WebAPIEnv, shop_server
from raytunix.rollout.faults import Backoff
from raytunix.tools.base import ToolError
from raytunix.types import TOOL_ERRORS_KEY, Action, EpisodeStatus, Task, ToolCall, ToolErrorKind


def call(name: str, **arguments) -> Action:
    return Action(text="", tool_calls=(ToolCall(name, arguments),))


def answer(text: str) -> Action:
    return Action(text="", answer=text)


def errors(step) -> dict:
    return step.info[TOOL_ERRORS_KEY]


@pytest.mark.parametrize(
    "name", ["python_math", "bash_terminal", "text_to_sql", "web_api", "repo_repair"]
)
def test_tasks_are_seeded_sized_and_unique(name):
    env = make_env(name)
    try:
        train = env.tasks("train", 30, seed=3)
        assert train == env.tasks("train", 30, seed=3)
        assert train != env.tasks("train", 30, seed=4)
        assert len({t.task_id for t in train}) == 30
        assert env.tasks("heldout", 5, seed=3)[0].task_id == "heldout-0"
    finally:
        env.close()


@pytest.mark.parametrize("name", ["python_math", "bash_terminal", "text_to_sql", "web_api"])
def test_generated_train_and_heldout_tasks_never_meet(name):
    env = make_env(name)
    try:

        def key(task):
            return task.question, task.answer

        train = {key(t) for t in env.tasks("train", 2000, seed=0)}
        heldout = {key(t) for t in env.tasks("heldout", 100, seed=0)}
        assert len(heldout) > 10 and not train & heldout
    finally:
        env.close()


# The tool each env offers, and a valid argument name for it.
TOOL_OF = {
    "python_math": ("python", "code"),
    "bash_terminal": ("bash", "command"),
    "text_to_sql": ("sql", "query"),
    "web_api": ("http_get", "path"),
    "repo_repair": ("bash", "command"),
}


@pytest.mark.parametrize("name", sorted(TOOL_OF))
def test_malformed_turns_are_typed_tool_errors_up_to_the_limit(name):
    tool, argument = TOOL_OF[name]
    env = make_env(name, max_tool_errors=3)
    try:
        env.reset(env.tasks("train", 1, seed=0)[0])
        steps = [
            env.step(
                Action(
                    text="<tool_call>{oops",
                    parse_error="unclosed <tool_call>",
                    parse_error_kind=ToolErrorKind.BAD_JSON,
                )
            ),
            env.step(call(tool, **{argument: 42})),
            env.step(call(tool, wrong_name="x")),
            env.step(call("no_such_tool", x="1")),
        ]
        kinds = [errors(step) for step in steps]
        assert kinds == [
            {"bad_json": 1},
            {"bad_arguments": 1},
            {"bad_arguments": 1},
            {"unknown_tool": 1},
        ]
        assert "must be a string, got 42" in steps[1].observation
        assert all(not step.done for step in steps[:3])
        assert (steps[3].done, steps[3].status, steps[3].reward) == (
            True,
            EpisodeStatus.TOOL_ERROR_LIMIT,
            0.0,
        )
    finally:
        env.close()


# --- python_math ------------------------------------------------------------------------------


def test_python_math_runs_the_models_program_and_scores_the_answer():
    env = PythonMathEnv()
    try:
        task = Task("t", "What is the sum of the squares of the integers from 1 to 24?", "4900")
        env.reset(task)
        step = env.step(call("python", code="print(sum(i * i for i in range(1, 25)))"))
        assert (step.observation, step.done, errors(step)) == ("4900", False, {})
        right = env.step(answer("4900"))
        assert (right.reward, right.done, right.status) == (1.0, True, EpisodeStatus.COMPLETED)
        env.reset(task)
        assert env.step(answer("4901")).reward == 0.0
    finally:
        env.close()


def test_python_math_turns_failing_and_malformed_calls_into_tool_errors():
    env = PythonMathEnv(max_tool_errors=3)
    try:
        env.reset(Task("t", "q", "1"))
        step = env.step(call("python", code="print(1 / 0)"))
        assert errors(step) == {"tool_exception": 1} and "ZeroDivisionError" in step.observation
        step = env.step(call("python", source="print(1)"))
        assert errors(step) == {"bad_arguments": 1} and "unknown argument" in step.observation
        step = env.step(call("calculator", expression="1 + 1"))
        assert errors(step) == {"unknown_tool": 1}
        step = env.step(
            Action(
                text="", parse_error="unclosed <tool_call>", parse_error_kind=ToolErrorKind.BAD_JSON
            )
        )
        assert (step.done, step.status) == (True, EpisodeStatus.TOOL_ERROR_LIMIT)
    finally:
        env.close()


def test_python_math_generated_answers_are_what_a_program_computes():
    # Each template's stated answer, recomputed by the sandboxed program the question asks for.
    env = PythonMathEnv()
    programs = {
        "sum_of_squares": (r"from 1 to (\d+)", "print(sum(i*i for i in range(1, {0}+1)))"),
        "count_primes": (
            r"less than (\d+)",
            "print(sum(all(n % d for d in range(2, int(n**0.5)+1)) for n in range(2, {0})))",
        ),
        "modular_power": (r"(\d+) to the power (\d+), modulo (\d+)", "print(pow({0}, {1}, {2}))"),
        "gcd": (r"of (\d+) and (\d+)", "import math; print(math.gcd({0}, {1}))"),
    }
    tasks = [t for t in env.tasks("train", 60, seed=0) if t.metadata["template"] in programs]
    assert {t.metadata["template"] for t in tasks} == set(programs)
    assert set(MATH_TEMPLATES) >= set(programs)
    try:
        for task in tasks[:6]:
            pattern, program = programs[task.metadata["template"]]
            env.reset(task)
            code = program.format(*re.search(pattern, task.question).groups())
            printed = env.step(call("python", code=code)).observation
            assert env.step(answer(printed)).reward == 1.0, (task, printed)
    finally:
        env.close()
    with pytest.raises(ValueError, match="scale=5 must be an int >= 10"):
        PythonMathEnv(scale=5)


# --- bash_terminal --------------------------------------------------------------------------


def test_bash_terminal_checks_the_final_state_of_the_work_dir():
    env = make_env("bash_terminal")
    (task,) = [
        t for t in env.tasks("train", 40, seed=0) if t.metadata["template"] == "grep_errors"
    ][:1]
    try:
        env.reset(task)
        listing = env.step(call("bash", command="ls")).observation
        assert listing == "log.txt"  # the task's starting files are there
        assert (
            env.step(call("bash", command="grep ERROR log.txt > errors.txt")).observation
            == "(no output)"
        )
        failed = env.step(call("bash", command="cat missing.txt"))
        assert failed.observation.endswith("[exit code 1]") and errors(failed) == {}
        done = env.step(answer("done"))
        assert (done.reward, done.info["check_failures"]) == (1.0, [])

        env.reset(task)  # a fresh work dir: the last episode's errors.txt is gone
        env.step(call("bash", command="grep INFO log.txt > errors.txt"))
        wrong = env.step(answer("done"))
        assert wrong.reward == 0.0 and wrong.info["check_failures"][0].startswith(
            "errors.txt: content"
        )
        env.reset(task)
        assert env.step(answer("done")).info["check_failures"] == ["errors.txt: no such file"]
    finally:
        env.close()


def test_bash_terminal_state_persists_across_calls_and_directories_are_checked():
    env = make_env("bash_terminal", python_tool=True)
    task = next(t for t in env.tasks("train", 40, seed=1) if t.metadata["template"] == "make_dirs")
    first, second = task.metadata["expect"]["dirs"]
    try:
        env.reset(task)
        env.step(call("bash", command=f"mkdir -p {first}"))
        env.step(call("python", code=f"import os; os.makedirs({second!r})"))
        assert env.step(answer("done")).reward == 1.0
        env.reset(task)
        env.step(call("bash", command=f"mkdir -p {first}"))
        assert env.step(answer("done")).info["check_failures"] == [f"{second}: no such directory"]
    finally:
        env.close()


# --- text_to_sql --------------------------------------------------------------------------


def _sql_task(env: TextToSQLEnv, template: str) -> Task:
    return next(t for t in env.tasks("train", 80, seed=0) if t.metadata["template"] == template)


def test_sql_rewards_equal_result_sets_ignoring_order_unless_asked():
    env = TextToSQLEnv()
    listed = _sql_task(env, "cheaper_than")
    env.reset(listed)
    assert env.step(answer(listed.answer)).reward == 1.0
    env.reset(listed)  # another query with the same rows, in another order: still right
    assert env.step(answer(listed.answer + " ORDER BY name DESC")).reward == 1.0
    env.reset(listed)
    assert env.step(answer("SELECT name FROM products")).reward == 0.0

    ranked = _sql_task(env, "most_expensive")
    assert ranked.metadata["ordered"]
    env.reset(ranked)
    assert env.step(answer(ranked.answer)).reward == 1.0
    k = int(ranked.answer.rsplit(" ", 1)[1])
    reversed_sql = (
        f"SELECT name FROM (SELECT name, price FROM products ORDER BY price DESC "
        f"LIMIT {k}) ORDER BY price"
    )
    env.reset(ranked)
    assert env.step(answer(reversed_sql)).reward == 0.0  # the question asks for an order

    count = _sql_task(env, "orders_in_month")
    as_float = count.answer.replace("COUNT(*)", "CAST(COUNT(*) AS REAL)")
    assert as_float != count.answer
    env.reset(count)
    assert env.step(answer(as_float)).reward == 1.0  # 3 and 3.0 agree
    assert result_key([(3,)], False) == result_key([(3.0,)], False)
    (n,) = run_query(env.db_path, count.answer)[1][0]
    env.reset(count)  # the right number written down is not a query that computes it
    assert env.step(answer(f"SELECT {n}")).reward == 0.0


def test_sql_queries_run_read_only_with_a_deadline_and_typed_errors():
    env = TextToSQLEnv(query_timeout_s=0.5)
    task = _sql_task(env, "orders_from_city")
    env.reset(task)
    step = env.step(call("sql", query="SELECT COUNT(*) FROM orders"))
    assert step.observation.splitlines() == ["COUNT(*)", "300"] and errors(step) == {}
    cases = {
        "DELETE FROM orders": ("tool_exception", "read-only"),
        "UPDATE products SET price = 0": ("tool_exception", "read-only"),
        "PRAGMA query_only = OFF": ("tool_exception", "read-only"),
        "ATTACH DATABASE 'other.db' AS other": ("tool_exception", "read-only"),
        "SELECT 1; DROP TABLE orders": ("tool_exception", "one statement"),
        "SELEC name FROM products": ("tool_exception", "syntax error"),
        "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c": (
            "tool_exception",
            "recursive",
        ),
        "SELECT COUNT(*) FROM orders a, orders b, orders c, orders d": ("timeout", "deadline"),
        "SELECT zeroblob(1000)": ("tool_exception", "not allowed"),
        " ": ("bad_arguments", "empty"),
    }
    for query, (kind, words) in cases.items():
        env = TextToSQLEnv(query_timeout_s=0.5, max_tool_errors=10)
        env.reset(task)
        step = env.step(call("sql", query=query))
        assert errors(step) == {kind: 1} and words in step.observation, (query, step)
    assert run_query(env.db_path, "SELECT COUNT(*) FROM orders")[1] == [(300,)]  # nothing written
    env.reset(task)
    bad = env.step(answer("DELETE FROM orders"))
    assert bad.reward == 0.0 and bad.done and "read-only" in bad.info["error"]
    with pytest.raises(ToolError, match="more than 5 rows"):
        run_query(env.db_path, "SELECT * FROM orders", max_rows=5)


# --- web_api ----------------------------------------------------------------------------------


def test_web_api_answers_need_the_apis_prices():
    env = WebAPIEnv(catalogue_seed=2)
    task = env.tasks("train", 1, seed=0)[0]
    env.reset(task)
    total = 0
    for name, quantity in task.metadata["items"].items():
        step = env.step(call("http_get", path=f"/items?name={name}"))
        assert errors(step) == {}
        total += quantity * int(re.search(r'"price_cents": (\d+)', step.observation).group(1))
    assert f"{total / 100:.2f}" == task.answer
    assert env.step(answer(task.answer)).reward == 1.0
    env.reset(task)
    assert env.step(answer(f"{total / 100 + 1:.2f}")).reward == 0.0


def test_web_api_client_errors_are_typed():
    env = WebAPIEnv(max_tool_errors=10)
    env.reset(env.tasks("train", 1, seed=0)[0])
    cases = {
        "/items?name=unicorn": ("tool_exception", "404 no item named 'unicorn'"),
        "/orders": ("tool_exception", "404 no endpoint '/orders'"),
        "/items?name=a&name=b": ("bad_arguments", "400"),
        "items": ("bad_arguments", "must start with '/'"),
        "/items?name=a b": ("bad_arguments", "no spaces"),
    }
    for path, (kind, words) in cases.items():
        step = env.step(call("http_get", path=path))
        assert errors(step) == {kind: 1} and words in step.observation, (path, step)
    step = env.step(call("http_get", url="/items"))
    assert errors(step) == {"bad_arguments": 1}


def test_web_api_retries_server_errors_with_backoff_then_gives_a_typed_error():
    flaky = shop_server(0, failure_rate=0.5)
    tool = HTTPGetTool(
        flaky.base_url,
        timeout_s=2.0,
        backoff=Backoff(initial_delay_s=0.001, max_delay_s=0.01, max_attempts=12),
    )
    results = [tool(path="/items") for _ in range(10)]
    assert all(r.ok for r in results)  # 12 attempts at 50% each: all but surely through
    assert tool.attempts > 10  # ... and some needed a retry

    twice = Backoff(initial_delay_s=0.001, max_delay_s=0.01, max_attempts=2)
    failing = shop_server(0, failure_rate=0.999999)
    result = HTTPGetTool(failing.base_url, backoff=twice)(path="/items")
    assert result.error_kind is ToolErrorKind.TOOL_EXCEPTION
    assert "server error 503" in result.error and "after 2 attempts" in result.error

    with socket.socket() as s:  # a port nothing listens on: connection refused, retried
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    refused = HTTPGetTool(f"http://127.0.0.1:{port}", backoff=twice)(path="/items")
    assert refused.error_kind is ToolErrorKind.TOOL_EXCEPTION
    assert "connection failed" in refused.error and refused.error.endswith("(after 2 attempts)")

    slow = shop_server(0, latency_s=0.5)
    timed_out = HTTPGetTool(slow.base_url, timeout_s=0.05, backoff=twice)(path="/items")
    assert (
        timed_out.error_kind is ToolErrorKind.TIMEOUT
        and "no answer within 0.05 s" in timed_out.error
    )


# --- repo_repair ----------------------------------------------------------------------------


@pytest.mark.slow
def test_repo_repair_rewards_only_a_fix_that_passes_the_hidden_tests():
    env = RepoRepairEnv()
    try:
        for project in PROJECTS.values():
            for bug in project.bugs:  # every planted bug fails the hidden tests
                env.reset(Task("t", "q", "", {"project": project.name, "bug": bug.name}))
                step = env.step(answer("done"))
                assert step.reward == 0.0 and step.info["failures"] + step.info["errors"] > 0, bug
        project = PROJECTS["cart"]
        bug = project.bugs[0]
        env.reset(Task("t", "q", "", {"project": "cart", "bug": bug.name}))
        assert env.step(call("bash", command="ls tests")).observation == "__init__.py\ntest_cart.py"
        hidden = env.step(call("bash", command="grep -rl Hidden . || echo none"))
        assert hidden.observation.startswith("none")  # the hidden tests are not in the work dir
        fix = (
            f"import pathlib; p = pathlib.Path({bug.path!r}); "
            f"p.write_text(p.read_text().replace({bug.buggy!r}, {bug.fixed!r}))"
        )
        env.step(call("python", code=fix))
        visible = env.step(call("bash", command="python3 -m unittest 2>&1 | tail -1"))
        assert visible.observation == "OK"
        fixed = env.step(answer("done"))
        assert (fixed.reward, fixed.info["tests"], fixed.info["failures"]) == (1.0, 4, 0)
    finally:
        env.close()


def test_repo_repair_cannot_be_fooled_by_printing_a_report():
    env = RepoRepairEnv(projects=["textstats"])
    task = env.tasks("train", 1, seed=0)[0]
    try:
        env.reset(task)
        fake = 'print(\'{"tests": 4, "failures": 0, "errors": 0, "output": ""}\')\n'
        env.step(call("bash", command=f"echo {fake!r} >> textstats/__init__.py"))
        assert env.step(answer("done")).reward == 0.0
        env.reset(task)
        env.step(call("bash", command="rm -r textstats"))
        broken = env.step(answer("done"))
        assert broken.reward == 0.0 and "importing the project failed" in broken.info["test_output"]
    finally:
        env.close()
    with pytest.raises(ValueError, match=r"unknown \['django'\]"):
        RepoRepairEnv(projects=["django"])


def test_every_shipped_env_is_registered():
    assert {"python_math", "bash_terminal", "text_to_sql", "web_api", "repo_repair"} <= set(ENVS)


# --- one `raytunix train`, switched between environments by the env entries only ------------

# The tiny model and run of tests/test_byo_env.py, with room for the longest first prompt
# (text-to-SQL's schema) and no warm start (its demonstrations are arithmetic).
TINY_RUN = [
    "model.d_model=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.d_ff=64",
    "model.max_seq_len=256",
    "model.tokenizer_vocab_size=300",
    "data.train_size=32",
    "data.heldout_size=2",
    "eval.heldout_size=2",
    "warmup.enabled=false",
    "rollout.group_size=2",
    "rollout.groups_per_batch=2",
    "rollout.max_concurrent_episodes=8",
    "rollout.max_new_tokens=16",
    "engine.max_batch_size=8",
    "env.num_env_actors=1",
    "learner.checkpoint_every=1",
    "learner.rl_steps=1",
    "engine.compile_ahead=false",  # compile only the programs one step runs
]

# What changes from one environment to the next: the env entries, nothing else.
ENV_ENTRIES = {
    "math_verifier": ["env.name=math_verifier", "env.max_turns=1"],
    "calculator_math": ["env.name=calculator_math", "env.max_turns=2"],
    "python_math": ["env.name=python_math", "env.max_turns=2"],
    "bash_terminal": ["env.name=bash_terminal", "env.max_turns=2"],
    "text_to_sql": ["env.name=text_to_sql", "env.max_turns=2"],
    "web_api": ["env.name=web_api", "env.max_turns=2", "env.kwargs.failure_rate=0.2"],
    "repo_repair": ["env.name=repo_repair", "env.max_turns=2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("env_name", sorted(ENV_ENTRIES))
def test_the_same_train_command_trains_each_environment(ray_session, tmp_path, env_name):
    import json
    import os

    from raytunix.config import load_config
    from raytunix.train import train

    cfg = load_config(None, TINY_RUN + [f"run.output_dir={tmp_path}"] + ENV_ENTRIES[env_name])
    summary = train(cfg)
    with open(os.path.join(summary["run_dir"], "metrics.jsonl")) as f:
        steps = [r["step"] for r in map(json.loads, f) if r["phase"] == "rl"]
    assert steps == [1]
    assert summary["env"] == env_name
    episodes = summary["orchestrator"]
    # Every episode ran in the env actors (and, for sandboxed tools, the sandbox pool):
    # none ended because the environment or its sandbox failed.
    assert episodes["episodes_env_error"] == 0, episodes


PRESETS = {
    "python_math": "python_math",
    "bash_terminal": "bash_terminal",
    "text_to_sql": "text_to_sql",
    "web_api": "web_api",
    "repo_repair": "repo_repair",
    "default": "calculator_math",
    "single_turn": "math_verifier",
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_each_preset_names_its_env_and_its_prompts_fit_its_context(preset):
    from raytunix.agents import make_agent
    from raytunix.config import load_config, preset_names
    from raytunix.data.demonstrations import tokenizer_corpus
    from raytunix.models.tokenizer import Tokenizer

    assert preset in preset_names()
    cfg = load_config(preset, [])
    assert cfg.env.name == PRESETS[preset]
    env = make_env(cfg.env.name, **cfg.env.kwargs)
    tasks = env.tasks("train", 50, cfg.data.seed)
    if tasks is None:  # the arithmetic dataset: the default run's own checks cover it
        return
    tokenizer = Tokenizer.train(tokenizer_corpus(tasks), cfg.model.tokenizer_vocab_size)
    agent_name = env.default_agent if cfg.env.agent == "auto" else cfg.env.agent
    try:
        for task in tasks[:5]:
            agent = make_agent(agent_name, tokenizer, **cfg.env.agent_kwargs)
            agent.reset(task, env.reset(task))
            # The env's tools are the ones shown, and the prompt leaves room for two turns.
            prompt = tokenizer.decode(agent.token_ids)
            for name in getattr(env, "tools", {}):
                assert f'"name": "{name}"' in prompt, (preset, name)
            assert len(agent.token_ids) + 2 * cfg.rollout.max_new_tokens < cfg.model.max_seq_len
    finally:
        env.close()


def test_the_readme_lists_every_preset():
    import os

    from raytunix.config import preset_names

    with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")) as f:
        section = f.read().split("## Environments and presets", 1)[1].split("\n## ", 1)[0]
    listed = {
        name
        for row in section.splitlines()
        if row.startswith("| `")
        for name in row.split("|")[1].replace("`", "").replace(",", " ").split()
    }
    assert set(preset_names()) <= listed


def test_shipped_envs_run_behind_gymnasium_make():
    import gymnasium

    from raytunix.envs import register_gymnasium_ids

    register_gymnasium_ids()
    sql = gymnasium.make("raytunix/text_to_sql", num_tasks=4, seed=0)
    observation, info = sql.reset(seed=0)
    assert "Tables: customers" in observation and info["task_id"].startswith("train-")
    observation, reward, terminated, truncated, _ = sql.step(
        '<tool_call>{"name": "sql", "arguments": {"query": "SELECT COUNT(*) FROM products"}}'
        "</tool_call>"
    )
    assert observation.splitlines() == ["COUNT(*)", "24"] and not terminated
    _, reward, terminated, _, info = sql.step("<answer>SELECT 1</answer>")
    assert terminated and reward == 0.0 and info["status"] == "completed"

    bash = gymnasium.make("raytunix/bash_terminal", num_tasks=2, seed=0)
    try:
        bash.reset(seed=0)
        observation, *_ = bash.step(
            '<tool_call>{"name": "bash", "arguments": {"command": "echo hi > a.txt; cat a.txt"}}'
            "</tool_call>"
        )
        assert observation == "hi"
    finally:
        bash.close()
