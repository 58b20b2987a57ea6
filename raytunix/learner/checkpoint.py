"""Orbax checkpoints of the learner: the ``TrainState`` plus JSON extras.

Each step directory holds two items: ``state`` (the ``TrainState`` pytree: params,
optimizer state, step, rng key data) and ``extras`` (JSON: data position, policy
version, orchestrator state and its task ledger, config), written together, so the data
position always belongs to the params of the same step.

Saves are asynchronous (orbax's async checkpointing): ``save`` returns once the arrays
are copied off the device, and a background thread writes the files while training goes
on. Orbax writes each step into ``<step>.orbax-checkpoint-tmp`` and renames it to
``<step>`` only when every file is written, so a process killed mid-save leaves the
previous checkpoints as they were and the partial one is never listed or restored. A save
still in flight is finished before the next one starts, before any read of the
directory, and by ``wait_until_finished`` / ``close``.

Which checkpoints stay: the newest ``max_to_keep``, and with ``keep_best_by`` also the
one whose metric was best, which the newest-N rule never deletes.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers

from raytunix.learner.train_state import TrainState

logger = logging.getLogger(__name__)


def _as_tree(state: TrainState) -> dict[str, Any]:
    tree = {
        "params": state.params,
        "opt_state": state.opt_state,
        "step": state.step,
        "rng": state.rng,
    }
    if state.value_head is not None:  # PPO's value head (GAE runs only)
        tree.update(value_head=state.value_head, value_opt_state=state.value_opt_state)
    return tree


class Checkpointer:
    """Saves and restores ``TrainState`` + extras under ``directory``, one subdirectory
    per step, keeping the newest ``max_to_keep`` and, with ``keep_best_by``, the best one.

    Args:
      directory: local path or any path orbax accepts (e.g. ``gs://...``); created if
        missing.
      max_to_keep: older checkpoints beyond this many are deleted after a save (the best
        one excepted).
      keep_best_by: a metric name that every ``save`` then gets in ``metrics``; the
        checkpoint with the best value is kept even when it is older than the newest
        ``max_to_keep``. "" keeps only the newest.
      keep_best_mode: ``max`` (higher is better, e.g. a reward) or ``min`` (e.g. a loss).

    Raises:
      ValueError: ``max_to_keep`` < 1 or ``keep_best_mode`` neither max nor min.
    """

    def __init__(self, directory: str, max_to_keep: int = 3, keep_best_by: str = "",
                 keep_best_mode: str = "max"):
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep!r}.")
        if keep_best_mode not in ("max", "min"):
            raise ValueError(f"keep_best_mode must be 'max' or 'min', got {keep_best_mode!r}.")
        self.directory = directory if "://" in directory else os.path.abspath(directory)
        self.keep_best_by = keep_best_by
        sign = 1.0 if keep_best_mode == "max" else -1.0

        def score(metrics: dict[str, float]) -> float:
            # Saved under another keep_best_by (changed on resume): never the best.
            value = metrics.get(keep_best_by)
            return -float("inf") if value is None else sign * float(value)

        best_fn = score if keep_best_by else None
        keep = [checkpoint_managers.LatestN(n=max_to_keep)]
        if best_fn is not None:  # orbax keeps the highest best_fn; checkpoints without metrics
            keep.append(checkpoint_managers.BestN(  # (the one before RL) only by recency
                get_metric_fn=best_fn, n=1, keep_checkpoints_without_metrics=False))
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                # best_fn also makes orbax write each step's metrics, so a resumed run
                # still knows which checkpoint was best.
                best_fn=best_fn, create=True, enable_async_checkpointing=True,
                preservation_policy=checkpoint_managers.AnyPreservationPolicy(keep)),
            item_names=("state", "extras"),
        )

    def save(self, step: int, train_state: TrainState, extras: dict[str, Any],
             metrics: dict[str, float] | None = None) -> None:
        """Starts writing checkpoint ``step``: returns once the arrays are copied off the
        device; the files are written in the background and committed atomically (see the
        module docstring). A save still in flight is finished first, so the one before
        ``step`` is committed when this returns.

        Args:
          step: the checkpoint's number (usually ``train_state.step``); must be new.
          train_state: the state to save.
          extras: JSON-serializable dict stored next to it.
          metrics: numbers describing this checkpoint; with ``keep_best_by`` they must
            hold that name, or be None (a checkpoint then kept by recency only, like the
            one before RL); without it they are not stored.

        Raises:
          ValueError: a checkpoint for ``step`` already exists, or ``keep_best_by`` is set
            and ``metrics`` lacks it.
        """
        step = int(step)
        self._manager.wait_until_finished()
        if step in self._manager.all_steps():
            raise ValueError(
                f"A checkpoint for step {step} already exists in {self.directory}; "
                "save each step once."
            )
        if self.keep_best_by and metrics is not None and self.keep_best_by not in metrics:
            raise ValueError(
                f"keep_best_by={self.keep_best_by!r} but the metrics of step {step} have no "
                f"such key (they have {sorted(metrics)}); name one of those.")
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_as_tree(train_state)),
                extras=ocp.args.JsonSave(extras),
            ),
            metrics=metrics if self.keep_best_by else None,
        )

    def wait_until_finished(self) -> None:
        """Blocks until the save in flight, if any, is committed on disk.

        Raises:
          whatever the background write raised (e.g. ``OSError`` for a full disk).
        """
        self._manager.wait_until_finished()

    def best_step(self) -> int | None:
        """The committed step with the best ``keep_best_by`` metric; the newest step
        without ``keep_best_by``; None when there is no checkpoint (or none has
        metrics)."""
        self.all_steps()  # finishes a save in flight and rereads the directory
        return self._manager.best_step()

    def all_steps(self) -> list[int]:
        """Steps of the committed checkpoints on disk, ascending (after finishing a save
        in flight)."""
        self._manager.wait_until_finished()
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
            params=tree["params"], opt_state=tree["opt_state"], step=tree["step"], rng=tree["rng"],
            value_head=tree.get("value_head"), value_opt_state=tree.get("value_opt_state"),
        )
        return state, dict(restored["extras"] or {})

    def close(self) -> None:
        """Waits for pending writes and releases the manager's resources."""
        self._manager.close()
