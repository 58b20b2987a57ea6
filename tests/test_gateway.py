"""The OpenAI-compatible gateway, called with the real ``openai`` package, in front of a real
``InferenceEngine`` on the tiny model: replies are what the engine generated, the recorded
ids are the ids the engine was given and generated, call for call, and bad input is
answered without stopping the server."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import asyncio
import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from raytunix.gateway import Gateway, GatewayThread, make_renderer, segment_calls
from raytunix.gateway.protocol import GatewayError, parse_chat
from raytunix.gateway.render import EncoderRenderer, HFRenderer
from raytunix.inference.engine import InferenceEngine
from raytunix.models.chat_template import (
    BUILTIN_TEMPLATES,
    CHAT_TEMPLATE,
    ROLES,
    ChatTemplate,
    render_chat,
)
from raytunix.models.llama import ModelConfig, init_model
from raytunix.models.tokenizer import Tokenizer
from raytunix.types import FinishReason

TOKENIZER = Tokenizer.byte_level()
CONFIG = ModelConfig(
    vocab_size=TOKENIZER.vocab_size,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    max_seq_len=160,
)
GRAPHDEF, PARAMS = init_model(CONFIG, seed=0)
# The raytunix format with the tools named in one short system line, so that a prompt with
# a tool fits the tiny model's context (the default format describes tools at length).
TOOLS_TEMPLATE = ChatTemplate(
    "{%- if tools -%}<|system|>tools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "<|end|>{%- endif -%}" + CHAT_TEMPLATE,
    name="raytunix-short-tools",
    special_tokens={"bos_token": "", "eos_token": "<|end|>"},
    end_of_turn="<|end|>",
    verbatim_roles=frozenset(ROLES),
)
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Adds two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        },
    },
}


class RecordingEngine:
    """The real engine, with every request it was given and result it returned kept."""

    def __init__(self, engine):
        self.engine, self.seen = engine, []
        self.max_seq_len = engine.max_seq_len

    async def generate(self, request):
        result = await self.engine.generate(request)
        self.seen.append((request, result))
        return result

    def end_session(self, session_id):
        self.engine.end_session(session_id)


def _engine():
    return InferenceEngine(
        GRAPHDEF,
        PARAMS,
        CONFIG,
        TOKENIZER,
        max_batch_size=2,
        block_size=16,
        prefill_chunk_tokens=64,
    )


@pytest.fixture(scope="module")
def served():
    engine = RecordingEngine(_engine())
    thread = GatewayThread(
        Gateway(
            engine,
            make_renderer(TOKENIZER, TOOLS_TEMPLATE),
            vocab_size=TOKENIZER.vocab_size,
            call_timeout_s=120.0,
        )
    )
    yield thread, engine
    thread.stop()


def _client(base_url, key):
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)


def _greedy(client, messages, **kwargs):
    return client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, **{"max_tokens": 8, **kwargs}
    )


def _post(url, key, body):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url,
        data=data,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read().decode()


# -- no engine call -------------------------------------------------------------------------


def test_prompts_are_the_agents_pieces_and_a_tool_call_reply_goes_back_as_its_own_ids():
    renderer = EncoderRenderer(TOKENIZER)
    user = {"role": "user", "content": "What is 2+3?"}
    first = renderer.chat_prompt(parse_chat({"messages": [user]}, 1).messages, (), {})
    assert first == TOKENIZER.encode(render_chat([user], add_generation_prompt=True))
    reply_ids = TOKENIZER.encode(
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|end|>'
    )
    reply = renderer.reply([], reply_ids, FinishReason.STOP, (), parse_tools=True)
    assert (reply.content, reply.tool_calls, reply.finish_reason) == (
        None,
        [("add", '{"a": 2, "b": 3}')],
        "tool_calls",
    )
    known = {reply.key: reply_ids + renderer.close_turn(reply_ids, stopped=True)}
    # The program sends the call back with other spacing, then the tool's result.
    second = renderer.chat_prompt(
        parse_chat(
            {
                "messages": [
                    user,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "add", "arguments": '{"a":2,"b":3}'},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
                ]
            },
            1,
        ).messages,
        (),
        known,
    )
    assert second[: len(first) + len(reply_ids)] == first + reply_ids
    assert (
        TOKENIZER.decode(second[len(first) + len(reply_ids) :]) == "<|tool|>5<|end|><|assistant|>"
    )


def test_results_of_parallel_calls_are_rendered_as_the_template_renders_them():
    renderer = EncoderRenderer(TOKENIZER)
    calls = [
        {
            "id": f"c{i}",
            "type": "function",
            "function": {"name": "add", "arguments": f'{{"a": {i}}}'},
        }
        for i in (1, 2)
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Go."},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "tool", "tool_call_id": "c2", "content": "2"},
    ]
    ids = renderer.chat_prompt(parse_chat({"messages": messages}, 1).messages, (), {})
    # Not a reply of this episode: the calls are written as the parser reads them.
    written = (
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    )
    expected = render_chat(
        [
            *messages[:2],
            {"role": "assistant", "content": written},
            *({"role": "tool", "content": m["content"]} for m in messages[3:]),
        ],
        add_generation_prompt=True,
    )
    assert ids == TOKENIZER.encode(expected)


def test_a_named_tool_choice_opens_the_call_for_the_model_and_is_parsed_with_it():
    renderer = EncoderRenderer(TOKENIZER)
    forced = renderer.forced_prefix("add")
    assert TOKENIZER.decode(forced) == '<tool_call>{"name": "add", "arguments": '
    assert TOKENIZER.decode(renderer.forced_prefix("required")) == "<tool_call>"
    assert renderer.forced_prefix("auto") == renderer.forced_prefix("none") == []
    generated = TOKENIZER.encode('{"a": 1}}</tool_call><|end|>')
    reply = renderer.reply(forced, generated, FinishReason.STOP, (), parse_tools=True)
    assert reply.tool_calls == [("add", '{"a": 1}')] and reply.finish_reason == "tool_calls"
    not_parsed = renderer.reply(forced, generated, FinishReason.STOP, (), parse_tools=False)
    assert not_parsed.content == '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    react = EncoderRenderer(TOKENIZER, tool_parser="react")
    with pytest.raises(GatewayError, match="tool_parser=hermes"):
        react.forced_prefix("add")


def test_a_hugging_face_tokenizer_renders_with_its_own_chat_template_and_tools():
    transformers = pytest.importorskip("transformers")
    byte_level = Tokenizer.byte_level(["<|im_start|>", "<|im_end|>"])
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=byte_level._tokenizer,
        eos_token="<|im_end|>",
        chat_template=BUILTIN_TEMPLATES["chatml"].source,
    )
    renderer = make_renderer(hf)
    assert isinstance(renderer, HFRenderer) and renderer.stop_token_ids == (hf.eos_token_id,)
    messages = [
        {"role": "user", "content": "Add 2 and 3."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    call = parse_chat({"messages": messages, "tools": [ADD]}, 1)
    ids = renderer.chat_prompt(call.messages, call.tools, {})
    messages[1]["tool_calls"][0]["function"]["arguments"] = {"a": 2, "b": 3}
    expected = hf.apply_chat_template(
        messages, tools=[ADD], add_generation_prompt=True, tokenize=False
    )
    assert ids == hf.encode(expected, add_special_tokens=False)
    assert '"name": "add"' in expected and "<tool_response>\n5" in expected


def test_unknown_and_closed_keys_get_401_and_bad_fields_400_naming_them(served):
    thread, engine = served
    base_url, key = thread.gateway.open_episode()
    with pytest.raises(openai.AuthenticationError, match="is not known"):
        _client(base_url, "rtx-nope").models.list()
    client = _client(base_url, key)
    assert [m.id for m in client.models.list().data] == ["raytunix"]
    user = [{"role": "user", "content": "hi"}]
    for kwargs, param in [
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": user, "temperature": 3}, "temperature"),
        ({"messages": user, "max_tokens": 0}, "max_tokens"),
        ({"messages": user, "n": 99}, "n"),
        ({"messages": user, "logprobs": True, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": user, "stop": [""]}, "stop"),
        ({"messages": user, "tools": [{"type": "function"}]}, "tools[0]"),
        (
            {
                "messages": user,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
            },
            "tools[0].function.parameters",
        ),
        ({"messages": user, "tools": [ADD, ADD]}, "tools[1].function.name"),
        (
            {
                "messages": user,
                "tools": [ADD],
                "tool_choice": {"type": "function", "function": {"name": "mul"}},
            },
            "tool_choice",
        ),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "messages[0].role"),
    ]:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model="tiny", **kwargs)
        assert error.value.status_code == 400 and error.value.body["param"] == param
    with pytest.raises(urllib.error.HTTPError) as raw:
        _post(f"{base_url}/chat/completions", key, b"{oops")
    assert raw.value.code == 400 and b"not valid JSON" in raw.value.read()
    with pytest.raises(urllib.error.HTTPError) as raw:  # past the parser's recursion limit
        _post(f"{base_url}/chat/completions", key, b"[" * 100_000)
    assert raw.value.code == 400 and b"nests deeper" in raw.value.read()
    with pytest.raises(openai.NotFoundError):
        client.get("/nowhere", cast_to=object)
    with pytest.raises(openai.BadRequestError, match=r"prompt\[0\]"):
        client.completions.create(model="tiny", prompt=[[1, 99999]])
    assert thread.gateway.close_episode(key) == []  # refused calls are not recorded
    with pytest.raises(KeyError, match="not the key of an open episode"):
        thread.gateway.close_episode(key)
    with pytest.raises(RuntimeError, match="not running"):
        Gateway(engine, make_renderer(TOKENIZER)).open_episode()
    with pytest.raises(ValueError, match="call_timeout_s"):
        Gateway(engine, make_renderer(TOKENIZER), call_timeout_s=0)
    with pytest.raises(openai.AuthenticationError, match="ended"):
        client.models.list()


# -- through the engine -----------------------------------------------------------------------


@pytest.mark.slow
def test_a_chat_call_returns_what_the_engine_generated_and_records_its_exact_ids(served):
    thread, engine = served
    base_url, key = thread.gateway.open_episode(seed=3)
    reply = _greedy(
        _client(base_url, key), [{"role": "user", "content": "Hello there."}], logprobs=True
    )
    request, result = engine.seen[-1]
    [call] = thread.gateway.close_episode(key)
    assert (
        call.prompt_ids
        == request.prompt_ids
        == tuple(TOKENIZER.encode(render_chat([{"role": "user", "content": "Hello there."}], True)))
    )
    assert call.choices[0].token_ids == result.token_ids and len(result.token_ids) <= 8
    assert call.choices[0].logprobs == result.logprobs
    assert call.choices[0].policy_versions == result.policy_versions == (0,) * len(result.token_ids)
    ids = list(result.token_ids)
    if result.finish_reason == FinishReason.STOP:
        ids = ids[:-1]  # the end-of-turn token is not content
    assert reply.choices[0].message.content == TOKENIZER.decode(ids)
    assert [e.logprob for e in reply.choices[0].logprobs.content] == list(result.logprobs)
    assert reply.usage.prompt_tokens == len(request.prompt_ids)
    assert reply.usage.completion_tokens == len(result.token_ids)


@pytest.mark.slow
def test_greedy_streamed_text_equals_the_text_of_the_same_call_not_streamed(served):
    thread, _ = served
    base_url, key = thread.gateway.open_episode()
    messages = [{"role": "user", "content": "Count: 1 2 3"}]
    plain = _greedy(_client(base_url, key), messages, max_tokens=12)

    async def streamed():
        client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
        stream = await client.chat.completions.create(
            model="tiny",
            messages=messages,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, finish, usage = [], None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        await client.close()
        return "".join(pieces), finish, usage

    text, finish, usage = asyncio.run(streamed())
    assert text == plain.choices[0].message.content
    assert finish == plain.choices[0].finish_reason
    assert usage.completion_tokens == plain.usage.completion_tokens
    raw = _post(
        f"{base_url}/chat/completions",
        key,
        {"messages": messages, "temperature": 0, "max_tokens": 4, "stream": True},
    )
    events = [line for line in raw.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"
    thread.gateway.close_episode(key)


@pytest.mark.slow
def test_a_tool_conversation_is_one_segment_and_a_rewritten_history_starts_another(served):
    thread, engine = served
    messages = [{"role": "user", "content": "Add 2 and 3."}]
    probe_url, probe_key = thread.gateway.open_episode()
    probe = _greedy(_client(probe_url, probe_key), messages, tools=[ADD], max_tokens=6)
    thread.gateway.close_episode(probe_key)
    # A stop string cuts the reply's text inside a token: only the gateway's own ids, put
    # back for the returned message, make the next prompt extend this one.
    stop = probe.choices[0].message.content[1:3]
    base_url, key = thread.gateway.open_episode(seed=5)
    client = _client(base_url, key)
    first = _greedy(client, messages, tools=[ADD], max_tokens=6, stop=[stop])
    assert first.choices[0].finish_reason == "stop"
    message = first.choices[0].message.model_dump(exclude_none=True)
    messages += [message, {"role": "tool", "tool_call_id": "call_0", "content": "5"}]
    second = _greedy(client, messages, tools=[ADD], max_tokens=6)
    # The program drops the tool exchange and asks again: the history was rewritten.
    _greedy(
        client, [messages[0], {"role": "user", "content": "Just say 5."}], tools=[ADD], max_tokens=4
    )
    calls = thread.gateway.close_episode(key)
    seen = engine.seen[-3:]
    assert [c.prompt_ids for c in calls] == [r.prompt_ids for r, _ in seen]
    assert [c.choices[0].token_ids for c in calls] == [r.token_ids for _, r in seen]
    assert TOKENIZER.decode(calls[0].prompt_ids).startswith("<|system|>tools: add<|end|>")
    assert seen[1][1].num_cached_tokens > 0  # the second turn reused the session's KV
    assert second.choices[0].finish_reason in ("stop", "length")
    conversation, rewritten = segment_calls(calls)
    assert conversation.calls == [(0, 0), (1, 0)] and rewritten.calls == [(2, 0)]
    expected = list(seen[0][0].prompt_ids) + list(seen[0][1].token_ids)
    assert conversation.token_ids[: len(expected)] == expected
    assert conversation.token_ids == list(seen[1][0].prompt_ids) + list(seen[1][1].token_ids)
    assert sum(conversation.loss_mask) == len(seen[0][1].token_ids) + len(seen[1][1].token_ids)
    assert rewritten.token_ids == list(seen[2][0].prompt_ids) + list(seen[2][1].token_ids)
    # For people to read (the sample log): the conversation as sent, the reply as answered.
    assert [m["role"] for m in calls[1].messages] == ["user", "assistant", "tool"]
    assert calls[1].messages[2]["content"] == "5"
    reply, text = second.choices[0].message, calls[1].choices[0].text
    assert (reply.content or "").strip("\n") in text
    assert all(f"{c.function.name}(" in text for c in reply.tool_calls or [])
    assert conversation.transcript[:-1] == [dict(m) for m in calls[1].messages]


@pytest.mark.slow
def test_n_samples_stop_strings_and_max_tokens_are_served_and_recorded(served):
    thread, engine = served
    base_url, key = thread.gateway.open_episode(seed=11)
    client = _client(base_url, key)
    user = [{"role": "user", "content": "Tell me."}]
    sampled = client.chat.completions.create(
        model="tiny", messages=user, n=2, temperature=1.0, max_tokens=5, seed=42
    )
    requests = [r for r, _ in engine.seen[-2:]]
    assert len(sampled.choices) == 2 and requests[0].seed != requests[1].seed
    long = _greedy(client, user, max_tokens=7)
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == 7
    text = long.choices[0].message.content
    stop = text[3:5]
    cut = _greedy(client, user, max_tokens=7, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.find(stop)]
    completion = client.completions.create(
        model="tiny", prompt=[11, 12, 13], max_tokens=3, temperature=0
    )
    _greedy(
        client,
        user,
        tools=[ADD],
        max_tokens=3,
        tool_choice={"type": "function", "function": {"name": "add"}},
    )
    forced_request, _ = engine.seen[-1]
    calls = thread.gateway.close_episode(key)
    assert [len(c.choices) for c in calls] == [2, 1, 1, 1, 1]
    assert TOKENIZER.decode(calls[-1].prompt_ids).endswith(
        '<|assistant|><tool_call>{"name": "add", "arguments": '
    )
    assert calls[-1].prompt_ids == forced_request.prompt_ids
    calls = calls[:-1]
    assert calls[-1].prompt_ids == (11, 12, 13) and calls[-1].endpoint == "completions"
    assert completion.choices[0].text == TOKENIZER.decode(list(calls[-1].choices[0].token_ids))


@pytest.mark.slow
def test_concurrent_calls_of_one_episode_are_all_served_and_one_holds_the_session(served):
    thread, engine = served
    base_url, key = thread.gateway.open_episode()

    async def both():
        client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
        replies = await asyncio.gather(
            *(
                client.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": text}],
                    temperature=0,
                    max_tokens=4,
                )
                for text in ("One?", "Two?")
            )
        )
        await client.close()
        return replies

    replies = asyncio.run(both())
    calls = thread.gateway.close_episode(key)
    requests = {r.request_id: r for r, _ in engine.seen[-2:]}
    assert len(replies) == 2 and len(calls) == 2
    sessions = [requests[c.choices[0].request_id].session_id for c in calls]
    assert sorted(s is None for s in sessions) == [False, True]  # one request per session
    assert {c.prompt_ids for c in calls} == {r.prompt_ids for r in requests.values()}


@pytest.mark.slow
def test_deadline_engine_failure_and_long_prompts_are_answered_and_serving_goes_on(served):
    thread, engine = served
    gateway = thread.gateway
    base_url, key = gateway.open_episode()
    client = _client(base_url, key)
    user = [{"role": "user", "content": "hi"}]
    gateway.call_timeout_s = 0.5
    thread.run(engine.engine.pause())  # requests wait until resume: the deadline passes
    try:
        with pytest.raises(openai.APIStatusError) as error:
            _greedy(client, user)
        assert error.value.status_code == 504
    finally:
        thread.loop.call_soon_threadsafe(engine.engine.resume)
        gateway.call_timeout_s = 120.0
    # A call in flight when its episode is closed is refused and not recorded.
    other_url, other_key = gateway.open_episode()
    thread.run(engine.engine.pause())
    pending = concurrent.futures.ThreadPoolExecutor(1).submit(
        _greedy, _client(other_url, other_key), user
    )
    while not engine.engine.stats()["waiting"] and not pending.done():
        time.sleep(0.01)
    assert gateway.close_episode(other_key) == []
    thread.loop.call_soon_threadsafe(engine.engine.resume)
    with pytest.raises(openai.AuthenticationError, match="ended while this call ran"):
        pending.result(timeout=120)
    with pytest.raises(openai.BadRequestError, match="the prompt has .* tokens"):
        _greedy(client, [{"role": "user", "content": "x" * 400}])  # rendered, then measured
    # Text too long whatever it encodes to is refused before it is rendered or encoded.
    huge = "x" * 20_000_000
    with pytest.raises(openai.BadRequestError, match=r"20000000 characters, at least \d+ tok"):
        _greedy(
            client,
            [
                {"role": "user", "content": huge[:10_000_000]},
                {"role": "user", "content": huge[10_000_000:]},
            ],
        )
    with pytest.raises(openai.BadRequestError, match="prompt hold 20000000 characters"):
        client.completions.create(model="tiny", prompt=huge, max_tokens=2)
    assert _greedy(client, user, max_tokens=2).usage.completion_tokens >= 1
    assert len(gateway.close_episode(key)) == 1  # only the answered call

    closed = _engine()
    asyncio.run(closed.close())
    broken = GatewayThread(Gateway(closed, make_renderer(TOKENIZER)))
    try:
        broken_url, broken_key = broken.gateway.open_episode()
        with pytest.raises(openai.APIStatusError) as error:
            _greedy(_client(broken_url, broken_key), user)
        assert error.value.status_code == 503 and "closed" in error.value.message
        assert [m.id for m in _client(broken_url, broken_key).models.list().data] == ["raytunix"]
    finally:
        broken.stop()
