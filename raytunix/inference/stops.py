"""Stop strings matched on decoded text, one generated token at a time.

A stop string is text, but the engine samples tokens, and with byte-level BPE one
character may be split over several byte-fragment tokens (2-4 for anything outside
ASCII), while one merged token may hold the end of a stop string and more text after it.
So the match is done on the text the tokens decode to, and a stop string counts as
completed by the token whose bytes finish its last character, wherever in that token's
text it ends.

Only a small window of the newest tokens is decoded per token, sized in UTF-8 bytes of
the longest stop string, not in characters: every token decodes from at least one byte,
so ``len(stop.encode()) + _MARGIN_TOKENS`` tokens before the newest one hold any stop
string the newest token can complete, plus room for a character cut at the window's
start (at most 3 bytes) and a decoder that drops a leading space there. The cost per token
is therefore constant, whatever the generation's length.

This module does not import JAX.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

_MARGIN_TOKENS = 4


def stop_window(stop_strings: Sequence[str]) -> int:
    """Tokens before the newest one that ``completed_stop`` decodes: the UTF-8 length of
    the longest non-empty stop string plus a margin (0 when there is none)."""
    sizes = [len(s.encode("utf-8")) for s in stop_strings if s]
    return max(sizes) + _MARGIN_TOKENS if sizes else 0


def completed_stop(
    decode: Callable[[Sequence[int]], str], generated: Sequence[int], stop_strings: Sequence[str]
) -> str | None:
    """The stop string that the last of ``generated`` completes, or None.

    A stop string is completed by token ``i`` when it occurs in the decoded text of
    ``generated[:i + 1]`` and its occurrence takes at least one byte from token ``i``
    (an occurrence wholly in the text before would have stopped the generation earlier).
    Only the generated tokens are searched: a stop string in the prompt never stops.

    Args:
      decode: token ids -> text, lossy (bytes that are not valid UTF-8, such as an
        unfinished character, become U+FFFD), as ``Tokenizer.decode``.
      generated: the token ids generated so far, int, length >= 1.
      stop_strings: the stop strings; empty ones are ignored.

    Returns:
      the first of ``stop_strings`` that the last token completes, or None.
    """
    window = stop_window(stop_strings)
    if not window or not generated:
        return None
    start = max(0, len(generated) - 1 - window)
    before = decode(generated[start:-1])
    after = decode(generated[start:])
    # Text up to ``common`` was there before the newest token; an unfinished character
    # that the newest token completes changes from U+FFFD, so it lies after ``common``.
    common = len(os.path.commonprefix([before, after]))
    for stop in stop_strings:
        if stop and after.find(stop, max(0, common - len(stop) + 1)) != -1:
            return stop
    return None
