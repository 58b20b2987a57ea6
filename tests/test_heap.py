"""raytunix.cluster.heap: actor processes take their start-up heap out of the garbage collector's
scans and collect the young generation less often; other processes are left alone."""

from __future__ import annotations

import gc

import pytest

from raytunix.cluster import heap


@pytest.fixture
def restore_gc():
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_settle_freezes_what_is_alive_and_raises_the_young_threshold(restore_gc):
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    frozen = heap.settle(actors_only=False)
    assert frozen == gc.get_freeze_count() > 1000  # this interpreter's modules at least
    assert gc.get_threshold() == (heap.YOUNG_THRESHOLD, 10, 10)


def test_a_learner_process_only_freezes(restore_gc):
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    assert heap.settle(actors_only=False, young_threshold=None) > 1000
    assert gc.get_threshold() == (700, 10, 10)


def test_settle_leaves_a_process_that_is_no_actor_alone(restore_gc):
    gc.unfreeze()
    before = gc.get_threshold()
    assert heap.settle() == 0  # pytest's process is no Ray actor
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before


def test_settle_can_be_switched_off_and_keeps_a_disabled_threshold(restore_gc, monkeypatch):
    gc.unfreeze()
    monkeypatch.setenv(heap.ENABLE_ENV, "0")
    assert heap.settle(actors_only=False) == 0 and gc.get_freeze_count() == 0
    monkeypatch.delenv(heap.ENABLE_ENV)
    gc.set_threshold(0)  # the user switched automatic collection off: keep it off
    heap.settle(actors_only=False)
    assert gc.get_threshold()[0] == 0


@pytest.mark.slow
def test_an_env_actor_process_runs_with_the_settled_collector(ray_session):
    import ray

    from raytunix.rollout.env_pool import EnvActor

    actor = ray.remote(EnvActor).remote("calculator_math", {})
    try:
        threshold, frozen = ray.get(
            actor.__ray_call__.remote(
                lambda self: (__import__("gc").get_threshold(), __import__("gc").get_freeze_count())
            )
        )
    finally:
        ray.kill(actor)
    assert threshold[0] == heap.YOUNG_THRESHOLD
    assert frozen > 10_000  # Ray, the env's modules: the actor's start-up heap
