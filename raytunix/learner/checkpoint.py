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

Reading back: a read that fails for a reason that may pass (a stale NFS handle, a storage
timeout, device memory short: ``is_transient``) is retried with backoff and, if it goes on
failing, raises ``CheckpointUnavailable``: the run never silently falls back to an older
step because its storage blinked. Only a checkpoint proven damaged (``is_corruption``: a
missing file, metadata that does not decode, data the storage calls lost, seen twice) is
moved aside to ``<directory>-corrupt/``, with the reason in a ``.reason.json`` beside it.
A checkpoint that does not fit the learner (another shape or structure) is a config
mismatch, raised as ``CheckpointMismatch`` with nothing moved.

Which checkpoints stay: the newest ``max_to_keep``, and with ``keep_best_by`` also the
one whose metric was best, which the newest-N rule never deletes.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers

from raytunix.learner.train_state import TrainState
from raytunix.rollout.faults import Backoff

logger = logging.getLogger(__name__)


class CheckpointUnavailable(RuntimeError):
    """A checkpoint could not be read because of a transient error (storage, network,
    device memory) that persisted past the retries; it was left in place."""


class CheckpointMismatch(ValueError):
    """A checkpoint does not restore into the learner (another structure or shape: the
    config changed), or failed in a way that is no evidence of damage; left in place."""


T = TypeVar("T")


class CheckpointCorrupt(RuntimeError):
    """A checkpoint is proven unreadable: the same evidence of damage (``is_corruption``)
    on two reads. ``reason`` is the error that proved it."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


# Transient read errors: ~30 s of retries (1, 2, 4, 8, 16 s), jittered so that the hosts
# of a group do not hit a recovering store at the same instant.
READ_BACKOFF = Backoff(
    initial_delay_s=1.0, max_delay_s=16.0, multiplier=2.0, max_attempts=6, jitter=0.25
)

# errno values of a read that may succeed when tried again: network filesystems (stale
# handle, timeouts, connections), an interrupted or busy call, an I/O error of a storage
# layer that recovers, and memory or buffers short for a while.
TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "ESTALE",
        "EIO",
        "ETIMEDOUT",
        "EAGAIN",
        "EWOULDBLOCK",
        "EBUSY",
        "EINTR",
        "ENOMEM",
        "ENOBUFS",
        "ECONNRESET",
        "ECONNREFUSED",
        "ECONNABORTED",
        "EPIPE",
        "ENETDOWN",
        "ENETUNREACH",
        "ENETRESET",
        "EHOSTDOWN",
        "EHOSTUNREACH",
        "ENOLINK",
        "EREMOTEIO",
        "ECOMM",
        "EPROTO",
        "ETIME",
    )
    if hasattr(errno, name)
)

# Status words that tensorstore, gRPC and cloud storage clients put in their messages for
# a call that may succeed later; and the words of damaged data.
_TRANSIENT_WORDS = (
    "UNAVAILABLE",
    "DEADLINE_EXCEEDED",
    "RESOURCE_EXHAUSTED",
    "ABORTED",
    "timed out",
    "Timeout was reached",
    "Service Unavailable",
    "Too Many Requests",
    "Stale file handle",
    "Connection reset",
    "temporarily",
    "out of memory",
)
_CORRUPTION_WORDS = (
    "DATA_LOSS",
    "OUT_OF_RANGE",
    "checksum",
    "corrupt",
    "truncated",
    "Unexpected end",
    "Invalid manifest",
    "Error decoding",
    "Failed to decode",
)


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and its causes (orbax wraps the storage layer's errors)."""
    seen: list[BaseException] = []
    while error is not None and error not in seen and len(seen) < 16:
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


def is_transient(error: BaseException) -> bool:
    """Whether a checkpoint read that raised ``error`` may succeed when tried again: an
    ``OSError`` with an errno of ``TRANSIENT_ERRNOS``, a ``TimeoutError``,
    ``ConnectionError`` or ``MemoryError`` anywhere in its causes, or a message with a
    transient status (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, "timed out",
    ...), as tensorstore and cloud clients word them."""
    for e in _chain(error):
        if isinstance(e, (TimeoutError, ConnectionError, MemoryError)):
            return True
        if isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS:
            return True
        text = str(e)
        if any(word.lower() in text.lower() for word in _TRANSIENT_WORDS):
            return True
    return False


