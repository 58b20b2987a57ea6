"""What the OpenAI-compatible gateway costs: the same multi-turn chat workload as native
episodes (the conversation rendered as raytunix agents render it, ``engine.generate``
called directly) and as agent programs (the real ``openai`` client, ``chat.completions``,
over HTTP to ``raytunix.gateway.Gateway`` in front of the same engine).

Claim (issue "Train an agent you already have"): at 64 concurrent episodes the programs'
generated tokens/s is at least 0.8 of the native episodes', and a call through the gateway
costs at most 2 ms more than the same call made directly, on 2 CPU cores.

Workload (the shape of ``engine_throughput.py``'s): 64 episodes = 16 prompts x 4 samples; a
conversation starts with a system message all episodes share (200 characters, one token
each with the byte-level tokenizer) and a user question of its own (150); 3 turns of 32
generated tokens at temperature 1; after each turn the environment's reply (20 characters)
is appended as a user message (latency 0 by default, ``--latency-s``). Both arms render the
conversation the same way (``EncoderRenderer.chat_prompt``: the model's own replies put
back as the ids it generated when its turn ended, re-encoded from their text when cut at
``max_tokens``), so the engine does identical work; each episode keeps its engine session.
The model is the default ``ModelConfig`` dims with random weights (``--d-model``,
``--n-layers`` and ``--max-seq-len`` shrink it for a smoke run).

The programs run in a process of their own (a thread per episode), apart from the engine's,
as in a training run (there they are threads of the orchestrator actor, beside the gateway,
and the engine an actor of its own; here the gateway shares the engine's process, with no
Ray hop between them). The openai client's own CPU time per call (request
building and validation, httpx, response models: several ms on these cores, paid against
any OpenAI-compatible server) competes with the engine for the 2 cores, so the ratio
includes it. Two program arms: ``program`` (the headline ratio) shares one client per
process, each episode re-aiming it with ``client.with_options(base_url=..., api_key=...)``
(what the README recommends); ``program_client_per_episode`` constructs
``openai.OpenAI(...)`` in every episode, which builds a new httpx client and TLS context
each time (tens of ms of CPU on these cores: per episode, not per call).

Measured in one run, one engine: after one warm-up run of each arm (compiles, the program
process's imports), the three arms alternate ``--repeats`` times; each reports mean, median and
worst tokens/s. The per-call overhead is measured alone, one call at a time: ``--calls``
identical greedy 8-token calls of the first turn, made directly, through the gateway with
a minimal keep-alive HTTP client (``http.client``), and through the gateway with the
openai client, alternating. ``overhead_ms_per_call`` (what the gateway adds: HTTP,
parsing, rendering, recording) is the minimal client's median minus the direct median;
``overhead_ms_per_call_openai_client`` the same with the openai client, so their
difference is the client library's own cost. Not measured here: a cold process, and Ray
between the orchestrator and the engine (a training run has it for native episodes too).

Prints one JSON object. Run: ``python benchmarks/gateway_overhead.py`` (a few minutes on 2
CPU cores; ``--prompts 2 --group-size 2 --repeats 1`` for a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import http.client
import json
import multiprocessing
import os
import platform
import random
import statistics
import string
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import openai  # noqa: E402

from raytunix.gateway import Gateway, make_renderer  # noqa: E402
from raytunix.gateway.protocol import parse_messages  # noqa: E402
from raytunix.inference.engine import InferenceEngine  # noqa: E402
from raytunix.models.llama import ModelConfig, init_model  # noqa: E402
from raytunix.models.tokenizer import Tokenizer  # noqa: E402
from raytunix.types import FinishReason, GenerationRequest, SamplingParams  # noqa: E402

_CHARS = string.ascii_letters + string.digits + " "
# native: in this process; program: agent programs sharing one openai client per process;
# program_client_per_episode: each episode constructs its own openai.OpenAI.
ARMS = ("native", "program", "program_client_per_episode")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--system-tokens", type=int, default=200)
    p.add_argument("--question-tokens", type=int, default=150)
    p.add_argument("--tool-tokens", type=int, default=20)
    p.add_argument("--latency-s", type=float, default=0.0, help="env latency, jittered +-50%%")
    p.add_argument("--concurrency", type=int, default=64, help="episodes in flight")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--calls", type=int, default=60, help="calls per arm for the per-call overhead")
    # The model and context: ModelConfig's dims and a context that fits the conversation,
    # unless given (smaller ones compile fewer, faster programs for a smoke run).
    p.add_argument("--d-model", type=int, default=None, help="model width (ModelConfig's)")
    p.add_argument("--n-layers", type=int, default=None, help="model depth (ModelConfig's)")
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="engine context in tokens (default: system + question + 128 per turn, rounded "
        "up to 64)",
    )
    return p.parse_args(argv)


def workload(args, seed: int = 0) -> list[tuple[list[dict], list[str]]]:
    """Per episode, ``(the first messages, the environment's replies after each turn but
    the last)``; the 4 episodes of a prompt share its messages."""
    rng = random.Random(seed)

    def text(n: int) -> str:
        return "".join(rng.choice(_CHARS) for _ in range(n))

    system = {"role": "system", "content": text(args.system_tokens)}
    starts = [
        [system, {"role": "user", "content": text(args.question_tokens)}]
        for _ in range(args.prompts)
    ]
    return [
        (starts[e // args.group_size], [text(args.tool_tokens) for _ in range(args.turns - 1)])
        for e in range(args.prompts * args.group_size)
    ]


_SHARED: list[openai.OpenAI] = []


def _client(base_url: str, key: str, shared: bool) -> openai.OpenAI:
    """A new client (its own httpx client and TLS context: tens of ms of CPU), or the
    process's one client re-aimed at the episode (``with_options`` shares its connections)."""
    if not shared:
        return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
    if not _SHARED:
        _SHARED.append(openai.OpenAI(base_url=base_url, api_key=key, max_retries=0))
    return _SHARED[0].with_options(base_url=base_url, api_key=key)


