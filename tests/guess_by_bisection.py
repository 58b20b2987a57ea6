"""One scripted player for the guess-the-number games the hub adapter tests drive
(TextArena, GEM, OpenEnv): bisection on the game's higher/lower hints, in the action
syntax the hub parses."""

import re

from raytunix.types import Action

# (pattern that reads a guess back from a reply, format of the next reply)
BRACKETS = (r"\[(\d+)\]", "I guess [{}]")
BOXED = (r"\\boxed\{(\d+)\}", "so \\boxed{{{}}}")


def word_hint(observation: str, guess: int) -> str | None:
    """``"higher"``/``"lower"`` when the observation says so, else None (no hint)."""
    for hint in ("higher", "lower"):
        if hint in observation:
            return hint
    return None


def bisection_episode(env, task, first_reply, high, syntax=BRACKETS, hint=word_hint):
    """Plays a number in ``1..high`` from ``first_reply`` on, halving the range on each hint
    (``hint(observation, guess)``); a reply without a guess (a format error) changes
    nothing. Returns the observations (the reset's first) and the step results."""
    pattern, next_reply = syntax
    observations = [env.reset(task)]
    results = []
    low, reply = 1, first_reply
    while True:
        result = env.step(Action(text=reply))
        results.append(result)
        observations.append(result.observation)
        if result.done:
            return observations, results
        match = re.search(pattern, reply)
        if match is not None:
            guess = int(match.group(1))
            said = hint(result.observation, guess)
            if said == "higher":
                low = guess + 1
            elif said == "lower":
                high = guess - 1
        reply = next_reply.format((low + high) // 2)
