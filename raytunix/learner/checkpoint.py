"""Orbax checkpoints of the learner: the ``TrainState`` plus JSON extras.

Each step directory holds two items: ``state`` (the ``TrainState`` pytree: params,
optimizer state, step, rng key data) and ``extras`` (JSON: data position, policy
version, orchestrator state, config). ``save`` returns only once the checkpoint is
committed, so a crash after it returns never loses it; a corrupt or partial newest
checkpoint does not make older ones unreachable.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import orbax.checkpoint as ocp

from raytunix.learner.train_state import TrainState

logger = logging.getLogger(__name__)


def _as_tree(state: TrainState) -> dict[str, Any]:
    return {
        "params": state.params,
        "opt_state": state.opt_state,
        "step": state.step,
        "rng": state.rng,
    }


class Checkpointer:
    """Saves and restores ``TrainState`` + extras under ``directory``, one subdirectory
    per step, keeping the newest ``max_to_keep``.

    Args:
      directory: local path or any path orbax accepts (e.g. ``gs://...``); created if
        missing.
      max_to_keep: older checkpoints beyond this many are deleted after a save.
    """

    def __init__(self, directory: str, max_to_keep: int = 3):
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep!r}.")
        self.directory = directory if "://" in directory else os.path.abspath(directory)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
            item_names=("state", "extras"),
        )

    def save(self, step: int, train_state: TrainState, extras: dict[str, Any]) -> None:
        """Writes checkpoint ``step`` and blocks until it is committed on disk.

        Args:
          step: the checkpoint's number (usually ``train_state.step``); must be new.
          train_state: the state to save.
          extras: JSON-serializable dict stored next to it.

        Raises:
          ValueError: if a checkpoint for ``step`` already exists.
        """
        step = int(step)
        if step in self._manager.all_steps():
            raise ValueError(
                f"A checkpoint for step {step} already exists in {self.directory}; "
                "save each step once."
            )
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_as_tree(train_state)),
                extras=ocp.args.JsonSave(extras),
            ),
        )
        self._manager.wait_until_finished()

    def all_steps(self) -> list[int]:
        """Steps of the committed checkpoints on disk, ascending."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(
        self, step: int | None, abstract_state: TrainState
    ) -> tuple[TrainState, dict[str, Any]]:
        """Restores ``(train_state, extras)`` into the structure and dtypes of
        ``abstract_state`` (a ``TrainState`` of arrays or of ``jax.ShapeDtypeStruct``,
        e.g. from ``jax.eval_shape`` or a freshly created state).

        With ``step=None`` the newest checkpoint that restores is used: a corrupt or
        partial one is skipped with a logged warning and the next older one is tried.
        An explicit ``step`` is restored as is, with no fallback.

        Raises:
          FileNotFoundError: no checkpoint in the directory, or no checkpoint ``step``.
          RuntimeError: ``step=None`` and no checkpoint could be restored.
        """
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(
                f"No checkpoint found in {self.directory}; resume a run that has one, or "
                "start a new run."
            )
        if step is not None:
            if int(step) not in steps:
                raise FileNotFoundError(
                    f"No checkpoint for step {step} in {self.directory}; available: {steps}."
                )
            return self._restore(int(step), abstract_state)
        errors = []
        for candidate in reversed(steps):
            try:
                restored = self._restore(candidate, abstract_state)
            except Exception as e:  # orbax/tensorstore raise many types for bad files
                logger.warning(
                    "Checkpoint step %d in %s could not be restored (%s: %s); trying an "
                    "older one.", candidate, self.directory, type(e).__name__, e,
                )
                errors.append(f"step {candidate}: {type(e).__name__}: {str(e)[:300]}")
                continue
            self._quarantine([s for s in steps if s > candidate])
            return restored
        raise RuntimeError(
            f"None of the checkpoints in {self.directory} could be restored (was the run's "
            "config.yaml changed?):\n" + "\n".join(errors)
        )

    def read_extras(self, step: int | None = None) -> dict[str, Any]:
        """The JSON extras of checkpoint ``step`` (default: the newest), without loading
        the model: data position, policy version, the orchestrator's state and ledger.

        Raises:
          FileNotFoundError: no checkpoint, or none for ``step``.
        """
        steps = self.all_steps()
        if step is None and steps:
            step = steps[-1]
        if step not in steps:
            raise FileNotFoundError(
                f"No checkpoint for step {step} in {self.directory}; available: {steps}.")
        restored = self._manager.restore(
            int(step), args=ocp.args.Composite(extras=ocp.args.JsonRestore()))
        return dict(restored["extras"] or {})

    def _quarantine(self, steps: list[int]) -> None:
        """Moves unrestorable checkpoints newer than the one restored aside (to
        ``<directory>-corrupt/``), so the resumed run can save those steps again; nothing
        is deleted."""
        if not steps or "://" in self.directory:
            return
        aside = self.directory.rstrip("/") + "-corrupt"
        os.makedirs(aside, exist_ok=True)
        for step in steps:
            source = os.path.join(self.directory, str(step))
            if os.path.isdir(source):
                target = os.path.join(aside, f"{step}-{int(time.time())}")
                os.replace(source, target)
                logger.warning("Moved unrestorable checkpoint %s to %s.", source, target)
        self._manager.reload()

    def _restore(
        self, step: int, abstract_state: TrainState
    ) -> tuple[TrainState, dict[str, Any]]:
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_as_tree(abstract_state)),
                extras=ocp.args.JsonRestore(),
            ),
        )
        tree = restored["state"]
        state = TrainState(
            params=tree["params"], opt_state=tree["opt_state"], step=tree["step"], rng=tree["rng"]
        )
        return state, dict(restored["extras"] or {})

    def close(self) -> None:
        """Waits for pending writes and releases the manager's resources."""
        self._manager.close()
