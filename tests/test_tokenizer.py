import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import re
import subprocess
import sys

import pytest

from raytunix.models.chat_template import (
    CHAT_TEMPLATE,
    MESSAGE_END,
    ROLES,
    message_header,
    render_chat,
)
from raytunix.models.tokenizer import SPECIAL_TOKENS, Tokenizer

BOILERPLATE = '{"name": "calculator", "arguments": {"expression": "'


def _corpus():
    texts = []
    for a in range(40):
        b = (a * 7) % 23
        texts.append(
            f"<|user|>What is {a} times {b}?<|end|><|assistant|>I will use the calculator."
            f'<tool_call>{BOILERPLATE}{a}*{b}"}}}}</tool_call><|end|>'
            f"<|tool|>{a * b}<|end|><|assistant|><answer>{a * b}</answer><|end|>"
        )
    return texts


@pytest.fixture(scope="module")
def trained():
    return Tokenizer.train(_corpus(), vocab_size=400)


@pytest.fixture(scope="module", params=["byte_level", "trained"])
def tokenizer(request, trained):
    return Tokenizer.byte_level() if request.param == "byte_level" else trained


def test_special_tokens_have_fixed_ids(tokenizer):
    for expected, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == expected
        assert tokenizer.encode(token) == [expected]
    assert tokenizer.pad_id == 0 and tokenizer.end_id == 5


def test_byte_level_vocab_covers_every_byte():
    tok = Tokenizer.byte_level()
    assert tok.vocab_size == len(SPECIAL_TOKENS) + 256
    assert tok.encode("A") == [len(SPECIAL_TOKENS) + ord("A")]
    assert len(tok.encode("é")) == 2  # two UTF-8 bytes, no merges


@pytest.mark.parametrize(
    "text",
    [
        "plain ascii, with  double spaces\tand tabs\nand newlines\n\n",
        "  leading and trailing spaces  ",
        "non-ASCII: héllo wörld — 你好, мир 🙂",
        "<|user|>mixed <tool_call>{\"a\": 1}</tool_call> text<|end|>",
        "",
    ],
)
def test_decode_inverts_encode(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("<|assistant|>forty two<|end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "forty two"


def test_every_digit_is_its_own_token(tokenizer):
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode("x12345 + 67890 = 80235.5")]
    digit_pieces = [p for p in pieces if any(c.isdigit() for c in p)]
    assert digit_pieces == list("1234567890802355")
    assert tokenizer.encode("7") == [tokenizer.token_to_id("7")]


@pytest.mark.parametrize(
    "a, b",
    [
        ("What is 3 + 4?  ", "<|end|><|assistant|>Let me think"),
        ("trailing newline\n", "<tool_call>{}</tool_call>"),
        ("héllo ", "<|end|> after"),
        ("", "<|user|>x"),
        ("<|user|>", "content with leading space and digits 12"),
    ],
)
def test_pieces_split_at_special_tokens_concatenate(tokenizer, a, b):
    assert tokenizer.encode(a + b) == tokenizer.encode(a) + tokenizer.encode(b)


def test_training_is_deterministic(trained, tmp_path):
    """Same corpus, same tokenizer, also in another process (Rust hash maps are seeded
    per process, so an order-dependent trainer would show up here)."""
    here = tmp_path / "here.json"
    there = tmp_path / "there.json"
    trained.save(str(here))
    code = (
        "import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; "
        "from test_tokenizer import _corpus; "
        "from raytunix.models.tokenizer import Tokenizer; "
        "Tokenizer.train(_corpus(), vocab_size=400).save(sys.argv[3])"
    )
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    subprocess.run(
        [sys.executable, "-c", code, os.path.dirname(tests_dir), tests_dir, str(there)], check=True
    )
    assert here.read_bytes() == there.read_bytes()


def test_merges_shorten_repeated_boilerplate(trained):
    assert trained.vocab_size > len(SPECIAL_TOKENS) + 256
    byte_count = len(BOILERPLATE.encode())
    assert len(Tokenizer.byte_level().encode(BOILERPLATE)) == byte_count
    assert len(trained.encode(BOILERPLATE)) <= byte_count // 3


def test_train_rejects_too_small_vocab():
    with pytest.raises(ValueError, match="vocab_size=100"):
        Tokenizer.train(["abc"], vocab_size=100)


def test_unknown_token_is_named():
    with pytest.raises(ValueError, match=re.escape("'<|nope|>'")):
        Tokenizer.byte_level().token_to_id("<|nope|>")


def test_save_load_round_trip(trained, tmp_path):
    path = str(tmp_path / "tokenizer.json")
    trained.save(path)
    loaded = Tokenizer.load(path)
    text = "".join(_corpus()[:3]) + " ünïcode 42"
    assert loaded.encode(text) == trained.encode(text)
    assert loaded.vocab_size == trained.vocab_size


def test_load_missing_file_names_the_path(tmp_path):
    path = str(tmp_path / "missing.json")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        Tokenizer.load(path)


def test_tokenizer_and_template_do_not_import_jax():
    code = (
        "import sys, raytunix.models.tokenizer, raytunix.models.chat_template; "
        "assert 'jax' not in sys.modules, 'jax was imported'"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )


CONVERSATION = [
    {"role": "system", "content": "You can call a calculator."},
    {"role": "user", "content": "What is 12 * 7?\n"},
    {"role": "assistant", "content": f'<tool_call>{BOILERPLATE}12*7"}}}}</tool_call>'},
    {"role": "tool", "content": " 84 "},
]


def test_render_chat_format():
    assert render_chat(CONVERSATION) == (
        "<|system|>You can call a calculator.<|end|>"
        "<|user|>What is 12 * 7?\n<|end|>"
        f'<|assistant|><tool_call>{BOILERPLATE}12*7"}}}}</tool_call><|end|>'
        "<|tool|> 84 <|end|>"
    )
    assert render_chat(CONVERSATION[:2], add_generation_prompt=True).endswith(
        "<|end|><|assistant|>"
    )
    assert render_chat([], add_generation_prompt=True) == "<|assistant|>"
    assert [message_header(r) for r in ROLES] == [
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|tool|>",
    ]
    assert "messages" in CHAT_TEMPLATE


def test_rendered_tokens_equal_per_message_tokens(tokenizer):
    pieces = []
    for message in CONVERSATION:
        pieces += tokenizer.encode(message_header(message["role"]))
        pieces += tokenizer.encode(message["content"])
        pieces += tokenizer.encode(MESSAGE_END)
    pieces += tokenizer.encode(message_header("assistant"))
    assert tokenizer.encode(render_chat(CONVERSATION, add_generation_prompt=True)) == pieces


def test_unknown_role_is_named():
    with pytest.raises(ValueError, match="'robot'"):
        render_chat([{"role": "robot", "content": "beep"}])
    with pytest.raises(ValueError, match="'robot'"):
        message_header("robot")
    with pytest.raises(ValueError, match="content"):
        render_chat([{"role": "user"}])


def test_template_itself_rejects_unknown_roles():
    from raytunix.models import chat_template

    with pytest.raises(ValueError, match="robot"):
        chat_template._TEMPLATE.render(
            messages=[{"role": "robot", "content": ""}], add_generation_prompt=False
        )
