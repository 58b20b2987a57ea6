"""The engine behind a Ray actor: an episode that gives up frees the engine's row at once,
and a finished episode's session is freed, through ``RayEngineClient``."""

import asyncio
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

from raytunix.inference.actor import EngineActor  # noqa: E402
from raytunix.models.llama import ModelConfig  # noqa: E402
from raytunix.models.tokenizer import Tokenizer  # noqa: E402
from raytunix.rollout.actor import RayEngineClient  # noqa: E402
from raytunix.types import GenerationRequest, SamplingParams  # noqa: E402

# Every test here runs end to end (a Ray session, a train, a benchmark): the slow tier.
pytestmark = pytest.mark.slow

TOKENIZER = Tokenizer.byte_level()
CONFIG = ModelConfig(
    vocab_size=TOKENIZER.vocab_size,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    max_seq_len=512,
)


@pytest.fixture(scope="module")
def engine_actor(ray_session):
    actor = (
        ray_session.remote(EngineActor)
        .options(num_cpus=0, max_concurrency=100)
        .remote(CONFIG, 0, TOKENIZER, {"max_batch_size": 4, "block_size": 16})
    )
    yield actor
    ray_session.kill(actor)


def _request(rid, session=None, max_new_tokens=500):
    return GenerationRequest(
        request_id=rid,
        prompt_ids=tuple(range(5, 25)),
        seed=1,
        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0),
        session_id=session,
    )


def test_a_cancelled_generation_is_aborted_in_the_engine(engine_actor):
    client = RayEngineClient(engine_actor)

    async def main():
        task = asyncio.create_task(client.generate(_request("long")))
        while (await engine_actor.engine_stats.remote())["decode_steps"] < 5:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while (await engine_actor.engine_stats.remote())["active_slots"]:
            await asyncio.sleep(0.01)
        return await engine_actor.engine_stats.remote()

    stats = asyncio.run(main())
    assert stats["requests_finished"] == 1
    # The request stopped long before its 500 tokens.
    assert stats["tokens_generated"] < 400


def test_an_ended_session_frees_its_kv(engine_actor):
    client = RayEngineClient(engine_actor)

    async def main():
        await client.generate(_request("turn1", session="ep", max_new_tokens=3))
        held = (await engine_actor.engine_stats.remote())["sessions_held"]
        client.end_session("ep")
        while (await engine_actor.engine_stats.remote())["sessions_held"]:
            await asyncio.sleep(0.01)
        return held

    assert asyncio.run(main()) == 1
