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

This module does not import JAX; environment and agent processes use it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>",
                  "<tool_call>", "</tool_call>", "<answer>", "</answer>")
"""Special tokens, with ids 0..9 in this order in every raytunix tokenizer."""


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])


def _byte_chars() -> list[str]:
    """The character that byte-level BPE uses for each byte value 0..255, in byte order.

    Printable Latin-1 bytes stand for themselves; the others are shifted to code points
    256 and up (the GPT-2 ``bytes_to_unicode`` table, Radford et al. 2019).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
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
    merges) or ``load``.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer):
        """Wraps an existing ``tokenizers.Tokenizer``.

        Raises:
          ValueError: if the special tokens are missing or not at ids 0..9 in the order
            of ``SPECIAL_TOKENS``.
        """
        for expected_id, token in enumerate(SPECIAL_TOKENS):
            got = tokenizer.token_to_id(token)
            if got != expected_id:
                raise ValueError(
                    f"Special token {token!r} has id {got}, expected {expected_id}; a raytunix "
                    "tokenizer must hold SPECIAL_TOKENS at ids 0..9. Build it with "
                    "Tokenizer.train or Tokenizer.byte_level.")
        self._tokenizer = tokenizer
        self._plain = _plain_text_copy(tokenizer)

    def __getstate__(self) -> dict:
        return {"tokenizer": self._tokenizer}

    def __setstate__(self, state: dict) -> None:
        # Rebuilt, not pickled: ``encode_special_tokens`` does not survive a pickle.
        self._tokenizer = state["tokenizer"]
        self._plain = _plain_text_copy(self._tokenizer)

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
                f"({len(SPECIAL_TOKENS)} special tokens + 256 byte tokens).")
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
            raise ValueError(f"extra_special_tokens {clash} repeat a special token; list each "
                             "new token once.")
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

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; bytes that do not form valid UTF-8 become U+FFFD."""
        return self._tokenizer.decode([int(i) for i in ids],
                                      skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int:
        """Id of one token string, e.g. ``"<|end|>"``.

        Raises:
          ValueError: if ``token`` is not in the vocabulary.
        """
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(
                f"Token {token!r} is not in the vocabulary; use encode() for arbitrary text.")
        return token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (ids are ``0..vocab_size - 1``)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def pad_id(self) -> int:
        """Id of ``<|pad|>``."""
        return SPECIAL_TOKENS.index("<|pad|>")

    @property
    def end_id(self) -> int:
        """Id of ``<|end|>``, which closes every chat message."""
        return SPECIAL_TOKENS.index("<|end|>")

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
                f"No tokenizer file at {path!r}; write one with Tokenizer.save(path).")
        return cls(tokenizers.Tokenizer.from_file(path))
