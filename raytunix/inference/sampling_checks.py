"""The bounds of the sampling settings (temperature, top-k, top-p): what the engine can
sample with and the learner can score finitely. Plain Python and NumPy, no JAX, so the
config checks them cheaply; ``raytunix.inference.sampling`` re-exports them.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

# The lowest sampling temperature (vLLM's SamplingParams raises temperatures below 0.01 to
# 0.01 for the same reason): logits / temperature and its gradient (x 1 / temperature)
# stay finite in float32 for any realistic logit (|logits| < 3e36), where 1e-40 (a
# subnormal) makes them inf and 1e-50 becomes 0.0.
MIN_TEMPERATURE = 0.01


def greedy_top_p_bound(top_k: int, vocab_size: int | None) -> float | None:
    """The largest ``top_p`` that keeps a single token of every distribution over
    ``vocab_size`` tokens after top-k (exact ties aside), or None when unknown.

    The most likely of n tokens has probability >= 1/n, so its mass alone reaches any
    ``top_p <= 1/n`` and nucleus sampling keeps nothing else (``sampling._kept_tokens``);
    above 1/n the uniform distribution keeps a second token. n is ``top_k`` when it is on
    and below the vocabulary, else ``vocab_size``.
    """
    sizes = [n for n in (top_k if top_k > 0 else None, vocab_size) if n]
    return 1.0 / min(sizes) if sizes else None


def check_sampling_settings(
    temperature: float,
    top_k: int,
    top_p: float,
    *,
    allow_greedy: bool,
    vocab_size: int | None = None,
) -> None:
    """Raises ``ValueError`` naming the bad setting unless the three are usable.

    Checked as the sampler sees them, cast to float32.

    Args:
      temperature: finite, >= ``MIN_TEMPERATURE`` (0.01); or exactly 0 (greedy) when
        ``allow_greedy``.
      top_k: an int >= 0 (0 = off); not 1 (greedy) unless ``allow_greedy``.
      top_p: a number in (0, 1] (1.0 = off); unless ``allow_greedy``, above
        ``greedy_top_p_bound(top_k, vocab_size)`` (below it every distribution is
        sampled greedily).
      allow_greedy: True for generation (greedy evaluation is fine); False for scoring
        tokens in training, where a greedy token has no sampling distribution to score.
      vocab_size: the model's vocabulary, for the greedy ``top_p`` bound; None: only
        ``top_k`` bounds it.
    """
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, numbers.Real)
        or not (
            math.isfinite(temperature) and (temperature > 0 or (allow_greedy and temperature == 0))
        )
    ):
        need = "a finite number >= 0 (0 = greedy)" if allow_greedy else "a finite number > 0"
        raise ValueError(f"temperature={temperature!r} must be {need}.")
    with np.errstate(over="ignore"):
        as_float32 = np.float32(temperature)
    greedy = " (or exactly 0 for greedy decoding)" if allow_greedy else ""
    if temperature > 0 and not as_float32 >= np.float32(MIN_TEMPERATURE):
        raise ValueError(
            f"temperature={temperature!r} is below the floor {MIN_TEMPERATURE} (the sampler "
            f"takes it in float32, where it is {float(as_float32)!r}); far below it logits / "
            f"temperature overflow float32 and the logprobs become inf or NaN. Use a "
            f"temperature >= "
            f"{MIN_TEMPERATURE}{greedy}."
        )
    if not np.isfinite(as_float32):
        raise ValueError(
            f"temperature={temperature!r} overflows float32 (the sampler's "
            f"dtype, at most 3.4e38); use a temperature between "
            f"{MIN_TEMPERATURE} and, say, 10."
        )
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(f"top_k={top_k!r} must be an int >= 0 (0 turns top-k off).")
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p!r} must be a number in (0, 1] (1.0 turns top-p off).")
    if allow_greedy:
        return
    if top_k == 1:
        raise ValueError(
            "top_k=1 is greedy decoding: every token has probability 1, so there "
            "is nothing to score; use 0 (off) or >= 2."
        )
    bound = greedy_top_p_bound(top_k, vocab_size)
    if bound is not None and np.float32(top_p) <= np.float32(bound):
        raise ValueError(
            f"top_p={top_p!r} is greedy decoding: the most likely of "
            f"{round(1 / bound)} tokens has probability >= 1/{round(1 / bound)} = {bound:.3g} "
            f">= top_p, so no other token is ever kept. Use 1.0 (off) or a value above "
            f"{bound:.3g}, e.g. 0.95."
        )
