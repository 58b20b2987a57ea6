"""Routing over engine replicas: least loaded, and a session's turns where its KV lives."""

import pytest

from raytunix.inference.router import EngineRouter
from raytunix.types import GenerationRequest, SamplingParams


def _request(rid, session=None):
    return GenerationRequest(
        request_id=rid, prompt_ids=(1, 2), sampling=SamplingParams(), session_id=session
    )


def test_requests_go_to_the_least_loaded_replica():
    router = EngineRouter(3)
    placed = [router.acquire(_request(f"r{i}")) for i in range(6)]
    assert placed == [0, 1, 2, 0, 1, 2]
    router.release(_request("r1"))
    router.release(_request("r4"))
    assert router.in_flight == (2, 0, 2)
    assert router.acquire(_request("r6")) == 1


def test_a_session_stays_on_its_replica_until_it_ends():
    router = EngineRouter(2)
    first = router.acquire(_request("t0", session="ep"))
    router.release(_request("t0", session="ep"))
    for i in range(3):  # load the session's replica: its turns still go there
        router.acquire(_request(f"other{i}"))
    busy = router.in_flight
    turn = router.acquire(_request("t1", session="ep"))
    assert turn == first and busy[first] >= busy[1 - first]
    assert router.end_session("ep") == first
    assert router.end_session("ep") is None  # forgotten: the next turn goes anywhere


def test_bad_use_is_refused():
    with pytest.raises(ValueError, match="num_replicas"):
        EngineRouter(0)
    router = EngineRouter(1)
    router.acquire(_request("x"))
    with pytest.raises(ValueError, match="already in flight"):
        router.acquire(_request("x"))
