"""Stop strings end a generation at the token that completes them in the decoded text,
whatever bytes the tokens split the text into."""

import asyncio
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402
from tokenizers import models  # noqa: E402

from raytunix.inference.kv_cache import Sequence  # noqa: E402
from raytunix.inference.engine import InferenceEngine  # noqa: E402
from raytunix.inference.stops import completed_stop, stop_window  # noqa: E402
from raytunix.models import tokenizer as tokenizer_module  # noqa: E402
from raytunix.models.llama import ModelConfig, init_model  # noqa: E402
from raytunix.models.tokenizer import SPECIAL_TOKENS, Tokenizer  # noqa: E402
from raytunix.types import FinishReason, GenerationRequest, SamplingParams  # noqa: E402

BYTES = Tokenizer.byte_level()
CONFIG = ModelConfig(
    vocab_size=BYTES.vocab_size,
    d_model=16,
    n_layers=1,
    n_heads=2,
    n_kv_heads=1,
    d_ff=32,
    max_seq_len=128,
)


@pytest.fixture(scope="module")
def engine():
    graphdef, params = init_model(CONFIG, seed=0)
    return InferenceEngine(graphdef, params, CONFIG, BYTES, max_batch_size=2)


def _merged(*texts: str) -> Tokenizer:
    """A byte-level tokenizer whose only merges build each of ``texts`` (byte by byte,
    left to right) into one token, so a token can end in the middle of a character or
    hold the end of a stop string and more."""
    chars = tokenizer_module._byte_chars()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in chars:
        vocab[char] = len(vocab)
    merges = []
    for text in texts:
        pieces = [chars[b] for b in text.encode("utf-8")]
        left = pieces[0]
        for right in pieces[1:]:
            merges.append((left, right))
            left += right
            vocab.setdefault(left, len(vocab))
    tok = tokenizer_module._empty_tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return Tokenizer(tok)


def _first_stop(engine, tokenizer, stops, text, prompt="Q: "):
    """Feeds the tokens of ``text`` one at a time as ``InferenceEngine._record`` does and
    returns (number of tokens when the engine said STOP or None, the tokens)."""
    generated = tokenizer.encode(text, special_tokens=False)
    prompt_ids = tokenizer.encode(prompt, special_tokens=False)
    request = GenerationRequest(
        request_id="r",
        prompt_ids=tuple(prompt_ids),
        seed=0,
        sampling=SamplingParams(max_new_tokens=1000, stop_strings=tuple(stops)),
    )
    loop = asyncio.new_event_loop()
    seq = Sequence(
        request=request,
        future=loop.create_future(),
        seed_lo=0,
        seed_hi=0,
        order=0,
        context=list(prompt_ids),
        kv_version=0,
    )
    saved, engine._tokenizer = engine._tokenizer, tokenizer
    try:
        for n, token in enumerate(generated, start=1):
            seq.tokens.append(token)
            seq.context.append(token)
            if engine._stop_reason(seq) is FinishReason.STOP:
                return n, generated
        return None, generated
    finally:
        engine._tokenizer = saved
        loop.close()


def _tokens_to_complete(tokenizer, text, stop):
    """The fewest leading tokens of ``text`` whose decoded text contains ``stop``."""
    ids = tokenizer.encode(text, special_tokens=False)
    return next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))


@pytest.mark.parametrize(
    "stop",
    [
        "Answer:",
        "</done>",  # ASCII controls
        "→",
        "答案：",
        "🧬",
        "é",
        "e\u0301",
        "👍🏽",
        "🇯🇵",
    ],
)
def test_a_stop_string_stops_at_the_token_that_completes_it_on_byte_tokens(engine, stop):
    text = "so the final " + stop + " and more after"
    stopped_at, ids = _first_stop(engine, BYTES, [stop], text)
    assert stopped_at == _tokens_to_complete(BYTES, text, stop)
    assert BYTES.decode(ids[:stopped_at]).endswith(stop)


def test_a_stop_string_whose_end_lies_inside_a_merged_token_stops_at_that_token(engine):
    # "：(" is one token: the stop's last character is finished inside it, with text after.
    tokenizer = _merged("：(", "答案")
    text = "答案：(42)"
    ids = tokenizer.encode(text, special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids] == ["答案", "：(", "4", "2", ")"]
    stopped_at, _ = _first_stop(engine, tokenizer, ["答案："], text)
    assert stopped_at == 2


def test_a_token_that_finishes_one_character_and_starts_the_next_completes_the_stop(engine):
    # The merged token is the last byte of 🧬 and the first byte of →: the text after it
    # ends in an unfinished character, yet it is the token that completes the stop.
    tail_of_dna, head_of_arrow = "🧬".encode()[-1:], "→".encode()[:1]
    chars = tokenizer_module._byte_chars()
    straddle = chars[tail_of_dna[0]] + chars[head_of_arrow[0]]
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in chars:
        vocab[char] = len(vocab)
    vocab[straddle] = len(vocab)
    tok = tokenizer_module._empty_tokenizer(models.BPE(vocab=vocab, merges=[tuple(straddle)]))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = Tokenizer(tok)
    text = "x🧬→y"
    ids = tokenizer.encode(text, special_tokens=False)
    assert vocab[straddle] in ids
    stopped_at, _ = _first_stop(engine, tokenizer, ["🧬"], text)
    assert stopped_at == ids.index(vocab[straddle]) + 1
    assert tokenizer.decode(ids[:stopped_at]).endswith("\ufffd")  # → is not finished yet


def test_the_first_of_several_stop_strings_to_be_completed_stops(engine):
    text = "think 🤔 then say 答案：7 and then </done>"
    stops = ["</done>", "答案：", "never"]
    stopped_at, _ = _first_stop(engine, BYTES, stops, text)
    assert stopped_at == _tokens_to_complete(BYTES, text, "答案：")
    assert stopped_at < _tokens_to_complete(BYTES, text, "</done>")


def test_a_stop_string_in_the_prompt_only_does_not_stop(engine):
    stopped_at, _ = _first_stop(
        engine,
        BYTES,
        ["答案：", "</done>"],
        " 42 and nothing else",
        prompt="Write 答案： then </done>",
    )
    assert stopped_at is None
    # Nor does one that the prompt starts and the generation finishes: only generated text
    # is searched.
    stopped_at, _ = _first_stop(engine, BYTES, ["答案："], "：", prompt="Say 答案")
    assert stopped_at is None


def test_invalid_bytes_before_a_stop_string_do_not_hide_it(engine):
    garbage = [10 + 0x80, 10 + 0xE2, 10 + 0xFF, 10 + 0xF0, 10 + 0x9F]  # not UTF-8
    arrow = BYTES.encode("→ end", special_tokens=False)
    ids = garbage * 6 + arrow
    hits = [
        k
        for k in range(1, len(ids) + 1)
        if completed_stop(BYTES.decode, ids[:k], ["→"]) is not None
    ]
    assert hits == [len(garbage) * 6 + 3]


def test_the_stop_check_decodes_a_window_bounded_by_the_stop_string_not_the_generation():
    decoded_lengths = []

    def decode(ids):
        decoded_lengths.append(len(ids))
        return BYTES.decode(ids)

    stop = "🧬 done"
    ids = BYTES.encode("é" * 400 + stop, special_tokens=False)
    hits = [
        k for k in range(1, len(ids) + 1) if completed_stop(decode, ids[:k], [stop]) is not None
    ]
    assert hits == [len(ids)]
    assert max(decoded_lengths) == stop_window([stop]) + 1 < 20