def play_programs(jobs: list[tuple], settings: dict) -> int:
    """Runs in the programs' process: each job ``(base_url, api_key, index, messages,
    replies)`` an episode in a thread of its own, as an agent program would play it (with
    a client of its own, or with ``settings["shared_client"]`` the process's one);
    returns the tokens generated (the servers' ``usage``)."""
    latency = settings["latency_s"]

    def play(job) -> int:
        base_url, key, index, messages, replies = job
        client = _client(base_url, key, settings["shared_client"])
        jitter = random.Random(index)
        history, generated = list(messages), 0
        for turn in range(len(replies) + 1):
            reply = client.chat.completions.create(
                model="raytunix",
                messages=history,
                max_tokens=settings["new_tokens"],
                temperature=1.0,
            )
            generated += reply.usage.completion_tokens
            if turn < len(replies):
                history.append({"role": "assistant", "content": reply.choices[0].message.content})
                history.append({"role": "user", "content": replies[turn]})
                if latency > 0:
                    time.sleep(latency * jitter.uniform(0.5, 1.5))
        if not settings["shared_client"]:
            client.close()
        return generated

    if not jobs:  # the warm-up call: imports done, nothing to play
        return 0
    with concurrent.futures.ThreadPoolExecutor(settings["concurrency"]) as pool:
        return sum(pool.map(play, jobs))


