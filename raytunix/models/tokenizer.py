"""Byte-level BPE tokenizer with the raytunix special tokens.

Text is split into pre-tokens by the GPT-2 byte-level regex, with every digit its own
pre-token (so numbers are spelled digit by digit), then mapped to bytes, so any string
round-trips through ``encode``/``decode``. The special tokens below are matched in the
text before anything else, so a text made of pieces that meet at a special token
tokenizes to the concatenation of the pieces' tokenizations: an agent may tokenize each
message as it arrives and get exactly the ids of the rendered conversation.

Text that did not come from us (observations, tool output, task questions) is encoded
with ``special_tokens=False``: a special-token string in it stays plain bytes, so nothing
an environment writes can close a message or open a turn.

A model folder's own tokenizer (a Hugging Face ``tokenizer.json`` with its special tokens
named in ``tokenizer_config.json`` and ``generation_config.json``) is read with
``Tokenizer.from_folder``; it keeps that model's vocabulary and special tokens instead of
the ones below.

This module does not import JAX; environment and agent processes use it.
"""

from __future__ import annotations

import functools

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = (
    "<|pad|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|end|>",
    "<tool_call>",
    "</tool_call>",
    "<answer>",
    "</answer>",
)
"""Special tokens, with ids 0..9 in this order in every raytunix tokenizer."""

