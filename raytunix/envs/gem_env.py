"""A GEM game as a raytunix environment.

Source: GEM (github.com/axon-rl/gem, PyPI ``gem-llm``, 0.1.x). An environment is registered
there by id (``gem.envs.registration.ENV_REGISTRY``, e.g. ``"game:GuessTheNumber-v0-easy"``)
and played gymnasium-style::

    observation, info = env.reset(seed=seed)   # random.seed(seed) and numpy.random.seed(seed)
    observation, reward, terminated, truncated, info = env.step(reply)
    # GEM's observation wrappers append info["suffix"] (the board, "Enter your next guess.")

In a config it is the registered environment ``gem``::

    env:
      name: gem
      kwargs: {env_id: "game:GuessTheNumber-v0-easy", make_kwargs: {max_turns: 6}}

Only GEM's games (``game:*``) run here: its ``rg:*`` environments redraw their dataset
after every ``size`` resets (so a reset seed does not name one question; raytunix's own
``reasoning_gym`` environment runs the same datasets), and its math, QA, code and eval
environments load their data from the Hugging Face hub when built (``data.source`` reads
datasets) or call tools of GEM's own.
"""

from __future__ import annotations

import collections.abc
import difflib
import logging
import re
from typing import Any

from raytunix.envs.base import BaseEnv
from raytunix.envs.global_random import EpisodeRandom, binary_search_game, seeded_tasks
from raytunix.registry import register
from raytunix.types import TOOL_ERRORS_KEY, Action, EpisodeStatus, StepResult, Task, ToolErrorKind

GAME_PREFIX = "game:"
# Why each other kind of GEM id is refused, by prefix.
_NOT_GAMES = {
    "rg:": "GEM's reasoning-gym environments redraw their dataset after every `size` "
    "resets, so a reset seed does not name one question; run the same dataset with "
    "env.name=reasoning_gym env.kwargs.task=<name>",
    "math:": "GEM's math environments load their dataset from the Hugging Face hub when "
    "built; train on such a dataset with data.source and env.name=math_verifier",
}
# A win's rewards can sum to 1 only up to float rounding (Minesweeper pays each reveal's
# share of the board).
_WIN_TOLERANCE = 1e-9