class Arms:
    """The engine, the gateway in front of it and the ways to play an episode or a call."""

    def __init__(self, args, engine: InferenceEngine, gateway: Gateway, loop):
        self.args, self.engine, self.gateway, self.loop = args, engine, gateway, loop
        self.renderer = gateway.renderer
        self.threads = concurrent.futures.ThreadPoolExecutor(4)
        self.programs = concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")
        )
        self.runs = 0
        self.client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="-", max_retries=0)
        self.http = http.client.HTTPConnection(gateway.host, gateway.port)

    def _prompt(self, history: list[dict], known: dict) -> tuple[int, ...]:
        return tuple(self.renderer.chat_prompt(parse_messages(history), (), known))

    async def native(self, index: int, episode: tuple, tag: str) -> int:
        """One episode rendered and generated in this process; returns tokens generated."""
        messages, replies = episode
        history, known, generated = list(messages), {}, 0
        session = f"{tag}/native/{index}"
        sampling = SamplingParams(
            max_new_tokens=self.args.new_tokens,
            temperature=1.0,
            stop_token_ids=self.renderer.stop_token_ids,
        )
        for turn in range(len(replies) + 1):
            result = await self.engine.generate(
                GenerationRequest(
                    request_id=f"{session}/{turn}",
                    prompt_ids=self._prompt(history, known),
                    sampling=sampling,
                    seed=index * 1000 + turn,
                    session_id=session,
                )
            )
            generated += len(result.token_ids)
            if turn == len(replies):
                break
            stopped = result.finish_reason == FinishReason.STOP
            reply = self.renderer.reply([], result.token_ids, result.finish_reason, (), False)
            closing = self.renderer.close_turn(result.token_ids, stopped)
            if closing is not None:
                known[reply.key] = [*result.token_ids, *closing]
            history += [
                {"role": "assistant", "content": reply.content},
                {"role": "user", "content": replies[turn]},
            ]
            if self.args.latency_s > 0:
                await asyncio.sleep(self.args.latency_s * random.uniform(0.5, 1.5))
        self.engine.end_session(session)
        return generated

    async def run(self, arm: str) -> dict:
        """All episodes of the workload through ``arm``, ``concurrency`` at a time."""
        self.runs += 1
        tag = f"r{self.runs}"
        episodes = workload(self.args)
        start = time.perf_counter()
        if arm == "native":
            places = asyncio.Semaphore(self.args.concurrency)

            async def one(i: int) -> int:
                async with places:
                    return await self.native(i, episodes[i], tag)

            generated = sum(await asyncio.gather(*(one(i) for i in range(len(episodes)))))
        else:
            opened = [
                self.gateway.open_episode(f"{tag}/{arm}/{i}", seed=i * 1000)
                for i in range(len(episodes))
            ]
            jobs = [(url, key, i, *episodes[i]) for i, (url, key) in enumerate(opened)]
            settings = {**self._settings(), "shared_client": arm == "program"}
            try:
                generated = await self.loop.run_in_executor(
                    self.programs, play_programs, jobs, settings
                )
            finally:
                for _, key in opened:
                    self.gateway.close_episode(key)
        wall = time.perf_counter() - start
        return {
            "generated_tokens": generated,
            "wall_s": round(wall, 3),
            "tokens_per_s": round(generated / wall, 1),
            "calls": len(episodes) * self.args.turns,
        }

    def _settings(self) -> dict:
        keys = ("new_tokens", "latency_s", "concurrency")
        return {k: getattr(self.args, k) for k in keys}

    async def start_programs(self) -> None:
        """Starts the programs' process (its imports) before anything is timed."""
        settings = {**self._settings(), "shared_client": True}
        await self.loop.run_in_executor(self.programs, play_programs, [], settings)

    async def single_call_s(self, arm: str, messages: list[dict], i: int) -> float:
        """Seconds of one greedy 8-token call of ``messages`` made alone through ``arm``
        (``native``, ``http`` or ``openai``; greedy, so every arm generates the same
        tokens). Each call is an episode of its own; the HTTP clients keep their connection
        open between calls, as a program's client does."""
        if arm == "native":
            start = time.perf_counter()
            sampling = SamplingParams(
                max_new_tokens=8, temperature=0.0, stop_token_ids=self.renderer.stop_token_ids
            )
            await self.engine.generate(
                GenerationRequest(
                    request_id=f"single/{i}",
                    prompt_ids=self._prompt(messages, {}),
                    sampling=sampling,
                    seed=i,
                )
            )
            return time.perf_counter() - start
        _, key = self.gateway.open_episode(f"single/{arm}/{i}", seed=i)
        body = {"model": "raytunix", "messages": messages, "max_tokens": 8, "temperature": 0.0}

        def call() -> float:
            start = time.perf_counter()
            if arm == "openai":
                self.client.with_options(api_key=key).chat.completions.create(**body)
            else:
                headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
                self.http.request("POST", "/v1/chat/completions", json.dumps(body), headers)
                response = self.http.getresponse()
                if response.status != 200:
                    raise RuntimeError(f"gateway answered {response.status}: {response.read()}")
                response.read()
            return time.perf_counter() - start

        try:
            return await self.loop.run_in_executor(self.threads, call)
        finally:
            self.gateway.close_episode(key)

    def close(self) -> None:
        self.client.close()
        self.http.close()
        self.threads.shutdown(wait=False)
        self.programs.shutdown(wait=True)


