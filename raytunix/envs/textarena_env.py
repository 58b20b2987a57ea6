"""A single-player TextArena game as a raytunix environment.

Source: TextArena (github.com/LeonGuertler/TextArena, PyPI ``textarena``, 0.7.x). A game is
registered there by id (``textarena.envs.registration.ENV_REGISTRY``, e.g.
``"GuessTheNumber-v0"``) and played as::

    game.reset(num_players=1, seed=seed)     # State.__init__ calls random.seed(seed)
    player_id, messages = game.get_observation()   # [(from_id, text, ObservationType)]
    done, step_info = game.step(reply)       # the game parses its own action syntax
    rewards, game_info = game.close()        # rewards {player_id: float}, only at the end

In a config it is the registered environment ``textarena``::

    env:
      name: textarena
      kwargs: {env_id: GuessTheNumber-v0, make_kwargs: {max_number: 50}}

Multi-player games are refused: every opponent TextArena ships is a model behind an API or
downloaded weights, so none plays offline.
"""

from __future__ import annotations

import collections.abc
import importlib
from typing import Any

from raytunix.envs.base import BaseEnv
from raytunix.envs.global_random import EpisodeRandom, binary_search_game, seeded_tasks
from raytunix.registry import register
from raytunix.types import TOOL_ERRORS_KEY, Action, EpisodeStatus, StepResult, Task, ToolErrorKind