# Tokens a pre-tokenizer may add to a text (a prefix space or a metaspace, in up to three
# byte-fallback tokens, and one more for safety).
PREFIX_TOKENS_BOUND = 4


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _byte_chars() -> list[str]:
    """The character that byte-level BPE uses for each byte value 0..255, in byte order.

    Printable Latin-1 bytes stand for themselves; the others are shifted to code points
    256 and up (the GPT-2 ``bytes_to_unicode`` table, Radford et al. 2019).
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + shifted)
            shifted += 1
    return [chars[byte] for byte in range(256)]


def _empty_tokenizer(model: models.Model) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    return tok


def _plain_text_copy(tok: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    """The same vocabulary and merges, but special-token strings are encoded as text."""
    plain = tokenizers.Tokenizer.from_str(tok.to_str())
    plain.encode_special_tokens = True
    return plain


class Tokenizer:
    """Wraps ``tokenizers.Tokenizer``; ids are plain Python ints.

    Build one with ``train`` (BPE merges learned from a corpus), ``byte_level`` (no
    merges), ``load`` (a ``tokenizer.json`` written by ``save``) or ``from_folder`` (a
    Hugging Face model folder's tokenizer).
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        pad_id: int | None = None,
        end_id: int | None = None,
        stop_ids: Sequence[int] = (),
    ):
        """Wraps an existing ``tokenizers.Tokenizer``.

        Args:
          tokenizer: the tokenizer.
          pad_id, end_id: the padding id and the end-of-sequence id, for a tokenizer that
            is not a raytunix one (a model folder's); both or neither. Neither: the
            tokenizer must hold ``SPECIAL_TOKENS`` at ids 0..9, and ``<|pad|>`` and
            ``<|end|>`` are the padding and end ids.
          stop_ids: further ids that end a generation besides ``end_id`` (a model's other
            end-of-sequence tokens).

        Raises:
          ValueError: the special tokens are missing or not at ids 0..9 in the order of
            ``SPECIAL_TOKENS`` (without ``pad_id``/``end_id``), only one of
            ``pad_id``/``end_id`` is given, or an id is outside the vocabulary.
        """
        if (pad_id is None) != (end_id is None):
            raise ValueError(
                f"Tokenizer: pad_id={pad_id} and end_id={end_id} go together; "
                "give both (a model's own tokenizer) or neither (a raytunix one)."
            )
        if pad_id is None:
            for expected_id, token in enumerate(SPECIAL_TOKENS):
                got = tokenizer.token_to_id(token)
                if got != expected_id:
                    raise ValueError(
                        f"Special token {token!r} has id {got}, expected {expected_id}; a "
                        "raytunix tokenizer must hold SPECIAL_TOKENS at ids 0..9. Build it "
                        "with Tokenizer.train or Tokenizer.byte_level, or read a model's own "
                        "with Tokenizer.from_folder."
                    )
            pad_id, end_id = SPECIAL_TOKENS.index("<|pad|>"), SPECIAL_TOKENS.index("<|end|>")
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        for name, value in (
            ("pad_id", pad_id),
            ("end_id", end_id),
            *(("stop_ids", i) for i in stop_ids),
        ):
            if not isinstance(value, int) or not 0 <= value < size:
                raise ValueError(
                    f"Tokenizer: {name} {value!r} is not an id of this {size}-token vocabulary."
                )
        self._tokenizer = tokenizer
        self._plain = _plain_text_copy(tokenizer)
        self._pad_id, self._end_id = pad_id, end_id
        self._stop_ids = tuple(dict.fromkeys([end_id, *stop_ids]))

    def __getstate__(self) -> dict:
        return {
            "tokenizer": self._tokenizer,
            "pad_id": self._pad_id,
            "end_id": self._end_id,
            "stop_ids": self._stop_ids,
        }

    def __setstate__(self, state: dict) -> None:
        # Rebuilt, not pickled: ``encode_special_tokens`` does not survive a pickle.
        self._tokenizer = state["tokenizer"]
        self._plain = _plain_text_copy(self._tokenizer)
        self._pad_id, self._end_id = state["pad_id"], state["end_id"]
        self._stop_ids = state["stop_ids"]

    @classmethod
    def train(cls, corpus: Iterable[str], vocab_size: int = 512) -> Tokenizer:
        """Learns byte-level BPE merges from ``corpus``.

        The same corpus (same order) always gives the same tokenizer.

        Args:
          corpus: texts to learn merges from.
          vocab_size: size of the final vocabulary, special tokens and the 256 byte
            tokens included; training stops early when no pair is left to merge.

        Raises:
          ValueError: if ``vocab_size`` is smaller than 266 (10 special + 256 byte tokens).
        """
        minimum = len(SPECIAL_TOKENS) + 256
        if vocab_size < minimum:
            raise ValueError(
                f"vocab_size={vocab_size} is too small: it must be at least {minimum} "
                f"({len(SPECIAL_TOKENS)} special tokens + 256 byte tokens)."
            )
        tok = _empty_tokenizer(models.BPE())
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(corpus, trainer=trainer)
        return cls(tok)

    @classmethod
    def byte_level(cls, extra_special_tokens: Sequence[str] = ()) -> Tokenizer:
        """A tokenizer without merges: the special tokens (ids 0..9) and one token per
        byte (byte value b has id 10 + b).

        Args:
          extra_special_tokens: more special tokens, with ids 266, 267, ... in this order
            (e.g. a chat template's ``<|im_start|>`` and ``<|im_end|>``).

        Raises:
          ValueError: an extra token repeats one of ``SPECIAL_TOKENS`` or another extra.
        """
        extra = list(extra_special_tokens)
        clash = [t for t in extra if t in SPECIAL_TOKENS or extra.count(t) > 1]
        if clash:
            raise ValueError(
                f"extra_special_tokens {clash} repeat a special token; list each new token once."
            )
        vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
        for char in _byte_chars():
            vocab[char] = len(vocab)
        for token in extra:
            vocab[token] = len(vocab)
        tok = _empty_tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.add_special_tokens([*SPECIAL_TOKENS, *extra])
        return cls(tok)

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; no BOS or EOS is added.

        Args:
          special_tokens: True: special-token strings in ``text`` map to their ids (for
            text we write: chat headers, demonstrations). False: they are encoded as the
            plain text they are (for text from an environment, a tool or a dataset), so
            the ids never contain a special token.
        """
        encoder = self._tokenizer if special_tokens else self._plain
        return encoder.encode(text, add_special_tokens=False).ids

    def count_tokens(self, texts: Sequence[str], special_tokens: bool = False) -> list[int]:
        """``[len(encode(t, special_tokens)) for t in texts]``, encoded as one batch (the
        tokenizers library spreads it over threads). A lone surrogate is counted as
        U+FFFD, as agents encode it."""
        encoder = self._tokenizer if special_tokens else self._plain
        texts = [t.encode("utf-8", "replace").decode("utf-8") for t in texts]
        batch = getattr(encoder, "encode_batch_fast", encoder.encode_batch)  # no offsets
        return [len(e.ids) for e in batch(texts, add_special_tokens=False)]

    def token_count_bounds(self, texts: Sequence[str]) -> list[int] | None:
        """An upper bound on ``count_tokens(texts)`` per text without tokenizing: the text's
        UTF-8 bytes plus ``PREFIX_TOKENS_BOUND``, or None when the tokenizer has a
        normalizer (which may lengthen text: NFKC, lower-casing). Without one, every token
        stands for at least one byte of the text (a byte-level or byte-fallback token) or
        one character (a vocabulary piece, an unknown token), and the pre-tokenizer adds at
        most a prefix space or metaspace."""
        if self._tokenizer.normalizer is not None:
            return None
        return [len(t.encode("utf-8", "replace")) + PREFIX_TOKENS_BOUND for t in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; bytes that do not form valid UTF-8 become U+FFFD."""
        return self._tokenizer.decode(
            [int(i) for i in ids], skip_special_tokens=skip_special_tokens
        )

    def token_to_id(self, token: str) -> int:
        """Id of one token string, e.g. ``"<|end|>"``.

        Raises:
          ValueError: if ``token`` is not in the vocabulary.
        """
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(
                f"Token {token!r} is not in the vocabulary; use encode() for arbitrary text."
            )
        return token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (ids are ``0..vocab_size - 1``)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters in the longest vocabulary piece, special tokens included (>= 1): a
        text of ``c`` characters encodes to at least ``c / max_token_chars`` ids, which
        bounds a prompt's length before it is encoded. Byte-level pieces spell each byte
        as one character, so a piece is never shorter than the text it stands for."""
        return max(1, *map(len, self._tokenizer.get_vocab(with_added_tokens=True)))

    @property
    def pad_id(self) -> int:
        """Id that pads batches: ``<|pad|>``, or a model folder's pad token."""
        return self._pad_id

    @property
    def end_id(self) -> int:
        """Id of ``<|end|>``, which closes every chat message, or a model folder's
        end-of-sequence token."""
        return self._end_id

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end a generation: ``end_id`` first, then a model folder's other
        end-of-sequence tokens (``generation_config.json``'s ``eos_token_id`` list)."""
        return self._stop_ids

    def save(self, path: str) -> None:
        """Writes the tokenizer as a Hugging Face ``tokenizer.json`` file at ``path``."""
        self._tokenizer.save(path)

    @classmethod
    def load(cls, path: str) -> Tokenizer:
        """Reads a ``tokenizer.json`` written by ``save``.

        Raises:
          FileNotFoundError: if ``path`` is not a file.
          ValueError: if the file lacks the raytunix special tokens at ids 0..9.
        """
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"No tokenizer file at {path!r}; write one with Tokenizer.save(path)."
            )
        return cls(tokenizers.Tokenizer.from_file(path))

    @classmethod
    def from_folder(cls, path: str) -> Tokenizer:
        """Reads a Hugging Face model folder's tokenizer.

        ``tokenizer.json`` holds the vocabulary and special tokens; the end-of-sequence
        and padding tokens are ``eos_token`` and ``pad_token`` of
        ``tokenizer_config.json`` (a string or ``{"content": ...}``), else
        ``eos_token_id`` and ``pad_token_id`` of ``generation_config.json`` (an id or a
        list of ids; every listed end id stops a generation). Without a pad token, the
        end-of-sequence token pads (padding is masked out everywhere).

        Args:
          path: the folder (or its ``tokenizer.json``).

        Raises:
          FileNotFoundError: the folder has no ``tokenizer.json``.
          ValueError: a config file is not valid JSON, a named special token is not in
            ``tokenizer.json``, or no end-of-sequence token is named anywhere.
        """
        folder = os.path.dirname(path) if os.path.isfile(path) else path
        tokenizer_file = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(
                f"No tokenizer.json in {folder!r}; a model folder needs the tokenizer.json "
                "its Hugging Face tokenizer saves (tokenizer.save_pretrained(folder))."
            )
        tok = tokenizers.Tokenizer.from_file(tokenizer_file)
        config = _read_json_if_present(os.path.join(folder, "tokenizer_config.json"))
        generation = _read_json_if_present(os.path.join(folder, "generation_config.json"))

        def token_id(key: str) -> int | None:
            value = config.get(key)
            text = value.get("content") if isinstance(value, dict) else value
            if not isinstance(text, str):
                return None
            found = tok.token_to_id(text)
            if found is None:
                raise ValueError(
                    f"{key} {text!r} of {folder}/tokenizer_config.json is not a "
                    f"token of {tokenizer_file}; fix one of the two files."
                )
            return found

        def ids(key: str) -> list[int]:
            value = generation.get(key)
            return (
                [value]
                if isinstance(value, int)
                else [i for i in value or [] if isinstance(i, int)]
            )

        end_ids = [i for i in [token_id("eos_token"), *ids("eos_token_id")] if i is not None]
        if not end_ids:
            raise ValueError(
                f"{folder!r} names no end-of-sequence token: set eos_token in "
                "tokenizer_config.json or eos_token_id in generation_config.json."
            )
        pad_id = token_id("pad_token")
        if pad_id is None:
            pad_id = next(iter(ids("pad_token_id")), end_ids[0])
        return cls(tok, pad_id=pad_id, end_id=end_ids[0], stop_ids=end_ids[1:])


def _read_json_if_present(path: str) -> dict[str, Any]:
    """The JSON object in ``path``; {} if there is no such file.

    Raises:
      ValueError: the file is not a JSON object.
    """
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or remove it.") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}.")
    return data