def spread(values: list[float], digits: int = 1, worst=min) -> dict:
    """Mean, median and worst (``worst``: min for a rate, max for a latency)."""
    return {
        "mean": round(statistics.fmean(values), digits),
        "median": round(statistics.median(values), digits),
        "worst": round(worst(values), digits),
    }


async def measure(args) -> dict:
    tokenizer = Tokenizer.byte_level()
    max_seq_len = args.max_seq_len or (
        -(-(args.system_tokens + args.question_tokens + 2 * args.turns * 64) // 64) * 64
    )
    dims = {"d_model": args.d_model, "n_layers": args.n_layers}
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        max_seq_len=max_seq_len,
        **{k: v for k, v in dims.items() if v is not None},
    )
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
    gateway = Gateway(engine, make_renderer(tokenizer, "raytunix"), vocab_size=tokenizer.vocab_size)
    await gateway.start()
    arms = Arms(args, engine, gateway, asyncio.get_running_loop())
    try:
        await asyncio.to_thread(engine.wait_until_compiled, 900)
        await arms.start_programs()
        warmup = {arm: await arms.run(arm) for arm in ARMS}
        runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        for _ in range(args.repeats):
            for arm in ARMS:
                runs[arm].append(await arms.run(arm))
        messages = workload(args, seed=1)[0][0]
        single: dict[str, list[float]] = {"native": [], "http": [], "openai": []}
        for i in range(-5, args.calls):  # 5 calls each first: connections and programs warm
            for arm in single:
                seconds = await arms.single_call_s(arm, messages, i)
                if i >= 0:
                    single[arm].append(seconds)
    finally:
        await gateway.stop()
        arms.close()
    rates = {arm: [r["tokens_per_s"] for r in runs[arm]] for arm in runs}
    ms = {arm: sorted(1000 * s for s in single[arm]) for arm in single}

    def p90(values: list[float]) -> float:
        return values[min(len(values) - 1, int(0.9 * len(values)))]

    def overhead(arm: str, stat) -> float:
        return round(stat(ms[arm]) - stat(ms["native"]), 2)

    def ratio(arm: str) -> float:
        return round(statistics.fmean(rates[arm]) / statistics.fmean(rates["native"]), 3)

    return {
        "tokens_per_s_ratio_vs_native": ratio("program"),
        "tokens_per_s_ratio_vs_native_client_per_episode": ratio("program_client_per_episode"),
        "overhead_ms_per_call": overhead("http", statistics.median),
        "overhead_ms_per_call_mean": overhead("http", statistics.fmean),
        "overhead_ms_per_call_p90": overhead("http", p90),
        "overhead_ms_per_call_openai_client": overhead("openai", statistics.median),
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
