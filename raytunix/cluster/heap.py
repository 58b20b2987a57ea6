"""Python's cyclic garbage collector in raytunix's actor processes.

An actor's heap after start-up (Ray, JAX, the model, compiled programs) holds 90,000 to
340,000 objects that the collector tracks and that stay alive for the actor's life.
CPython's collector (the generational scheme of its ``gc`` module) scans all of them in
every full collection, and starts a young-generation collection every 700 net allocations
of tracked objects. On the rollout benchmark (``benchmarks/profiling_overhead.py``, which
reports each process's collector time) that cost the engine, the benchmark's bottleneck,
~27 ms of every second: full collections of 120-180 ms about every 10 s, and ~16 young
collections a second of ~0.8 ms each, set off by the transient objects of a decode step.
Spans held between two profiling drains added to both.

``settle()``, called by each actor at the end of its start-up (and by the engine after it
compiles), collects once, then freezes what is alive (``gc.freeze``: moved to a permanent
generation that collections skip) and, in the rollout's actors (engine, orchestrator, env
and sandbox actors; not the learner's), raises the young generation's threshold to
``YOUNG_THRESHOLD`` net allocations. What the hot loops allocate dies young and is freed by
reference counting, so collections become rare; cyclic garbage made after ``settle()`` is
still collected, up to ``YOUNG_THRESHOLD`` objects later. A frozen object is never
collected: start-up state that later turns into cyclic garbage stays in memory, which is
why only actor processes, whose start-up state lives as long as they do, settle.
``RAYTUNIX_GC_TUNING=0`` leaves the collector as Python sets it (to compare, or to chase a
leak).
"""

from __future__ import annotations

import gc
import os

YOUNG_THRESHOLD = 20_000  # net allocations of tracked objects between young collections
ENABLE_ENV = "RAYTUNIX_GC_TUNING"


def tuning_enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def settle(*, actors_only: bool = True, young_threshold: int | None = YOUNG_THRESHOLD) -> int:
    """Collects, freezes the objects alive now and raises the young-generation threshold
    (module docstring), unless ``RAYTUNIX_GC_TUNING=0``. Call it when a process's
    long-lived state is built; again after building more is harmless (a full collection,
    ~0.1-0.2 s on an engine's heap).

    Args:
      actors_only: only in a Ray actor's process (an actor class built in a test or a
        notebook leaves that process's collector alone: objects frozen there that later
        turn into cyclic garbage would never be freed).
      young_threshold: the young generation's threshold to raise Python's 700 to, or None
        to only freeze. Learner processes pass None: a reference cycle there can hold a
        batch or a copy of the parameters, and under a high threshold hundreds of such
        cycles could pile up before a collection frees them (the rollout actors made no
        cyclic garbage to speak of: none of them reached 20,000 in 20 minutes).

    Returns:
      the number of frozen objects (``gc.get_freeze_count()``); 0 when nothing was done.
    """
    if not tuning_enabled() or (actors_only and not _in_actor_process()):
        return 0
    gc.collect()
    gc.freeze()
    young, *older = gc.get_threshold()
    if young_threshold and 0 < young < young_threshold:  # 0: collection is off; keep it so
        gc.set_threshold(young_threshold, *older)
    return gc.get_freeze_count()


def _in_actor_process() -> bool:
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001 - no Ray, or no worker here: not an actor
        return False
