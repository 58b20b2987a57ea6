"""What the OpenAI-compatible gateway costs: the same multi-turn workload as native episodes
(``engine.generate`` called directly) and as agent programs (the real ``openai`` client in a
thread per episode, over HTTP to ``raytunix.gateway.Gateway`` in front of the same engine).

Claim (issue "Train an agent you already have"): at 64 concurrent episodes the programs'
generated tokens/s is at least 0.8 of the native episodes', and a call through the gateway
costs at most 2 ms more than the same call made directly, on 2 CPU cores.

Workload (the shape of ``engine_throughput.py``'s): 64 episodes = 16 prompts x 4 samples; a
prompt is a system prompt all episodes share (200 tokens) and a question of its own (150);
3 turns of 32 generated tokens at temperature 1; after each turn a tool reply of 20 tokens
is appended (latency 0 by default, ``--latency-s``). Token ids are random bytes of the
byte-level tokenizer, the model the default ``ModelConfig`` dims with random weights. One
change from ``engine_throughput.py``, in both arms alike: each turn's context carries 32
placeholder ids where the turn's generated tokens were, since a program reads back text, not
ids; both arms send identical prompts, so the engine does identical work, and each episode
keeps its engine session (the gateway's own per-episode session). Both arms stop on the
chat template's end-of-turn id (what the gateway adds to every call).

Measured in one process, one engine: after one warm-up run of each arm (compiles), the arms
alternate ``--repeats`` times; each reports mean, median and worst tokens/s. The per-call
overhead is measured alone, one call at a time: ``--calls`` identical 8-token calls made
directly and through the gateway, alternating; ``overhead_ms_per_call`` is the difference of
the medians (``_mean`` and ``_p90`` beside it). Not measured here: a cold process (the engine
and the gateway compile and start once per run) and Ray between the gateway and the engine
(the run's orchestrator actor reaches the engine over Ray for native episodes too).

Prints one JSON object. Run: ``python benchmarks/gateway_overhead.py`` (a few minutes on 2
CPU cores; ``--prompts 2 --group-size 2 --repeats 1`` for a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import platform
import random
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import openai  # noqa: E402

from raytunix.gateway import Gateway, make_renderer  # noqa: E402
from raytunix.inference.engine import InferenceEngine  # noqa: E402
from raytunix.models.llama import ModelConfig, init_model  # noqa: E402
from raytunix.models.tokenizer import Tokenizer  # noqa: E402
from raytunix.types import GenerationRequest, SamplingParams  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--system-tokens", type=int, default=200)
    p.add_argument("--question-tokens", type=int, default=150)
    p.add_argument("--tool-tokens", type=int, default=20)
    p.add_argument("--latency-s", type=float, default=0.0, help="tool latency, jittered +-50%%")
    p.add_argument("--concurrency", type=int, default=64, help="episodes in flight")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--calls", type=int, default=60, help="calls per arm for the per-call overhead")
    return p.parse_args(argv)


def workload(args, seed: int = 0) -> list[list[list[int]]]:
    """Per episode, the token ids added before each turn: the prompt, then per later turn
    the placeholders for the previous turn's tokens and the tool reply."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(256) for _ in range(n)]

    system = ids(args.system_tokens)
    prompts = [system + ids(args.question_tokens) for _ in range(args.prompts)]
    return [
        [prompts[e // args.group_size]]
        + [ids(args.new_tokens) + ids(args.tool_tokens) for _ in range(args.turns - 1)]
        for e in range(args.prompts * args.group_size)
    ]


class Arms:
    """The engine, the gateway in front of it and the two ways to play one episode."""

    def __init__(self, args, engine: InferenceEngine, gateway: Gateway, stop_ids, loop):
        self.args, self.engine, self.gateway, self.stop_ids = args, engine, gateway, stop_ids
        self.loop = loop
        self.pool = concurrent.futures.ThreadPoolExecutor(args.concurrency)
        self.runs = 0
        self.client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="-", max_retries=0)

    async def native(self, index: int, pieces: list[list[int]], tag: str) -> int:
        """One episode calling the engine directly; returns tokens generated."""
        context: list[int] = []
        generated = 0
        session = f"{tag}/native/{index}"
        for turn, piece in enumerate(pieces):
            context += piece
            sampling = SamplingParams(
                max_new_tokens=self.args.new_tokens,
                temperature=1.0,
                stop_token_ids=self.stop_ids,
            )
            result = await self.engine.generate(
                GenerationRequest(
                    request_id=f"{session}/{turn}",
                    prompt_ids=tuple(context),
                    sampling=sampling,
                    seed=index * 1000 + turn,
                    session_id=session,
                )
            )
            generated += len(result.token_ids)
            await self._tool()
        self.engine.end_session(session)
        return generated

    async def program(self, index: int, pieces: list[list[int]], tag: str) -> int:
        """One episode as an agent program: the openai client in a thread of its own."""
        base_url, key = self.gateway.open_episode(f"{tag}/program/{index}", seed=index * 1000)
        latency = self.args.latency_s
        jitter = random.Random(index)

        def play() -> int:
            client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
            context: list[int] = []
            generated = 0
            for piece in pieces:
                context += piece
                reply = client.completions.create(
                    model="raytunix",
                    prompt=context,
                    max_tokens=self.args.new_tokens,
                    temperature=1.0,
                )
                generated += reply.usage.completion_tokens
                if latency > 0:
                    time.sleep(latency * jitter.uniform(0.5, 1.5))
            client.close()
            return generated

        try:
            return await self.loop.run_in_executor(self.pool, play)
        finally:
            self.gateway.close_episode(key)

    async def _tool(self) -> None:
        if self.args.latency_s > 0:
            await asyncio.sleep(self.args.latency_s * random.uniform(0.5, 1.5))

    async def run(self, arm: str) -> dict:
        """All episodes of the workload through ``arm``, ``concurrency`` at a time."""
        self.runs += 1
        tag = f"r{self.runs}"
        episodes = workload(self.args)
        places = asyncio.Semaphore(self.args.concurrency)
        play = self.native if arm == "native" else self.program

        async def one(i: int) -> int:
            async with places:
                return await play(i, episodes[i], tag)

        start = time.perf_counter()
        generated = sum(await asyncio.gather(*(one(i) for i in range(len(episodes)))))
        wall = time.perf_counter() - start
        calls = len(episodes) * self.args.turns
        return {
            "generated_tokens": generated,
            "wall_s": round(wall, 3),
            "tokens_per_s": round(generated / wall, 1),
            "calls": calls,
        }

    async def single_call_s(self, arm: str, prompt: list[int], i: int) -> float:
        """Seconds of one greedy 8-token call of ``prompt`` made alone through ``arm``
        (greedy: both arms generate the same tokens, so the engine's work is equal)."""
        sampling = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=self.stop_ids)
        if arm == "native":
            start = time.perf_counter()
            await self.engine.generate(
                GenerationRequest(
                    request_id=f"single/{i}", prompt_ids=tuple(prompt), sampling=sampling, seed=i
                )
            )
            return time.perf_counter() - start
        _, key = self.gateway.open_episode(f"single/{i}", seed=i)
        # One HTTP client for all single calls (its connection kept open, as a program's is
        # between its calls); each call an episode of its own, as each native call is alone.
        client = self.client.with_options(api_key=key)

        def call() -> float:
            start = time.perf_counter()
            client.completions.create(
                model="raytunix", prompt=prompt, max_tokens=8, temperature=0.0
            )
            return time.perf_counter() - start

        try:
            return await self.loop.run_in_executor(self.pool, call)
        finally:
            self.gateway.close_episode(key)


