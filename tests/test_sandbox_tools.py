"""The Python and bash tools: JSON schemas like the calculator's, output as the model
reads it, typed tool errors for failures and limits, and state kept across the calls of
one episode through its work dir."""

from __future__ import annotations

import os

import pytest

from raytunix.agents.parsers import parse_action
from raytunix.envs import CalculatorMathEnv
from raytunix.sandbox import Sandbox, SandboxLimits, SandboxSession
from raytunix.tools import TOOLS, BashTool, Calculator, PythonTool, get_tool
from raytunix.types import TOOL_ERRORS_KEY, Task, ToolErrorKind

SMALL = SandboxLimits(
    wall_time_s=20.0, cpu_time_s=1.0, memory_bytes=64 << 20, max_processes=16, max_output_bytes=2048
)
QUICK = SandboxLimits(wall_time_s=2.0)  # for tests of the deadline itself


@pytest.fixture(scope="module")
def box():
    with Sandbox(SandboxLimits(wall_time_s=20.0)) as sandbox:
        yield sandbox


@pytest.fixture
def session(box):
    with SandboxSession(box) as session:
        yield session


@pytest.mark.parametrize("tool_cls, argument", [(PythonTool, "code"), (BashTool, "command")])
def test_tools_describe_themselves_with_a_json_schema_like_the_calculator(tool_cls, argument):
    schema = tool_cls(SandboxSession()).function_schema()["function"]
    assert set(schema) == set(Calculator().function_schema()["function"])
    assert schema["name"] == tool_cls.name and schema["description"]
    assert schema["parameters"] == {
        "type": "object",
        "required": [argument],
        "properties": {
            argument: {
                "type": "string",
                "description": tool_cls.parameters["properties"][argument]["description"],
            }
        },
    }
    assert TOOLS[tool_cls.name] is tool_cls


def test_python_runs_a_program_and_returns_what_it_prints(session):
    python = PythonTool(session)
    assert python(code="print(sum(range(10)))").output == "45"
    assert (
        python(code="import sys; print('out'); print('warn', file=sys.stderr)").output
        == "out\n[stderr]\nwarn"
    )
    assert python(code="x = 1").output == "(no output; print() what you want to see)"


def test_a_failing_program_is_a_tool_exception_with_its_traceback(session):
    result = PythonTool(session)(code="print('before')\n1 / 0")
    assert result.error_kind is ToolErrorKind.TOOL_EXCEPTION and not result.ok
    assert "exit code 1" in result.error and "before" in result.error
    assert "ZeroDivisionError: division by zero" in result.error


def test_files_persist_across_calls_and_between_tools_of_one_session(session):
    python, bash = PythonTool(session), BashTool(session)
    assert python(code="open('notes.txt', 'w').write('hello\\n')").ok
    assert bash(command="cat notes.txt && echo more >> notes.txt").output == "hello"
    assert python(code="print(open('notes.txt').read().split())").output == "['hello', 'more']"


def test_separate_sessions_do_not_share_files(box):
    with SandboxSession(box) as first, SandboxSession(box) as second:
        assert BashTool(first)(command="echo x > mine.txt").ok
        output = BashTool(second)(command="ls").output
    assert "mine.txt" not in output


def test_bash_reports_a_non_zero_exit_code_as_output_not_as_an_error(session):
    bash = BashTool(session)
    result = bash(command="echo partial; ls no-such-file")
    assert result.ok
    assert result.output.startswith("partial\n[stderr]\nls: cannot access 'no-such-file'")
    assert result.output.endswith("[exit code 2]")
    assert bash(command="true").output == "(no output)"
    assert (
        bash(command="cd /; export X=1").ok
        and bash(command="pwd; echo ${X:-unset}").output == f"{box_path(session)}\nunset"
    )  # cd and variables do not carry over


def box_path(session: SandboxSession) -> str:
    return session.client.workspace_path(session.workspace)


@pytest.mark.slow
def test_a_call_past_its_deadline_is_a_timeout_error_with_the_output_so_far(session):
    result = BashTool(session, limits=QUICK)(command="echo started; sleep 60")
    assert result.error_kind is ToolErrorKind.TIMEOUT
    assert result.error == (
        "bash: the command did not finish within 2 s and was stopped. Output so far:\nstarted"
    )
    result = PythonTool(session, limits=QUICK)(code="while True: pass")
    assert result.error_kind is ToolErrorKind.TIMEOUT


def test_a_memory_bomb_is_a_tool_exception_naming_the_limit(session):
    result = PythonTool(session, limits=SMALL)(code="x = bytearray(1 << 30)")
    assert result.error_kind is ToolErrorKind.TOOL_EXCEPTION
    assert "ran out of memory (limit 64 MiB of address space)" in result.error
    assert "MemoryError" in result.error


def test_a_fork_bomb_is_a_tool_error_naming_the_limit_that_stopped_it(session):
    result = PythonTool(session, limits=SMALL)(code="import os\nwhile True:\n    os.fork()")
    # The bomb's first process dies of its failed fork, or the deadline ends them all.
    assert (result.error_kind, result.error.split(".")[0]) in [
        (ToolErrorKind.TOOL_EXCEPTION, "python: the command tried to start more than 16 processes"),
        (ToolErrorKind.TIMEOUT, "python: the command did not finish within 20 s and was stopped"),
    ]


def test_long_output_is_cut_with_a_note(session):
    result = BashTool(session, limits=SMALL)(command="seq 1 100000")
    assert result.ok and len(result.output) < 2200
    assert result.output.endswith("[stdout cut: first 2048 of 588895 bytes shown]")


def test_input_longer_than_the_limit_is_refused(session):
    result = PythonTool(session, max_input_chars=10)(code="print('far too long')")
    assert result.error_kind is ToolErrorKind.TOOL_EXCEPTION
    assert "21 characters is longer than the limit of 10" in result.error


def test_wrong_argument_types_are_bad_arguments_before_anything_runs(session):
    assert PythonTool(session)(code=42).error_kind is ToolErrorKind.BAD_ARGUMENTS
    assert BashTool(session)(cmd="ls").error_kind is ToolErrorKind.BAD_ARGUMENTS
    assert session.workspace is None  # nothing was opened


def test_a_tool_built_by_name_owns_its_work_dir_and_deletes_it_on_close():
    tool = get_tool("bash")
    assert tool(command="echo hi > f && cat f").output == "hi"
    path = box_path(tool.session)
    tool.close()
    assert tool.session.workspace is None
    assert not os.path.exists(path)


def test_an_environment_runs_sandboxed_tool_calls_and_counts_their_errors(session):
    env = CalculatorMathEnv(
        max_tool_errors=5,
        tools=[PythonTool(session, limits=SMALL), BashTool(session, limits=QUICK)],
    )
    env.reset(Task("t", "What is 6 * 7?", "42"))
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
    step = env.step(parse_action(call))
    assert step.observation == "42" and step.info[TOOL_ERRORS_KEY] == {}
    call = '<tool_call>{"name": "bash", "arguments": {"command": "sleep 30"}}</tool_call>'
    step = env.step(parse_action(call))
    assert step.info[TOOL_ERRORS_KEY] == {"timeout": 1} and not step.done
    assert step.observation.startswith("error: bash: the command did not finish within 2 s")
