"""Chat templates render as Hugging Face renders them.

The two templates below are written for this test from the public descriptions of the
formats (Qwen2.5's function-calling prompt; Llama 3.1/3.2's prompt format with JSON tool
calls), not copied from model repositories. They use what real templates use: block tags
on their own lines (``trim_blocks``/``lstrip_blocks``), ``namespace``, ``loop``,
``tojson`` with and without ``indent``, ``raise_exception``, ``strftime_now``,
``bos_token`` and ``tools``. Each is written into a model folder's
``tokenizer_config.json`` and rendered by raytunix and by ``transformers``.
"""

from __future__ import annotations

import datetime
import json

import pytest

from raytunix.models.chat_template import (
    BUILTIN_TEMPLATES,
    ChatTemplate,
    ChatTemplateError,
    chat_template_from_folder,
    load_chat_template,
)
from raytunix.models.tokenizer import Tokenizer

QWEN_STYLE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- set call = tool_call.function if tool_call.function is defined else tool_call %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- call.name }}
            {{- '", "arguments": ' }}
            {{- call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role != 'system' %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

LLAMA3_STYLE = r"""
{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0].role == 'system' %}
    {%- set system_message = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" -}}
    {% if tools is not none %}
Environment: ipython
    {% endif %}
Cutting Knowledge Date: December 2023
Today Date: {{ date_string }}

{{ system_message }}
{{- "<|eot_id|>" }}
{%- set ns = namespace(tools_shown=false) %}
{%- for message in messages %}
    {%- if message.role == 'user' and tools is not none and not ns.tools_shown %}
        {%- set ns.tools_shown = true %}
        {{- '<|start_header_id|>user<|end_header_id|>\n\n' }}
        {{- "Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\n" }}
        {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
        {{- "Do not use variables.\n\n" }}
        {%- for tool in tools %}
            {{- tool | tojson(indent=4) }}
            {{- "\n\n" }}
        {%- endfor %}
        {{- message.content | trim + '<|eot_id|>' }}
    {%- elif message.role == 'assistant' and message.tool_calls is defined %}
        {%- if message.tool_calls | length != 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {{- '{"name": "' + call.name + '", "parameters": ' }}
        {{- call.arguments | tojson }}
        {{- "}<|eot_id|>" }}
    {%- elif message.role == 'tool' or message.role == 'ipython' %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate + - * / & parentheses; 'floor' division <for integers>.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 1 + 2"}},
                "required": ["expression"],
            },
        },
    }
]
CALL = {
    "type": "function",
    "function": {"name": "calculator", "arguments": {"expression": "95 - 21 * 3"}},
}

CONVERSATIONS = {
    "user only": [{"role": "user", "content": "Calculate 95 - 21 * 3."}],
    "system and user": [
        {"role": "system", "content": "Answer in <answer> tags & be brief."},
        {"role": "user", "content": "  Wie viel ist 2 + 2? ✓ 数学\n"},
    ],
    "tool round trip": [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": "Calculate 95 - 21 * 3."},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "32"},
        {"role": "assistant", "content": "<answer>32</answer>"},
        {"role": "user", "content": "And 1 + 1?"},
    ],
    "two tool results": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "error: <|im_end|> \"quoted\""},
        {"role": "tool", "content": "32"},
    ],
}


def _model_folder(
    tmp_path, name: str, template: str, bos: str | None, eos: str, extra_tokens: tuple[str, ...]
):
    folder = tmp_path / name
    folder.mkdir()
    Tokenizer.byte_level(extra_tokens).save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
        "bos_token": bos,
        "eos_token": {"__type": "AddedToken", "content": eos, "special": True},
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("models")
    return {
        "qwen": _model_folder(
            tmp_path,
            "qwen",
            QWEN_STYLE,
            None,
            "<|im_end|>",
            ("<|im_start|>", "<|im_end|>", "<|endoftext|>"),
        ),
        "llama3": _model_folder(
            tmp_path,
            "llama3",
            LLAMA3_STYLE,
            "<|begin_of_text|>",
            "<|eot_id|>",
            ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        ),
    }


@pytest.fixture(scope="module")
def hf_tokenizers(folders):
    transformers = pytest.importorskip(
        "transformers",
        reason="transformers is not installed (pip install -e '.[test]'); "
        "the comparison with Hugging Face rendering needs it",
    )
    return {
        name: transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
        for name, folder in folders.items()
    }


@pytest.mark.parametrize("model", ["qwen", "llama3"])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_rendering_matches_transformers(
    folders, hf_tokenizers, model, conversation, with_tools, add_generation_prompt
):
    messages = CONVERSATIONS[conversation]
    tools = TOOLS if with_tools else None
    ours = load_chat_template(str(folders[model]))
    before = ours.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    theirs = hf_tokenizers[model].apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    after = ours.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    assert theirs in (before, after)  # strftime_now may cross midnight between the calls
    if model == "llama3":
        assert "Cutting Knowledge Date: December 2023\nToday Date: " in theirs
        assert theirs.startswith("<|begin_of_text|><|start_header_id|>system")
    if with_tools:
        assert "<for integers>" in theirs and "& parentheses" in theirs  # JSON, not HTML


@pytest.mark.parametrize("model", ["qwen", "llama3"])
def test_template_variables_and_errors_match_transformers(folders, hf_tokenizers, model):
    ours = load_chat_template(str(folders[model]))
    messages = CONVERSATIONS["tool round trip"][:3]
    kwargs = {"date_string": "26 Jul 2024"}  # a template variable overrides the default
    assert ours.render(messages, **kwargs) == hf_tokenizers[model].apply_chat_template(
        messages, tokenize=False, **kwargs
    )
    bad = (
        [{"role": "robot", "content": "beep"}]
        if model == "qwen"
        else [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]},
        ]
    )
    import jinja2

    with pytest.raises(jinja2.TemplateError) as theirs:
        hf_tokenizers[model].apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatTemplateError) as raised:
        ours.render(bad)
    assert str(theirs.value) in str(raised.value)


def test_generation_block_and_loop_controls_match_transformers(tmp_path, hf_tokenizers):
    import transformers

    template = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% else %}[{{ m.role }}] {{ m.content }}\n{% endif %}{% endfor %}"
    )
    folder = _model_folder(tmp_path, "m", template, None, "<|im_end|>", ("<|im_end|>",))
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "never shown"},
    ]
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    assert (
        load_chat_template(str(folder)).render(messages)
        == theirs.apply_chat_template(messages, tokenize=False)
        == "[user] a\nb"
    )


def test_folder_loading_order_and_special_tokens(tmp_path):
    folder = _model_folder(
        tmp_path, "m", "config:{{ bos_token }}{{ eos_token }}", "<s>", "</s>", ()
    )
    assert chat_template_from_folder(str(folder)).render([]) == "config:<s></s>"
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "json"}))
    assert chat_template_from_folder(str(folder)).render([]) == "json"
    (folder / "chat_template.jinja").write_text("jinja:{{ eos_token }}")
    assert chat_template_from_folder(str(folder)).render([]) == "jinja:</s>"
    # the file itself may be named
    assert chat_template_from_folder(str(folder / "tokenizer_config.json")).render([]) == (
        "config:<s></s>"
    )


def test_named_templates_pick_tool_use_when_tools_are_given(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "default", "template": "plain"},
                    {"name": "tool_use", "template": "tools:{{ tools | length }}"},
                ]
            }
        )
    )
    template = chat_template_from_folder(str(folder))
    assert template.render([]) == "plain"
    assert template.render([], tools=TOOLS) == "tools:1"


def test_bad_specs_are_named(tmp_path):
    with pytest.raises(ChatTemplateError, match="'nope'.*raytunix, chatml, qwen, llama3, gemma"):
        load_chat_template("nope")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        chat_template_from_folder(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text("[1")
    with pytest.raises(ChatTemplateError, match="not.*JSON|cannot read"):
        chat_template_from_folder(str(tmp_path))
    with pytest.raises(ChatTemplateError, match="'gemma'.*no robot role"):
        BUILTIN_TEMPLATES["gemma"].render([{"role": "robot", "content": "x"}])


def test_the_sandbox_refuses_unsafe_attribute_access():
    evil = ChatTemplate("{{ messages.__class__.__mro__ }}", name="evil")
    with pytest.raises(ChatTemplateError, match="evil"):
        evil.render([])
    mutate = ChatTemplate("{{ messages.append(1) }}", name="mutate")
    with pytest.raises(ChatTemplateError, match="mutate"):
        mutate.render([])


def test_strftime_now_can_be_pinned():
    template = ChatTemplate("{{ strftime_now('%Y-%m-%d %H:%M') }}")
    assert template.render([], now=datetime.datetime(2024, 7, 26, 9, 30)) == "2024-07-26 09:30"


@pytest.mark.parametrize(
    "name, expected",
    [
        (
            "raytunix",
            "<|system|>S<|end|><|user|>U<|end|><|assistant|>A<|end|><|tool|>7<|end|><|assistant|>",
        ),
        (
            "chatml",
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
            "<|im_start|>assistant\nA<|im_end|>\n<|im_start|>user\n<tool_response>\n7\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n",
        ),
        (
            "llama3",
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nA<|eot_id|>"
            "<|start_header_id|>ipython<|end_header_id|>\n\n7<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        (
            "gemma",
            "<bos><start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\nA"
            "<end_of_turn>\n<start_of_turn>user\n7<end_of_turn>\n<start_of_turn>model\n",
        ),
    ],
)
def test_builtin_templates_render_their_documented_formats(name, expected):
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
        {"role": "tool", "content": "7"},
    ]
    assert BUILTIN_TEMPLATES[name].render(messages, add_generation_prompt=True) == expected