def spread(values: list[float], digits: int = 1, worst=min) -> dict:
    """Mean, median and worst (``worst``: min for a rate, max for a latency)."""
    return {
        "mean": round(statistics.fmean(values), digits),
        "median": round(statistics.median(values), digits),
        "worst": round(worst(values), digits),
    }


async def measure(args) -> dict:
    tokenizer = Tokenizer.byte_level()
    max_seq_len = -(-(args.system_tokens + args.question_tokens + 2 * args.turns * 64) // 64) * 64
    config = ModelConfig(vocab_size=tokenizer.vocab_size, max_seq_len=max_seq_len)
    graphdef, params = init_model(config, seed=0)
    engine = InferenceEngine(
        graphdef,
        params,
        config,
        tokenizer,
        max_batch_size=args.max_batch_size,
        max_seq_len=max_seq_len,
        compile_ahead=True,
    )
    renderer = make_renderer(tokenizer, "raytunix")
    gateway = Gateway(engine, renderer, vocab_size=tokenizer.vocab_size)
    await gateway.start()
    arms = Arms(args, engine, gateway, tuple(renderer.stop_token_ids), asyncio.get_running_loop())
    try:
        await asyncio.to_thread(engine.wait_until_compiled, 900)
        warmup = {arm: await arms.run(arm) for arm in ("native", "program")}
        runs: dict[str, list[dict]] = {"native": [], "program": []}
        for _ in range(args.repeats):
            for arm in ("native", "program"):
                runs[arm].append(await arms.run(arm))
        prompt = workload(args, seed=1)[0][0]
        single: dict[str, list[float]] = {"native": [], "program": []}
        for i in range(-5, args.calls):  # 5 calls each first: connection and programs warm
            for arm in ("native", "program"):
                seconds = await arms.single_call_s(arm, prompt, i)
                if i >= 0:
                    single[arm].append(seconds)
    finally:
        await gateway.stop()
        arms.client.close()
        arms.pool.shutdown(wait=False)
    rates = {arm: [r["tokens_per_s"] for r in runs[arm]] for arm in runs}
    ms = {arm: sorted(1000 * s for s in single[arm]) for arm in single}

    def p90(values: list[float]) -> float:
        return values[min(len(values) - 1, int(0.9 * len(values)))]

    return {
        "tokens_per_s_ratio_vs_native": round(
            statistics.fmean(rates["program"]) / statistics.fmean(rates["native"]), 3
        ),
        "overhead_ms_per_call": round(
            statistics.median(ms["program"]) - statistics.median(ms["native"]), 2
        ),
        "overhead_ms_per_call_mean": round(
            statistics.fmean(ms["program"]) - statistics.fmean(ms["native"]), 2
        ),
        "overhead_ms_per_call_p90": round(p90(ms["program"]) - p90(ms["native"]), 2),
        "single_call_ms": {arm: spread(ms[arm], 2, worst=max) for arm in ms},
        "tokens_per_s": {arm: spread(rates[arm]) for arm in rates},
        "wall_overhead_ms_per_call": round(
            1000
            * (
                statistics.fmean(r["wall_s"] for r in runs["program"])
                - statistics.fmean(r["wall_s"] for r in runs["native"])
            )
            / runs["native"][0]["calls"],
            2,
        ),
        "warmup_runs": warmup,
        "runs": runs,
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = {
        **asyncio.run(measure(args)),
        "settings": vars(args),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
