"""``RayEngineClient.engine_stats``: what the adaptive concurrency controller reads from
engine replicas on Ray (tiny stand-in actors, no JAX)."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from raytunix.rollout.actor import RayEngineClient
from raytunix.types import EngineFailure

# Every test here runs end to end (a Ray session, a train, a benchmark): the slow tier.
pytestmark = pytest.mark.slow


def stand_in_classes():
    """Defined in a function so that Ray ships them by value: the workers cannot import
    this test module."""

    class ReplicaStats:
        """Stands in for an engine replica: reports fixed counters."""

        def __init__(self, busy_s: float):
            self.busy_s = busy_s

        def engine_stats(self) -> dict:
            return {"busy_s": self.busy_s, "wall_s": 10.0, "waiting": 0, "preemptions": 0}

        def generate(self, request):
            raise NotImplementedError("not called in these tests")

    class NoStats:
        def generate(self, request):
            raise NotImplementedError("not called in these tests")

    return ReplicaStats, NoStats


def wait_until_dead(actor, timeout_s: float = 30.0) -> None:
    """``ray.kill`` returns before the actor is gone: a call sent right after it can still
    be served (the clean-clone CI of bd420b6 saw one). Waits until a call fails."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.engine_stats.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError(f"actor {actor} still answers {timeout_s} s after ray.kill")


def test_stats_of_every_replica_come_back_in_replica_order(ray_session):
    replica_stats, _ = stand_in_classes()
    replicas = [ray_session.remote(replica_stats).options(num_cpus=0).remote(b) for b in (1.0, 7.0)]
    stats = asyncio.run(RayEngineClient(replicas).engine_stats())
    assert [s["busy_s"] for s in stats] == [1.0, 7.0]
    ray_session.kill(replicas[1])
    wait_until_dead(replicas[1])
    with pytest.raises(EngineFailure, match="engine stats unavailable"):
        asyncio.run(RayEngineClient(replicas).engine_stats())
    ray_session.kill(replicas[0])


def test_an_engine_actor_without_stats_is_named(ray_session):
    replica_stats, no_stats = stand_in_classes()
    replicas = [
        ray_session.remote(replica_stats).options(num_cpus=0).remote(0.0),
        ray_session.remote(no_stats).options(num_cpus=0).remote(),
    ]
    with pytest.raises(TypeError, match=r"replicas \[1\].*adaptive_concurrency=false"):
        asyncio.run(RayEngineClient(replicas).engine_stats())
    for r in replicas:
        ray_session.kill(r)
