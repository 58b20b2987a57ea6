"""Small OpenEnv environments for tests/test_openenv_env.py, written with openenv-core's
server API (``Environment``, ``Action``, ``Observation``, ``create_app``).

``GuessEnvironment`` hides a number in 1..20 that its reset draws from the global
``random`` after ``random.seed(seed)`` (as TextArena-style games do); a move is ``[n]``; a
reply without one costs -0.1 (the environment's own format penalty) and the game goes on;
the right number pays 1, running out of turns 0, and only the last step pays.
"""

from __future__ import annotations

import random
import re
from typing import Any, Optional

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

FORMAT_PENALTY = -0.1


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    prompt: str = ""


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    def __init__(self, high: int = 20, max_turns: int = 8) -> None:
        super().__init__()
        self.high, self.max_turns = high, max_turns
        self.secret, self.turns = 0, 0
        self._state = State()

    def reset(
        self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any
    ) -> GuessObservation:
        random.seed(seed)
        self.secret = random.randint(1, self.high)
        self.turns = 0
        self._state = State(episode_id=episode_id)
        return GuessObservation(prompt=f"Guess my number in 1..{self.high}; reply [n].")

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any):  # type: ignore[override]
        self.turns += 1
        move = re.search(r"\[(\d+)\]", action.message)
        if move is None:
            return GuessObservation(prompt="Invalid move: reply [n].", reward=FORMAT_PENALTY)
        # A draw per move, as games that deal or place tiles do.
        random.random()
        guess = int(move.group(1))
        if guess == self.secret:
            return GuessObservation(prompt="Correct!", reward=1.0, done=True)
        if self.turns >= self.max_turns:
            return GuessObservation(prompt="Out of turns.", reward=0.0, done=True)
        hint = "higher" if self.secret > guess else "lower"
        return GuessObservation(prompt=f"My number is {hint} than {guess}.")

    @property
    def state(self) -> State:
        return self._state


class PointAction(Action):
    row: int
    col: int


class BoardObservation(Observation):
    board: str = ""
    moves: int = 0


class PointEnvironment(Environment[PointAction, BoardObservation, State]):
    """Pick the cell (1, 2) of a 3x3 board: actions are JSON objects of two ints."""

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any):  # type: ignore[override]
        self.moves = 0
        return BoardObservation(board="...\n...\n...", moves=0)

    def step(self, action: PointAction, timeout_s: Optional[float] = None, **kwargs: Any):  # type: ignore[override]
        self.moves += 1
        hit = (action.row, action.col) == (1, 2)
        return BoardObservation(
            board="hit" if hit else "miss", moves=self.moves, reward=float(hit), done=hit
        )

    @property
    def state(self) -> State:
        return State()


class UnseededEnvironment(GuessEnvironment):
    """Ignores its seed: the number shows in the first observation."""

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any):  # type: ignore[override]
        self.secret = random.SystemRandom().randint(1, 10**9)
        self.turns = 0
        return GuessObservation(prompt=f"Board {self.secret}")


class BrokenEnvironment(GuessEnvironment):
    def __init__(self) -> None:
        raise RuntimeError("this environment cannot be built")


# The layout an OpenEnv package ships: an app built with create_app.
app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess")