def is_corruption(error: BaseException) -> bool:
    """Whether ``error`` is evidence of a damaged checkpoint, not of the storage or the
    config: a file of it missing (``FileNotFoundError``, ``NotADirectoryError``: orbax
    commits a step by renaming it whole, so a listed step lacks none), metadata that does
    not decode (``json.JSONDecodeError``, ``UnicodeDecodeError``), or array data that the
    storage layer calls lost or short (DATA_LOSS, OUT_OF_RANGE, a checksum). Transient
    errors (``is_transient``) are never corruption; a structure or shape mismatch
    (``ValueError``) is a config mismatch, not corruption."""
    if is_transient(error):
        return False
    for e in _chain(error):
        if isinstance(
            e, (FileNotFoundError, NotADirectoryError, UnicodeDecodeError, json.JSONDecodeError)
        ):
            return True
        text = str(e)
        if any(word.lower() in text.lower() for word in _CORRUPTION_WORDS):
            return True
    return False


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


def _check_shapes(params: Any, abstract_params: Any, where: str) -> None:
    """Raises ``CheckpointMismatch`` naming the first parameter of ``params`` whose shape
    is not its ``abstract_params`` counterpart's (numpy restores do not check it)."""
    found = jax.tree_util.tree_flatten_with_path(params)[0]
    wanted = jax.tree.leaves(abstract_params)
    for (path, got), want in zip(found, wanted, strict=True):
        if tuple(np.shape(got)) != tuple(want.shape):
            raise CheckpointMismatch(
                f"{where} holds {jax.tree_util.keystr(path)} of shape {tuple(np.shape(got))}, "
                f"but this model's is {tuple(want.shape)}: it was trained with another model "
                "shape; start from a run of the same model.* sizes."
            )


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
      read_backoff: how a read that failed with a transient error is retried
        (``restore``); the default waits about 1, 2, 4, 8, 16 s (~30 s in all) over 6
        attempts, enough for a network filesystem or bucket to recover from a blip.

    Raises:
      ValueError: ``max_to_keep`` < 1 or ``keep_best_mode`` neither max nor min.
    """

    def __init__(
        self,
        directory: str,
        max_to_keep: int = 3,
        keep_best_by: str = "",
        keep_best_mode: str = "max",
        read_backoff: Backoff | None = None,
    ):
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep!r}.")
        if keep_best_mode not in ("max", "min"):
            raise ValueError(f"keep_best_mode must be 'max' or 'min', got {keep_best_mode!r}.")
        self.directory = directory if "://" in directory else os.path.abspath(directory)
        self.keep_best_by = keep_best_by
        self.read_backoff = read_backoff or READ_BACKOFF
        sign = 1.0 if keep_best_mode == "max" else -1.0

        def score(metrics: dict[str, float]) -> float:
            # Saved under another keep_best_by (changed on resume): never the best.
            value = metrics.get(keep_best_by)
            return -float("inf") if value is None else sign * float(value)

        best_fn = score if keep_best_by else None
        keep = [checkpoint_managers.LatestN(n=max_to_keep)]
        if best_fn is not None:  # orbax keeps the highest best_fn; checkpoints without metrics
            keep.append(
                checkpoint_managers.BestN(  # (the one before RL) only by recency
                    get_metric_fn=best_fn, n=1, keep_checkpoints_without_metrics=False
                )
            )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                # best_fn also makes orbax write each step's metrics, so a resumed run
                # still knows which checkpoint was best.
                best_fn=best_fn,
                create=True,
                enable_async_checkpointing=True,
                preservation_policy=checkpoint_managers.AnyPreservationPolicy(keep),
            ),
            item_names=("state", "extras"),
        )

    def save(
        self,
        step: int,
        train_state: TrainState,
        extras: dict[str, Any],
        metrics: dict[str, float] | None = None,
    ) -> None:
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
                f"such key (they have {sorted(metrics)}); name one of those."
            )
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
        self, step: int | None, abstract_state: TrainState, *, among: list[int] | None = None
    ) -> tuple[TrainState, dict[str, Any]]:
        """Restores ``(train_state, extras)`` into the structure and dtypes of
        ``abstract_state`` (a ``TrainState`` of arrays or of ``jax.ShapeDtypeStruct``,
        e.g. from ``jax.eval_shape`` or a freshly created state).

        Every read goes through ``_read``: a transient error (``is_transient``) is retried
        with backoff, and only a checkpoint proven unreadable (``is_corruption``, the same
        evidence on a second read) counts as damaged. With ``step=None`` the newest
        checkpoint (of ``among``, when given: the steps every host of a group can read)
        is used; a damaged one is moved aside (``<directory>-corrupt/``, with a
        ``.reason.json`` beside it) with a logged error, and the next older one is tried.
        An explicit ``step`` is restored as is, with no fallback.

        Raises:
          FileNotFoundError: no checkpoint in the directory (or of ``among``), or no
            checkpoint ``step``.
          CheckpointUnavailable: a transient error persisted past the retries; nothing was
            moved and no older step was restored.
          CheckpointMismatch: the checkpoint does not fit ``abstract_state`` (another
            model shape or optimizer: the config changed), or another error that is no
            evidence of damage; nothing was moved.
          CheckpointCorrupt: an explicit ``step`` is damaged, or with ``step=None`` every
            candidate is (all moved aside).
        """
        steps = self.all_steps()
        if among is not None:
            steps = sorted(set(steps) & {int(s) for s in among})
        if not steps:
            raise FileNotFoundError(
                f"No checkpoint found in {self.directory}"
                + (f" among the steps {sorted(among)}" if among is not None else "")
                + "; resume a run that has one, or start a new run."
            )
        if step is not None:
            if int(step) not in steps:
                raise FileNotFoundError(
                    f"No checkpoint for step {step} in {self.directory}; available: {steps}."
                )
            return self._read(int(step), abstract_state)
        damaged = []
        for candidate in reversed(steps):
            try:
                return self._read(candidate, abstract_state)
            except CheckpointCorrupt as e:
                damaged.append(str(e))
                self._quarantine(candidate, e.reason)
        raise CheckpointCorrupt(
            f"every checkpoint in {self.directory} is damaged (moved to "
            f"{self.directory.rstrip('/')}-corrupt/):\n" + "\n".join(damaged),
            reason="",
        )

    def _read(
        self, step: int, abstract_state: TrainState | None
    ) -> tuple[TrainState | None, dict[str, Any]]:
        """``_restore(step)`` with the retry policy of ``restore`` (``read_backoff``); with
        ``abstract_state`` None, the extras alone (``(None, extras)``)."""

        def load() -> tuple[TrainState | None, dict[str, Any]]:
            if abstract_state is None:
                restored = self._manager.restore(
                    step, args=ocp.args.Composite(extras=ocp.args.JsonRestore())
                )
                return None, dict(restored["extras"] or {})
            return self._restore(step, abstract_state)

        return self._retried(step, load)

    def _retried(self, step: int, load: Callable[[], T]) -> T:
        """``load()`` (a read of checkpoint ``step``) under ``read_backoff``: transient
        errors are retried, the same corruption seen twice raises ``CheckpointCorrupt``,
        anything else ``CheckpointMismatch``."""
        rng = random.Random(step)
        evidence: BaseException | None = None
        attempts = self.read_backoff.max_attempts
        for attempt in range(attempts):
            try:
                return load()
            except Exception as e:  # noqa: BLE001 - sorted below; none is swallowed
                error = e
            what = f"{type(error).__name__}: {str(error)[:500]}"
            if is_corruption(error):
                if evidence is not None and is_corruption(evidence):
                    raise CheckpointCorrupt(
                        f"checkpoint step {step} in {self.directory} is unreadable: {what}",
                        reason=what,
                    ) from error
                evidence = error  # a second read tells damage from a file still arriving
            elif is_transient(error):
                evidence = error
            else:
                raise CheckpointMismatch(
                    f"checkpoint step {step} in {self.directory} does not restore into this "
                    f"learner ({what}). This is no evidence of a damaged file, so nothing was "
                    "moved and no older step was tried: was the run's config.yaml (model "
                    "shape, optimizer, advantage estimator) changed since it was saved?"
                ) from error
            if attempt + 1 >= attempts:
                break
            delay = self.read_backoff.delay_s(attempt, rng)
            logger.warning(
                "Reading checkpoint step %d in %s failed (%s); retrying in %.1f s "
                "(attempt %d of %d).",
                step,
                self.directory,
                what,
                delay,
                attempt + 1,
                attempts,
            )
            time.sleep(delay)
        raise CheckpointUnavailable(
            f"checkpoint step {step} in {self.directory} could not be read in {attempts} "
            f"attempts over ~{self.read_backoff.max_total_delay_s():.0f} s of backoff, failing "
            f"with transient errors (last: {what}). It was left in place and no older step "
            "was restored; fix the storage (network filesystem, bucket, device memory) and "
            "resume."
        ) from error

    def read_extras(self, step: int | None = None) -> dict[str, Any]:
        """The JSON extras of checkpoint ``step`` (default: the newest), without loading
        the model: data position, policy version, the orchestrator's state and ledger. A
        transient error is retried as in ``restore``.

        Raises:
          FileNotFoundError: no checkpoint, or none for ``step``.
          CheckpointUnavailable, CheckpointCorrupt, CheckpointMismatch: as ``restore``.
        """
        steps = self.all_steps()
        if step is None and steps:
            step = steps[-1]
        if step not in steps:
            raise FileNotFoundError(
                f"No checkpoint for step {step} in {self.directory}; available: {steps}."
            )
        return self._read(int(step), None)[1]

    def _quarantine(self, step: int, reason: str) -> None:
        """Moves the damaged checkpoint ``step`` aside, to ``<directory>-corrupt/<step>-<unix
        time>``, with ``<step>-<unix time>.reason.json`` beside it (the step, where it was,
        the error that proved it unreadable), so the resumed run can save that step again;
        nothing is deleted. A remote directory (``gs://``) is left as it is; the error log
        says so."""
        source = os.path.join(self.directory, str(step))
        if "://" in self.directory:
            logger.error(
                "CHECKPOINT DAMAGED: step %d in %s is unreadable (%s); remote "
                "directories are not moved: delete it by hand before that step is "
                "saved again.",
                step,
                self.directory,
                reason,
            )
            return
        aside = self.directory.rstrip("/") + "-corrupt"
        os.makedirs(aside, exist_ok=True)
        target = os.path.join(aside, f"{step}-{int(time.time())}")
        try:
            os.replace(source, target)
        except FileNotFoundError:  # another host of a group moved it first
            logger.error(
                "CHECKPOINT DAMAGED: step %d in %s is unreadable (%s); already moved aside.",
                step,
                self.directory,
                reason,
            )
            self._manager.reload()
            return
        record = {
            "step": step,
            "directory": self.directory,
            "moved_to": target,
            "reason": reason,
            "time": time.time(),
        }
        with open(target + ".reason.json", "w") as f:
            json.dump(record, f, indent=1)
        logger.error(
            "CHECKPOINT DAMAGED: step %d in %s is unreadable (%s); moved to %s, and "
            "the run goes on from an older step.",
            step,
            self.directory,
            reason,
            target,
        )
        self._manager.reload()

    def restore_params(self, abstract_params: Any) -> tuple[Any, int]:
        """The policy parameters alone of the newest checkpoint that reads, into the
        structure, shapes and dtypes of ``abstract_params`` (arrays or
        ``jax.ShapeDtypeStruct``); the optimizer state, step and extras are not read, so a
        checkpoint of any optimizer or advantage estimator serves (``model.init_from``).

        Read-only: the directory may be another run's, so a damaged step is skipped (and
        logged), never moved aside as ``restore`` does with the run's own.

        Returns:
          ``(params as numpy arrays, the step they came from)``.

        Raises:
          FileNotFoundError: no checkpoint in the directory.
          CheckpointMismatch: the newest readable checkpoint holds another model shape.
          CheckpointUnavailable: a transient error persisted past the retries.
          CheckpointCorrupt: every checkpoint is damaged.
        """
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"No checkpoint found in {self.directory}.")
        item = {"params": abstract_params}
        args = ocp.args.PyTreeRestore(
            item=item,
            restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=True,
        )
        # A manager of its own: this one's has registered the full-state handler, which
        # cannot read a part of the tree; read_only, as the files may be another run's.
        reader = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(read_only=True)
        )
        damaged = []
        try:
            for step in reversed(steps):

                def load(step: int = step) -> Any:
                    restored = reader.restore(step, args=ocp.args.Composite(state=args))
                    return restored["state"]["params"]

                try:
                    params = self._retried(step, load)
                except CheckpointCorrupt as e:
                    damaged.append(str(e))
                    logger.error("%s; trying the next older step (left in place).", e)
                    continue
                _check_shapes(
                    params, abstract_params, f"checkpoint step {step} in {self.directory}"
                )
                return params, step
        finally:
            reader.close()
        raise CheckpointCorrupt(
            f"every checkpoint in {self.directory} is damaged:\n" + "\n".join(damaged),
            reason="; ".join(damaged),
        )

    def _restore(self, step: int, abstract_state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_as_tree(abstract_state)),
                extras=ocp.args.JsonRestore(),
            ),
        )
        tree = restored["state"]
        state = TrainState(
            params=tree["params"],
            opt_state=tree["opt_state"],
            step=tree["step"],
            rng=tree["rng"],
            value_head=tree.get("value_head"),
            value_opt_state=tree.get("value_opt_state"),
        )
        return state, dict(restored["extras"] or {})

    def close(self) -> None:
        """Waits for pending writes and releases the manager's resources."""
        self._manager.close()