@register("env", "textarena")
class TextArenaEnv(BaseEnv):
    """Runs one TextArena single-player game per raytunix episode.

    A task is a reset seed (``tasks``): the G episodes of a group reset with the same seed,
    so they start from the same state. TextArena's games are not thread-safe (they seed and
    draw from the global ``random``): every call into the game holds ``GLOBAL_RNG_LOCK``
    with this episode's own stream of ``random`` swapped in
    (``raytunix.envs.global_random``), so episodes interleaved in one env actor draw as if
    each ran alone (same seed and moves, same game) and the process's global ``random`` is
    left as it was.

    Per step, the model's reply (``Action.text``) goes to the game as it is: the game's own
    action syntax applies (``[5]`` in GuessTheNumber, ``[crane]`` in Wordle; the game's first
    message says it). The observation is the game's new messages to the player, its own
    action's echo left out. Rewards come only at the end: 0 on every step before, the game's
    reward for player 0 (``game.close()``) on the last one. A move the game calls invalid
    counts one ``format`` tool error and keeps the game's penalty: by TextArena's rules
    (``error_allowance=1``) the first invalid move is answered with a warning and the
    player moves again; a second one in a row ends the game with the reward the game gives
    for it (``info["invalid_move"]``). A finished game ends the episode ``COMPLETED`` with
    ``info["reason"]`` (the game's), ``info["correct"]`` is ``reward >= 1``.

    Args:
      env_id: a TextArena id (``"GuessTheNumber-v0"``); the game is built from its
        registration without TextArena's wrappers (this adapter renders observations).
      make_kwargs: keyword arguments for the game's constructor, over the registration's.

    Raises:
      ImportError: textarena is not installed (``pip install 'raytunix[textarena]'``).
      ValueError: ``env_id`` is not registered (close ids listed), the game is not
        single-player, or it cannot be built offline (e.g. Wordle without nltk's ``words``
        and ``averaged_perceptron_tagger_eng`` data installed beforehand).
      TypeError: ``make_kwargs`` is not a mapping.
    """

    default_agent = "text"

    def __init__(self, env_id: str, make_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__()
        if make_kwargs is not None and not isinstance(make_kwargs, collections.abc.Mapping):
            raise TypeError(f"make_kwargs must be a mapping, got {make_kwargs!r}.")
        self.env_id = env_id
        self.game = _make(env_id, dict(make_kwargs or {}))
        self._streams = EpisodeRandom()
        try:
            self._reset(0)
        except AssertionError as e:
            raise ValueError(
                f"TextArena game {env_id!r} is not single-player ({e}); raytunix runs "
                "single-player TextArena games (TextArena's opponents all need an API or "
                "downloaded weights, so none plays offline)."
            ) from e

    def tasks(self, split: str, size: int, seed: int) -> list[Task]:
        """``size`` tasks, one reset seed each (``raytunix.envs.global_random.reset_seeds``:
        ``seed * 2**21`` onwards, the held-out ones ``2**20`` further, modulo 2**31); the
        question is the game's first observation under that seed.

        Raises:
          ValueError: ``split`` is not "train" or "heldout", or ``size`` exceeds 2**20.
        """
        return seeded_tasks(split, size, seed, self._reset, textarena_id=self.env_id)

    def demonstrate(self, task: Task) -> list[dict[str, str]] | None:
        """An expert's game on ``task``, played against this instance: for GuessTheNumber
        (every registered variant), binary search over the game's range, guided by the
        game's "higher"/"lower" hints (the secret is never read). None for other games,
        or when the game was not won."""
        if type(self.game).__name__ != "GuessTheNumberEnv":
            return None
        return _binary_search_game(self, task)

    def _initial_observation(self, task: Task) -> str:
        seed = task.metadata.get("seed")
        if not isinstance(seed, int):
            raise TypeError(
                f"task {task.task_id!r}: metadata['seed'] is {seed!r}, not an int; "
                "TextArena tasks come from TextArenaEnv.tasks."
            )
        return self._reset(seed)

    def _step_impl(self, action: Action) -> StepResult:
        with self._streams.use():
            done, _ = self.game.step(action.text)
            state = self.game.state
            warned = not done and getattr(state, "error_count", 0) > 0
            observation = self._drain()
            if not done:
                rewards, game_info = {}, {}
            else:
                rewards, game_info = self.game.close()
        info: dict[str, Any] = {}
        player_info = dict(game_info.get(0, {})) if game_info else {}
        if warned or player_info.get("invalid_move"):
            info[TOOL_ERRORS_KEY] = {ToolErrorKind.FORMAT.value: 1}
            info["invalid_move"] = True
        if not done:
            return StepResult(observation=observation, info=info)
        reward = float(rewards.get(0, 0.0)) if rewards else 0.0
        info["reason"] = player_info.get("reason", "")
        info["correct"] = reward >= 1.0
        if info["reason"]:
            observation = f"{observation}\nGame over: {info['reason']}".strip()
        return StepResult(
            observation=observation,
            reward=reward,
            done=True,
            status=EpisodeStatus.COMPLETED,
            info=info,
        )

    def _reset(self, seed: int) -> str:
        # Games also draw from the global random while they step (2048's new tile,
        # Blackjack's cards), so the stream the reset seeds is kept for the episode's steps.
        self._streams.restart()
        with self._streams.use():
            self.game.reset(num_players=1, seed=seed)
            return self._drain()

    def _drain(self) -> str:
        # Called under GLOBAL_RNG_LOCK. The game echoes the player's own move back as a
        # PLAYER_ACTION message; the conversation already holds it.
        import textarena

        _, messages = self.game.get_observation()
        return "\n".join(
            str(text)
            for _, text, kind in messages
            if kind != textarena.ObservationType.PLAYER_ACTION
        )


def _binary_search_game(env: TextArenaEnv, task: Task) -> list[dict[str, str]] | None:
    """GuessTheNumber by binary search over ``[min_number, max_number]``, moves ``[n]``,
    TextArena's "higher"/"lower" hints, won at reward 1 (``binary_search_game``)."""

    def direction(observation: str, guess: int) -> int:
        hint = observation.lower()
        return 1 if "higher" in hint else -1 if "lower" in hint else 0

    return binary_search_game(
        env,
        task,
        int(env.game.min_number),
        int(env.game.max_number),
        lambda guess: f"[{guess}]",
        direction,
        lambda result: result.reward >= 1.0,
    )


def _make(env_id: str, make_kwargs: dict[str, Any]) -> Any:
    try:
        from textarena.envs.registration import ENV_REGISTRY
    except ImportError as e:
        raise ImportError(
            f"env.name=textarena needs the textarena package ({e}); "
            "pip install 'raytunix[textarena]'."
        ) from e
    spec = ENV_REGISTRY.get(env_id) if isinstance(env_id, str) else None
    if spec is None:
        stem = str(env_id).split("-")[0].lower()
        close = sorted(k for k in ENV_REGISTRY if k.lower().startswith(stem))[:10]
        raise ValueError(
            f"{env_id!r} is not a TextArena id; "
            + (f"close ones: {', '.join(close)}" if close else "e.g. GuessTheNumber-v0")
            + " (all: textarena.envs.registration.ENV_REGISTRY)."
        )
    try:
        # Word games load nltk data when their module is imported (TextArena then tries to
        # download it, which fails offline) or when built.
        entry = spec.entry_point
        if isinstance(entry, str):
            module_name, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module_name), attr)
        return entry(**{**spec.kwargs, **make_kwargs})
    except (LookupError, OSError) as e:
        lines = [line.strip() for line in str(e).splitlines()]
        why = next((line for line in lines if line and not line.startswith("*")), repr(e))
        raise ValueError(
            f"TextArena game {env_id!r} cannot be built offline: {type(e).__name__}: "
            f"{why} Install the data it loads before the run (for nltk: "
            "python -m nltk.downloader words averaged_perceptron_tagger_eng); nothing is "
            "downloaded while training."
        ) from e