@register("env", "gem")
class GEMEnv(BaseEnv):
    """Runs one GEM game per raytunix episode.

    A task is a reset seed (``tasks``): the G episodes of a group reset with the same seed,
    so they start from the same state. GEM's games are not thread-safe (``reset`` seeds
    Python's and numpy's global generators, and games draw from them while they reset and
    step: Minesweeper lays its mines on the first reveal, 2048 adds a tile every move):
    every call into the game, building it included, holds the process-wide
    ``GLOBAL_RNG_LOCK`` with this episode's own streams swapped in
    (``raytunix.envs.global_random``), so episodes interleaved in one env actor play as if
    each ran alone and the process's global generators are left as they were.

    Per step, the model's reply (``Action.text``) goes to the game as it is: the game's own
    action syntax applies (GuessTheNumber and most games read the last ``\\boxed{...}``;
    the game's first message says it). The observation is the game's, followed by
    ``info["suffix"]`` when GEM gives one (as GEM's observation wrappers show it: the
    board, "Enter your next guess."). Rewards are GEM's, step by step (the episode's reward
    is their sum; GuessTheNumber pays 0 for a hint and 1 for the number, Minesweeper each
    reveal's share of the board): GEM's penalty for a reply the game cannot parse
    (``LanguageGameReward.format_error_reward``, -0.1; GEM then ends the game, and the step
    counts one ``format`` tool error with ``info["format_error"]``), the game's partial
    credit when its turns run out (GuessTheNumber: 1 - distance / range). A move the game
    parses but refuses (a number out of range or guessed before) gets the game's message
    and its ``invalid_action_reward`` (0) and the game goes on; GEM gives no other sign of
    it, so it is not counted as a tool error. A game that ends by itself is ``COMPLETED``,
    one whose own turn limit ran out ``TRUNCATED`` (keep ``env.max_turns`` at least the
    game's); ``info["correct"]`` is a completed game whose rewards sum to 1 or more.

    Args:
      env_id: a GEM game id (``"game:GuessTheNumber-v0-easy"``), built with ``gem.make``.
      make_kwargs: keyword arguments for the game's constructor, over the registration's.

    Raises:
      ImportError: gem-llm is not installed (``pip install 'raytunix[gem]'``).
      ValueError: ``env_id`` is not registered (close ids listed) or is not a game (the
        reason said), or the game cannot be built offline (Wordle, Hangman and WordSearch
        need nltk's ``words`` data installed beforehand; Crosswords needs pandas).
      TypeError: ``make_kwargs`` is not a mapping.
    """

    default_agent = "text"

    def __init__(self, env_id: str, make_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__()
        if make_kwargs is not None and not isinstance(make_kwargs, collections.abc.Mapping):
            raise TypeError(f"make_kwargs must be a mapping, got {make_kwargs!r}.")
        self.env_id = env_id
        registry, self._format_error_reward = _import_gem()
        self._streams = EpisodeRandom()
        self._return = 0.0
        # GEM's games reset (unseeded) while they are built: that draw is this instance's.
        with self._streams.use():
            self.game = _make(registry, env_id, dict(make_kwargs or {}))

    def tasks(self, split: str, size: int, seed: int) -> list[Task]:
        """``size`` tasks, one reset seed each (``raytunix.envs.global_random.reset_seeds``:
        ``seed * 2**21`` onwards, the held-out ones ``2**20`` further, modulo 2**31, so
        always a seed numpy accepts); the question is the game's first observation under
        that seed.

        Raises:
          ValueError: ``split`` is not "train" or "heldout", or ``size`` exceeds 2**20.
        """
        return seeded_tasks(split, size, seed, self._reset, gem_id=self.env_id)

    def demonstrate(self, task: Task) -> list[dict[str, str]] | None:
        """An expert's game on ``task``, played against this instance: for GuessTheNumber
        (every registered variant), binary search over the game's range, guided by the
        game's "higher"/"lower" hints (the secret is never read). None for other games,
        or when the game was not won."""
        if type(self.game.unwrapped).__name__ != "GuessTheNumberEnv":
            return None
        return _binary_search_game(self, task)

    def _initial_observation(self, task: Task) -> str:
        seed = task.metadata.get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(
                f"task {task.task_id!r}: metadata['seed'] is {seed!r}, not an int; "
                "GEM tasks come from GEMEnv.tasks."
            )
        return self._reset(seed)

    def _step_impl(self, action: Action) -> StepResult:
        with self._streams.use():
            observation, reward, terminated, truncated, game_info = self.game.step(action.text)
        reward = float(reward)
        self._return += reward
        info: dict[str, Any] = {}
        if reward == self._format_error_reward:
            info[TOOL_ERRORS_KEY] = {ToolErrorKind.FORMAT.value: 1}
            info["format_error"] = True
        if not (terminated or truncated):
            return StepResult(observation=_shown(observation, game_info), reward=reward, info=info)
        info["correct"] = not truncated and self._return >= 1.0 - _WIN_TOLERANCE
        return StepResult(
            observation=str(observation),
            reward=reward,
            done=True,
            status=EpisodeStatus.TRUNCATED if truncated else EpisodeStatus.COMPLETED,
            info=info,
        )

    def _reset(self, seed: int) -> str:
        # The reset seeds the generators; the stream it starts is kept for the steps.
        self._streams.restart()
        self._return = 0.0
        with self._streams.use():
            observation, info = self.game.reset(seed=seed)
        return _shown(observation, info)


def _shown(observation: Any, info: Any) -> str:
    """The observation as GEM's observation wrappers show it: ``info["prefix"]``, the
    observation (ended by a newline), ``info["suffix"]``."""
    text = str(observation)
    if not isinstance(info, collections.abc.Mapping):
        return text
    if info.get("suffix"):
        text = (text if not text or text.endswith("\n") else text + "\n") + str(info["suffix"])
    if info.get("prefix"):
        text = str(info["prefix"]) + text
    return text


def _binary_search_game(env: GEMEnv, task: Task) -> list[dict[str, str]] | None:
    """GuessTheNumber by binary search over ``[min_number, max_number]``, moves
    ``\\boxed{n}``, GEM's "higher than n"/"lower than n" hints, won when GEM says
    ``correct`` (``binary_search_game``)."""
    game = env.game.unwrapped

    def direction(observation: str, guess: int) -> int:
        if f"higher than {guess}" in observation:
            return 1
        return -1 if f"lower than {guess}" in observation else 0

    return binary_search_game(
        env,
        task,
        int(game.min_number),
        int(game.max_number),
        lambda guess: f"\\boxed{{{guess}}}",
        direction,
        lambda result: bool(result.info.get("correct")),
    )


def _import_gem() -> tuple[dict[str, Any], float]:
    """GEM's registry of ids and its reward for a reply a game cannot parse."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        from gem.envs.registration import ENV_REGISTRY
        from gem.utils.constants import LanguageGameReward
    except ImportError as e:
        raise ImportError(
            f"env.name=gem needs the gem-llm package ({e}); pip install 'raytunix[gem]'."
        ) from e
    finally:
        # Importing gem calls logging.basicConfig(level=INFO); the process's logging stays
        # as its owner set it.
        root.handlers[:] = handlers
        root.setLevel(level)
    return ENV_REGISTRY, float(LanguageGameReward.format_error_reward)


def _make(registry: dict[str, Any], env_id: str, make_kwargs: dict[str, Any]) -> Any:
    if not isinstance(env_id, str) or env_id not in registry:
        stem = str(env_id).split("-")[0]
        close = [k for k in registry if k.startswith(stem)]
        close += difflib.get_close_matches(str(env_id), [k for k in registry if k not in close])
        raise ValueError(
            f"{env_id!r} is not a GEM id; "
            + (
                f"close ones: {', '.join(close[:10])}"
                if close
                else "e.g. game:GuessTheNumber-v0-easy"
            )
            + " (all: gem.envs.registration.ENV_REGISTRY)."
        )
    if not env_id.startswith(GAME_PREFIX):
        why = next(
            (reason for prefix, reason in _NOT_GAMES.items() if env_id.startswith(prefix)),
            "it loads its data from the Hugging Face hub when built, or calls GEM's own tools",
        )
        raise ValueError(
            f"GEM id {env_id!r} is not a game: raytunix runs GEM's games ({GAME_PREFIX}*); {why}."
        )
    import gem

    try:
        return gem.make(env_id, **make_kwargs)
    except (LookupError, OSError, ImportError) as e:
        # nltk's message is a banner of asterisks around coloured text.
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(e).splitlines()]
        why = next((line for line in lines if line and not line.startswith("*")), repr(e))
        raise ValueError(
            f"GEM game {env_id!r} cannot be built offline: {type(e).__name__}: "
            f"{why.rstrip('.')}. "
            "Install what it loads before the run (nltk's words: python -m nltk.downloader "
            "words; Crosswords: pip install pandas); nothing is downloaded while training."
        ) from e
