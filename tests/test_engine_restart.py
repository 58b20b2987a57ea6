"""An engine replica that crashes (disaggregated placement) costs time, not the run: Ray
restarts it under the same handle, it takes the learner's weights before it serves (not
the weights it was first built with), and the driver's weight publish asks a replica that
died while taking them again. A replica dead for good stops the run with one clear error.
(``benchmarks/chaos.py`` kills replicas by SIGKILL inside whole runs.)"""

import os
import time
import types

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

from raytunix.config import load_config  # noqa: E402
from raytunix.driver.job import Job  # noqa: E402
from raytunix.driver.run_dir import RunError  # noqa: E402
from raytunix.inference.actor import EngineActor  # noqa: E402
from raytunix.learner.actor import LearnerActor  # noqa: E402
from raytunix.models.llama import ModelConfig  # noqa: E402
from raytunix.models.tokenizer import Tokenizer  # noqa: E402
from raytunix.types import GenerationRequest, SamplingParams  # noqa: E402

# Every test here runs end to end (a Ray session, a train, a benchmark): the slow tier.
pytestmark = pytest.mark.slow

TOKENIZER = Tokenizer.byte_level()
CONFIG = ModelConfig(
    vocab_size=TOKENIZER.vocab_size,
    d_model=32,
    n_layers=1,
    n_heads=2,
    n_kv_heads=1,
    d_ff=64,
    max_seq_len=64,
)
ENGINE_KWARGS = {"max_batch_size": 2, "block_size": 16}
LEARNER_SEED, ENGINE_SEED = 1, 2  # the engine's own first weights differ from the learner's


def _greedy(ray, engine) -> tuple:
    """A greedy reply's tokens and their logprobs (a tiny random model's greedy tokens
    repeat alike under many weights; the logprobs tell the weights apart)."""
    request = GenerationRequest(
        request_id="r",
        prompt_ids=tuple(range(5, 21)),
        seed=0,
        sampling=SamplingParams(max_new_tokens=6, temperature=0.0),
    )
    deadline = time.monotonic() + 300
    while True:  # a restarting actor fails calls at once, as the episode's retries expect
        try:
            result = ray.get(engine.generate.remote(request), timeout=300)
            break
        except ray.exceptions.ActorUnavailableError:
            assert time.monotonic() < deadline, "the engine did not come back within 300 s"
            time.sleep(0.5)
    return tuple(result.token_ids), tuple(round(x, 4) for x in result.logprobs)


def _engine(ray, weights_source, max_restarts):
    return (
        ray.remote(EngineActor)
        .options(num_cpus=0, max_concurrency=100, max_restarts=max_restarts)
        .remote(CONFIG, ENGINE_SEED, TOKENIZER, ENGINE_KWARGS, weights_source=weights_source)
    )


def _driver_job(learner, engines):
    """What ``Job.publish_weights`` reads of a disaggregated run's ``Job``."""
    job = types.SimpleNamespace(
        colocated=False,
        learner=learner,
        engines=engines,
        learner_group=False,
        cfg=load_config(None, ["engine.actor_max_restarts=1"]),
    )
    job.learner_get = types.MethodType(Job.learner_get, job)  # the real deadline-bound wait
    return job


@pytest.fixture(scope="module")
def learner(ray_session):
    actor = (
        ray_session.remote(LearnerActor)
        .options(num_cpus=0, max_concurrency=10)
        .remote(CONFIG, LEARNER_SEED, TOKENIZER.pad_id)
    )
    yield actor
    ray_session.kill(actor)


@pytest.fixture(scope="module")
def learner_reply(ray_session, learner):
    """The greedy reply under the learner's weights, from an engine that was given them."""
    reference = _engine(ray_session, None, 0)
    own = _greedy(ray_session, reference)
    ray_session.get(reference.update_weights.remote(learner.weights.remote()))
    reply = _greedy(ray_session, reference)
    ray_session.kill(reference)
    assert own != reply  # the two seeds' weights answer differently: the check can fail
    return reply


def test_a_restarted_engine_replica_serves_the_learners_weights_not_its_first_ones(
    ray_session, learner, learner_reply
):
    engine = _engine(ray_session, learner, max_restarts=1)
    try:
        before = _greedy(ray_session, engine)
        ray_session.kill(engine, no_restart=False)  # a crash: Ray restarts it
        after = _greedy(ray_session, engine)  # waits for the restart, same handle
    finally:
        ray_session.kill(engine)
    assert before != learner_reply  # the first start serves its own weights until a publish
    assert after == learner_reply


def test_a_weight_publish_to_a_replica_that_crashed_reaches_it_once_restarted(
    ray_session, learner, learner_reply
):
    engine = _engine(ray_session, None, max_restarts=1)  # no source: only the publish helps
    try:
        ray_session.get(engine.engine_stats.remote(), timeout=300)  # up
        ray_session.kill(engine, no_restart=False)
        Job.publish_weights(_driver_job(learner, [engine]))
        assert _greedy(ray_session, engine) == learner_reply
    finally:
        ray_session.kill(engine)


def test_a_replica_dead_for_good_stops_the_publish_with_an_error_naming_the_key(
    ray_session, learner
):
    engine = _engine(ray_session, learner, max_restarts=0)
    ray_session.get(engine.engine_stats.remote(), timeout=300)
    ray_session.kill(engine)
    with pytest.raises(RunError, match=r"engine replica 0 .*engine\.actor_max_restarts=1"):
        Job.publish_weights(_driver_job(learner, [engine]))
