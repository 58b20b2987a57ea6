"""The chat template, tool parser and shown tools are picked in config, through the
agent's constructor arguments (env.agent_kwargs), and checked before anything starts."""

from __future__ import annotations

import pytest

from raytunix.config import ConfigError, load_config
from raytunix.models.tokenizer import Tokenizer
from raytunix.types import Task


def test_template_parser_and_tools_are_chosen_by_config():
    cfg = load_config(
        None,
        [
            "env.agent_kwargs.chat_template=chatml",
            "env.agent_kwargs.tool_parser=react",
            "env.agent_kwargs.tools=[calculator]",
            "env.agent_kwargs.system_prompt=Solve it.",
        ],
    )
    from raytunix.agents import make_agent

    tokenizer = Tokenizer.byte_level(("<|im_start|>", "<|im_end|>"))
    agent = make_agent("tool", tokenizer, **cfg.env.agent_kwargs)
    agent.reset(Task("t", "Calculate 1 + 1.", "2"), "Calculate 1 + 1.")
    prompt = tokenizer.decode(agent.token_ids)
    assert prompt.startswith(
        "<|im_start|>system\nSolve it.\n\nYou can use these tools:\n\ncalculator: "
    )
    assert prompt.endswith("<|im_start|>user\nCalculate 1 + 1.<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("env.agent_kwargs.chat_template=nope", "chat template 'nope' is neither a built-in"),
        ("env.agent_kwargs.tool_parser=xml", "tool_parser='xml' is not one of hermes"),
        ("env.agent_kwargs.tools=[nope]", "tools: unknown tool 'nope'"),
        ("env.agent_kwargs.tools=calculator", "must be a list of tool names"),
        ("env.agent_kwargs.template_kwargs=3", "must be a mapping of template variables"),
    ],
)
def test_a_bad_agent_setting_stops_at_config_time(override, fragment):
    with pytest.raises(ConfigError, match="env.agent_kwargs") as raised:
        load_config(None, [override])
    assert fragment in str(raised.value)


def test_a_model_folder_template_is_accepted_and_the_answer_agent_checks_its_template(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    cfg = load_config(None, [f"env.agent_kwargs.chat_template={tmp_path}"])
    assert cfg.env.agent_kwargs["chat_template"] == str(tmp_path)
    with pytest.raises(ConfigError, match="chat_template"):
        load_config(None, ["env.name=math_verifier", "env.agent_kwargs.chat_template=nope"])


def test_the_default_agent_keeps_the_raytunix_format():
    cfg = load_config(None)
    assert cfg.env.agent_kwargs == {}
    from raytunix.agents import make_agent

    tokenizer = Tokenizer.byte_level()
    agent = make_agent("tool", tokenizer, **cfg.env.agent_kwargs)
    agent.reset(Task("t", "Calculate 1 + 1.", "2"), "Calculate 1 + 1.")
    assert agent.token_ids == tokenizer.encode("<|user|>Calculate 1 + 1.<|end|><|assistant|>")
