"""Profiling: the span recorder, the window metrics, the driver's collector, and the
bottleneck report — the last on three scripted runs (slow tools, a slow engine, a slow
learner) made of the real orchestrator, engine, env actors and learner."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
import time
import zlib

import pytest
import yaml

from raytunix import profiling
from raytunix.envs import SimulatedToolEnv
from raytunix.profiling.collect import Collector
from raytunix.profiling.metrics import WindowMetrics, percentiles
from raytunix.profiling.collect import read_jsonl
from raytunix.profiling.report import diagnose, weighted_means, write_report
from raytunix.profiling.spans import Recorder


# ------------------------------------------------------------------------- the recorder


def test_recorder_keeps_spans_in_order_and_drain_empties_it():
    rec = Recorder("engine 0", "engine")
    rec.add("decode", 1.0, 1.5, "steps", {"rows": 3})
    rec.add("request", 0.5, 1.5, "slot 2", None, "g1/7")
    chunk = rec.drain()
    assert chunk["process"] == "engine 0" and chunk["kind"] == "engine"
    assert chunk["pid"] == os.getpid() and chunk["dropped"] == 0
    assert [list(s) for s in chunk["spans"]] == [
        ["decode", "steps", 1.0, 1.5, {"rows": 3}, None],
        ["request", "slot 2", 0.5, 1.5, None, "g1/7"],
    ]
    assert abs(chunk["clock_offset_s"] + time.perf_counter() - time.time()) < 1.0
    assert rec.drain()["spans"] == []


def test_an_actor_drain_is_pickled_bytes_that_decode_to_the_chunk():
    import pickle

    from raytunix.profiling.spans import ProfiledActor, decode_chunk

    profiling.recorder().drain()  # this process's spans of earlier tests
    profiling.add("env_step", 1.0, 1.25, "env", {"tool": "calculator"}, "g0/1")
    encoded = ProfiledActor().profile_drain()
    assert isinstance(encoded, bytes)
    chunk = decode_chunk(encoded)
    assert chunk["spans"] == [("env_step", "env", 1.0, 1.25, {"tool": "calculator"}, "g0/1")]
    assert chunk["pid"] == os.getpid() and chunk["dropped"] == 0
    # the drain is recorded, with what it shipped, in the next chunk
    ((name, _, _, _, args, _),) = profiling.recorder().drain()["spans"]
    assert name == "profile_drain" and args == {"spans": 1, "bytes": len(encoded)}
    with pytest.raises(TypeError, match="got dict"):
        decode_chunk(chunk)
    with pytest.raises(pickle.UnpicklingError, match="not a drained chunk: a list"):
        decode_chunk(pickle.dumps([1, 2]))
    with pytest.raises((pickle.UnpicklingError, EOFError)):
        decode_chunk(encoded[: len(encoded) // 2])


def test_full_ring_buffer_drops_the_oldest_spans_and_counts_them():
    rec = Recorder("p", "env", capacity=5)
    for i in range(8):
        rec.add("env_step", float(i), i + 0.5)
    chunk = rec.drain()
    assert [s[2] for s in chunk["spans"]] == [3.0, 4.0, 5.0, 6.0, 7.0]
    assert chunk["dropped"] == 3
    assert rec.drain()["dropped"] == 0


def test_span_context_records_a_failure_and_lets_it_propagate():
    rec = Recorder("p", "env")
    with pytest.raises(KeyError):
        with rec.span("env_step", "env", {"turn": 1}, flow="e1"):
            raise KeyError("boom")
    ((name, track, start, end, args, flow),) = rec.drain()["spans"]
    assert (name, track, flow) == ("env_step", "env", "e1")
    assert args == {"turn": 1, "error": "KeyError"} and end >= start


def test_disabled_recorder_records_nothing():
    rec = Recorder("p", "env", enabled=False)
    rec.add("x", 0.0, 1.0)
    with rec.span("y"):
        pass
    assert rec.drain()["spans"] == []


def test_threads_recording_while_the_driver_drains_lose_no_span():
    rec = Recorder("p", "env")
    per_thread, threads = 20_000, 4
    drained: list = []
    done = threading.Event()

    def record(t: int) -> None:
        for i in range(per_thread):
            rec.add("tool_call", float(i), float(i), f"tool t{t}")

    def drain() -> None:
        while not done.is_set():
            drained.extend(rec.drain()["spans"])

    drainer = threading.Thread(target=drain)
    drainer.start()
    workers = [threading.Thread(target=record, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    done.set()
    drainer.join()
    drained.extend(rec.drain()["spans"])
    assert len(drained) == per_thread * threads


# ------------------------------------------------------------------------- window metrics


def _chunk(process, kind, spans, pid=1, cpu_s=None, now_s=None):
    chunk = {
        "process": process,
        "kind": kind,
        "pid": pid,
        "host": "h",
        "dropped": 0,
        "clock_offset_s": 0.0,
        "spans": spans,
    }
    if cpu_s is not None:
        chunk.update(cpu_s=cpu_s, now_s=now_s)
    return chunk


def test_window_metrics_from_hand_made_spans():
    engine = _chunk(
        "engine 0",
        "engine",
        [
            ["prefill", "steps", 0.0, 0.5, {"rows": 2, "tokens": 100}, None],
            ["decode", "steps", 0.5, 1.5, {"rows": 4, "tokens": 4}, None],
            ["decode", "steps", 1.5, 2.5, {"rows": 2, "tokens": 2}, None],
            ["request", "slot 0", 0.0, 2.5, {"queued_s": 0.2}, "g/1"],
            ["request", "slot 1", 0.0, 2.5, {"queued_s": 0.4}, "g/2"],
        ],
        pid=1,
    )
    learner = _chunk("learner", "learner", [["update", "learner", 0.0, 2.0, None, None]], pid=2)
    driver = _chunk(
        "driver", "driver", [["next_batch_wait", "driver", 0.0, 6.0, None, None]], pid=3
    )
    orchestrator = _chunk(
        "orchestrator",
        "orchestrator",
        [
            ["episode", "episodes", 0.0, 4.0, {"generate_s": 1.0, "env_s": 2.0}, "g/1"],
            ["generate", "episodes", 0.0, 1.0, {"turn": 0, "tokens": 30}, "g/1"],
            ["env_step", "episodes", 1.0, 3.0, None, "g/1"],
            ["episode", "episodes", 0.0, 6.0, {"generate_s": 2.0, "env_s": 0.5}, "g/2"],
            # a turn of an episode still running: counted when that episode ends
            ["generate", "episodes", 0.0, 9.0, {"turn": 0, "tokens": 0}, "g/3"],
            ["generate", "episodes", 0.0, 2.0, {"turn": 0, "tokens": 10}, "g/2"],
            ["env_reset", "episodes", 2.0, 2.5, None, "g/2"],
        ],
        pid=4,
    )
    env = _chunk(
        "env actor 0",
        "env",
        [
            ["tool_call", "tool calculator", 0.0, 0.1, {"tool": "calculator"}, None],
            [
                "tool_call",
                "tool calculator",
                0.0,
                0.3,
                {"tool": "calculator", "error": "timeout"},
                None,
            ],
            ["tool_call", "tool search", 0.0, 0.2, {"tool": "search"}, None],
            ["env_step", "env", 0.0, 0.4, None, "g/1"],
        ],
        pid=5,
    )
    m = WindowMetrics(max_batch_size=8).compute(
        [engine, learner, driver, orchestrator, env], window_s=10.0
    )
    assert m["window_s"] == 10.0
    assert m["engine_busy_fraction"] == pytest.approx(2.5 / 10)
    assert m["engine_prefill_fraction"] == pytest.approx(0.5 / 10)
    assert m["engine_decode_rows_mean"] == pytest.approx(3.0)
    assert m["engine_batch_occupancy"] == pytest.approx(3.0 / 8)
    assert m["engine_queue_wait_s_mean"] == pytest.approx(0.3)
    assert m["learner_busy_fraction"] == pytest.approx(0.2)
    assert m["learner_idle_fraction"] == pytest.approx(0.8)
    assert m["learner_wait_fraction"] == pytest.approx(0.6)
    assert m["trajectories_per_s"] == pytest.approx(0.2)
    assert m["generated_tokens_per_s"] == pytest.approx(4.0)
    assert m["episode_generate_fraction"] == pytest.approx(3.0 / 10)
    assert m["episode_env_fraction"] == pytest.approx(2.5 / 10)
    assert m["episode_other_fraction"] == pytest.approx(4.5 / 10)
    assert m["episode_wall_s_mean"] == pytest.approx(5.0)
    assert m["tool_calls/calculator"] == 2 and m["tool_calls/search"] == 1
    assert m["tool_latency_s/calculator/p50"] == pytest.approx(0.2)
    assert m["tool_latency_s/search/p99"] == pytest.approx(0.2)
    assert m["tool_call_errors/timeout"] == 1
    assert m["env_step_latency_s/p50"] == pytest.approx(0.4)


def test_two_engine_replicas_share_the_busy_fraction_and_cpu_is_per_drain_interval():
    metrics = WindowMetrics()
    first = [
        _chunk("engine 0", "engine", [], pid=1, cpu_s=1.0, now_s=100.0),
        _chunk("engine 1", "engine", [], pid=2, cpu_s=5.0, now_s=50.0),
    ]
    assert "engine_cpu_fraction" not in metrics.compute(first, 1.0)  # no interval yet
    second = [
        _chunk(
            "engine 0",
            "engine",
            [["decode", "steps", 0, 2.0, {"rows": 1}, None]],
            pid=1,
            cpu_s=2.0,
            now_s=104.0,
        ),
        _chunk("engine 1", "engine", [], pid=2, cpu_s=8.0, now_s=54.0),
    ]
    m = metrics.compute(second, 4.0)
    assert m["engine_busy_fraction"] == pytest.approx(2.0 / (4.0 * 2))  # an idle replica counts
    assert m["engine_cpu_fraction"] == pytest.approx((0.25 + 0.75) / 2)


def test_a_summary_is_plain_data_and_adds_up_to_the_window_metrics():
    import json

    from raytunix.profiling.metrics import summarize

    env = _chunk(
        "env actor 0",
        "env",
        [
            ("tool_call", "tool search", 0.0, 0.2, {"tool": "search", "error": "timeout"}, None),
            ("env_step", "env", 0.0, 0.5, None, "g/1"),
            ("env_step", "episodes", 0.0, 0.9, None, "g/1"),  # the orchestrator's wait: left out
            ("profile_drain", "profiling", 1.0, 1.002, {"spans": 3}, None),
        ],
        pid=5,
    )
    summary = summarize(env)
    assert json.loads(json.dumps(summary)) == summary
    assert summary["spans"] == 4 and summary["counts"] == {"env_step": 1, "profile_drain": 1}
    assert summary["tool_latency_s"] == {"search": [0.2]} and summary["env_step_s"] == [0.5]
    engine = _chunk("engine 0", "engine", [("decode", "steps", 0.0, 1.0, {"rows": 3}, None)], pid=1)
    assert WindowMetrics(4).combine([summarize(engine), summary], 2.0) == WindowMetrics(4).compute(
        [engine, env], 2.0
    )


def test_percentiles_interpolate_and_handle_no_values():
    assert percentiles([]) == {}
    p = percentiles([1.0, 2.0, 3.0, 4.0, 5.0])
    assert p == {"p50": 3.0, "p90": pytest.approx(4.6), "p99": pytest.approx(4.96)}


def test_a_window_must_have_a_length():
    with pytest.raises(ValueError, match="window must last > 0 seconds, got 0"):
        WindowMetrics().compute([], 0.0)


# ------------------------------------------------------------------------- the verdict rules


def test_diagnose_names_each_resource_from_its_evidence():
    learner = diagnose(
        {
            "learner_busy_fraction": 0.9,
            "learner_wait_fraction": 0.05,
            "engine_busy_fraction": 0.3,
            "episode_generate_fraction": 0.9,
            "episode_env_fraction": 0.05,
        },
        {"engine": {"placement": "colocated"}},
    )
    assert learner.resource == "learner" and "disaggregated" in learner.advice[-1]
    # Only what makes updates cheaper: faster rollouts would change nothing.
    assert not any("max_staleness" in a or "max_concurrent_episodes" in a for a in learner.advice)
    tuned = diagnose(
        {"learner_busy_fraction": 0.9, "learner_wait_fraction": 0.05},
        {
            "engine": {"placement": "disaggregated"},
            "learner": {"sequence_packing": False, "num_iterations": 2, "micro_batch_size": 4},
        },
    )
    assert [a.split(" (")[0] for a in tuned.advice] == [
        "pack trajectories into rows",
        "fewer optimizer steps per batch",
        "larger micro-batches",
        "fewer trajectories per batch",
    ]
    assert tuned.summary.endswith(
        "Pack trajectories into rows (learner.sequence_packing="
        "true): the update then computes no padding."
    )
    tools = diagnose(
        {
            "learner_busy_fraction": 0.1,
            "learner_wait_fraction": 0.9,
            "engine_busy_fraction": 0.41,
            "episode_generate_fraction": 0.3,
            "episode_env_fraction": 0.58,
            "max_concurrent_episodes": 32,
            "tool_latency_s/search/p90": 1.5,
            "tool_latency_s/calc/p90": 0.01,
        },
        {"env": {"num_env_actors": 2}},
    )
    assert tools.resource == "environment/tools"
    assert "engine busy 41%" in tools.summary and "58%" in tools.summary
    # Little's law: 32 episodes keep the engine 41% busy; 0.9 / 0.41 x 32 = 70.2
    assert "from 32 to ~71" in tools.advice[0]
    assert any("search (p90 1500 ms)" in a for a in tools.advice)
    full = diagnose(
        {
            "learner_busy_fraction": 0.1,
            "learner_wait_fraction": 0.9,
            "engine_busy_fraction": 0.95,
            "engine_batch_occupancy": 0.97,
            "episode_generate_fraction": 0.9,
            "episode_env_fraction": 0.05,
        },
        {"engine": {"max_batch_size": 64}},
    )
    assert full.resource == "engine" and "engine.max_batch_size" in full.advice[0]
    underfed = diagnose(
        {
            "learner_wait_fraction": 0.9,
            "learner_busy_fraction": 0.1,
            "engine_busy_fraction": 0.3,
            "episode_generate_fraction": 0.9,
            "episode_env_fraction": 0.05,
            "max_concurrent_episodes": 8,
        }
    )
    assert (
        underfed.resource == "engine"
        and "max_concurrent_episodes from 8 to ~24" in underfed.summary
    )
    capped = diagnose(
        {
            "learner_wait_fraction": 0.9,
            "learner_busy_fraction": 0.1,
            "engine_busy_fraction": 0.3,
            "episode_generate_fraction": 0.9,
            "max_concurrent_episodes": 8,
        },
        {
            "rollout": {
                "max_staleness": 1,
                "groups_per_batch": 2,
                "group_size": 2,
                "adaptive_concurrency": True,
            }
        },
    )
    assert "adaptive_max_episodes" in capped.advice[0]
    assert "admission lets at most 8 in flight" in capped.advice[0]
    orchestrator = diagnose(
        {
            "learner_wait_fraction": 0.9,
            "learner_busy_fraction": 0.1,
            "orchestrator_cpu_fraction": 0.97,
            "episode_generate_fraction": 0.3,
            "episode_env_fraction": 0.2,
        }
    )
    assert orchestrator.resource == "orchestrator"
    assert diagnose({}).resource == "unknown"


def test_more_episodes_advice_aims_at_the_runs_own_target_engine_busy():
    underfed = {
        "learner_wait_fraction": 0.9,
        "learner_busy_fraction": 0.1,
        "engine_busy_fraction": 0.3,
        "episode_generate_fraction": 0.9,
        "episode_env_fraction": 0.05,
        "max_concurrent_episodes": 8,
    }
    # Little's law: 8 episodes keep the engine 30% busy; 0.6 / 0.3 x 8 = 16.
    aimed = diagnose(underfed, {"rollout": {"target_engine_busy": 0.6}})
    assert "max_concurrent_episodes from 8 to ~16" in aimed.advice[0]
    # A config.yaml without the key (or with a value no run accepts): the default, 0.9 -> 24.
    for settings in (
        {},
        {"rollout": {"target_engine_busy": "high"}},
        {"rollout": {"target_engine_busy": 1.5}},
    ):
        assert "from 8 to ~24" in diagnose(underfed, settings).advice[0]


def test_weighted_means_leave_out_the_compiling_step_and_weight_by_window():
    steps = [
        {"phase": "rl", "step": 1, "window_s": 100.0, "engine_busy_fraction": 0.0},
        {"phase": "rl", "step": 2, "window_s": 1.0, "engine_busy_fraction": 1.0},
        {
            "phase": "rl",
            "step": 3,
            "window_s": 3.0,
            "engine_busy_fraction": 0.0,
            "flag": True,
            "statuses": {"completed": 4},
        },
    ]
    means = weighted_means(steps)
    assert means["engine_busy_fraction"] == pytest.approx(0.25)
    assert "flag" not in means and "statuses" not in means


def test_steps_that_share_a_window_count_as_their_share_of_it():
    # steps 2-4 share one 6 s window (2 s each), step 5 has a window of its own of 2 s:
    # the window's metrics count three times 2 s, the loss every step by its 2 s
    window = {"window_s": 6.0, "window_steps": 3, "engine_busy_fraction": 1.0}
    steps = [
        {
            "phase": "rl",
            "step": 1,
            "window_s": 50.0,
            "window_steps": 1,
            "engine_busy_fraction": 0.0,
            "loss": 9.0,
        },
        *({"phase": "rl", "step": n, **window, "loss": 1.0} for n in (2, 3, 4)),
        {
            "phase": "rl",
            "step": 5,
            "window_s": 2.0,
            "window_steps": 1,
            "engine_busy_fraction": 0.0,
            "loss": 5.0,
        },
    ]
    means = weighted_means(steps)
    assert means["engine_busy_fraction"] == pytest.approx(0.75)
    assert means["loss"] == pytest.approx(2.0)


def test_a_collector_window_is_due_once_it_is_min_window_s_long(tmp_path):
    collector = Collector(str(tmp_path), lambda: [], min_window_s=3600.0)
    assert not collector.due()
    collector.min_window_s = 0.0
    assert collector.due()
    with pytest.raises(ValueError, match="min_window_s must be >= 0 seconds, got -1"):
        Collector(str(tmp_path), lambda: [], min_window_s=-1.0)


def test_report_of_a_run_without_rl_steps_says_so(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"phase": "eval", "when": "before_rl"}\n{"torn')
    path, verdict = write_report(str(tmp_path))
    assert verdict.resource == "unknown"
    assert "Bounded by: unknown" in open(path).read()
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        write_report(str(tmp_path / "nowhere"))


# ------------------------------------------------------------------------- the collector


@pytest.mark.slow
def test_collector_drains_actors_names_them_and_skips_a_dead_one(ray_session, tmp_path):
    import ray

    from raytunix.rollout.env_pool import EnvActor
    from raytunix.types import Action, Task, ToolCall

    live, dead = (ray.remote(EnvActor).remote("calculator_math", {}) for _ in range(2))
    task = Task(task_id="t0", question="Calculate 1 + 2.", answer="3")
    ray.get([live.reset.remote("g0/1#0", task), dead.reset.remote("g0/2#1", task)])
    calls = (
        ToolCall("calculator", {"expression": "1 + 2"}),
        ToolCall("calculator", {"expression": "1 +"}),
    )
    ray.get(live.step.remote("g0/1#0", Action(text="", tool_calls=calls)))
    ray.kill(dead)
    collector = Collector(
        str(tmp_path), lambda: [("env actor 0", live), ("env actor 1", dead)], timeout_s=20
    )
    profiling.recorder().drain()  # this process's spans of earlier tests
    metrics = collector.window("rl", 1)
    assert metrics["tool_calls/calculator"] == 2
    assert metrics["tool_call_errors/tool_exception"] == 1  # "1 +" does not parse
    lines = list(read_jsonl(os.path.join(tmp_path, "profile", "spans.jsonl")))
    assert [line["process"] for line in lines] == ["env actor 0", "driver"]
    assert all(line["phase"] == "rl" and line["step"] == 1 for line in lines)
    names = [(span[0], span[1], span[5]) for span in lines[0]["spans"]]
    # the env actor's spans carry the episode's flow id (its id before "#")
    assert ("env_reset", "env", "g0/1") in names and ("env_step", "env", "g0/1") in names
    assert names.count(("tool_call", "tool calculator", None)) == 2
    ray.kill(live)


# ------------------------------------------------------------------------- scripted runs


@pytest.fixture(scope="module")
def policy(ray_session):
    """A tiny learner in this process and an engine actor with the same weights, shared by
    the scenarios (the engine in its own process, as a run places it)."""
    import ray

    from raytunix.inference.actor import EngineActor
    from raytunix.learner.learner import Learner, RLHyperparams
    from raytunix.models.llama import ModelConfig
    from raytunix.models.tokenizer import Tokenizer

    tok = Tokenizer.byte_level()
    config = ModelConfig(
        vocab_size=tok.vocab_size,
        d_model=32,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        d_ff=64,
        max_seq_len=256,
    )
    learner = Learner(config, seed=0, pad_id=tok.pad_id)
    learner.start_rl(RLHyperparams(temperature=1.0, top_k=0, top_p=1.0, learning_rate=1e-3))
    engine = (
        ray.remote(EngineActor)
        .options(max_concurrency=1000)
        .remote(config, 0, tok, {"max_batch_size": 16})
    )
    ray.get(engine.update_weights.remote((learner.weights_numpy(), learner.version)))
    ray.get(engine.warmup.remote())  # compiling is nobody's bottleneck in a scenario
    yield tok, learner, engine
    ray.kill(engine)


async def _scripted_run(
    run_dir,
    policy,
    *,
    tool_latency_s: float,
    max_new_tokens: int,
    update_delay_s: float,
    groups_per_batch: int = 4,
    steps: int = 4,
) -> None:
    """The driver's RL loop (``raytunix.train``) with the orchestrator, the learner and the
    environments in this process and the engine in its actor: next batch, update (plus
    ``update_delay_s`` of learner time), weights to the engine, mark trained, one metrics
    window per step."""
    from raytunix.agents import TextAgent
    from raytunix.rollout.orchestrator import RolloutOrchestrator
    from raytunix.types import SamplingParams, Task

    from raytunix.rollout.actor import RayEngineClient

    tok, learner, engine = policy

    def env_provider(group_id):
        return _ThreadEnv(_ScoredToolEnv(tool_latency_s=tool_latency_s, turns=2)), lambda: None

    tasks = [Task(task_id=f"t{i}", question=f"task {i}", answer="") for i in range(200)]
    orchestrator = RolloutOrchestrator(
        tasks=tasks,
        agent_factory=lambda: TextAgent(tok),
        engine=RayEngineClient([engine]),
        env_provider=env_provider,
        group_size=2,
        groups_per_batch=groups_per_batch,
        max_concurrent_episodes=16,
        max_staleness=1,
        max_turns=2,
        max_context_tokens=256,
        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, stop_token_ids=()),
        seed=0,
        policy_version=learner.version,
    )
    collector = Collector(str(run_dir), lambda: [("engine 0", engine)])
    collector.drain("warmup", 0)  # what earlier tests and scenarios left
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(
            {
                "rollout": {"max_concurrent_episodes": 16},
                "env": {"num_env_actors": 1},
                "engine": {"placement": "colocated", "max_batch_size": 16},
            },
            f,
        )

    def update(batch):
        metrics = learner.train_step(batch)
        time.sleep(update_delay_s)  # the scripted part: a learner this much slower
        return metrics

    loop = asyncio.get_running_loop()
    collector.start_window()
    try:
        for step in range(1, steps + 1):
            with profiling.span("next_batch_wait", "driver"):
                [batch], info = await orchestrator.next_batch()
            with profiling.span("update", "learner"):
                await loop.run_in_executor(None, update, batch)
            await engine.update_weights.remote((learner.weights_numpy(), learner.version))
            orchestrator.mark_trained(info["batch_id"], learner.version)
            record = {
                "phase": "rl",
                "step": step,
                **{k: v for k, v in info.items() if k != "statuses"},
                **collector.window("rl", step),
            }
            with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
    finally:
        await orchestrator.stop()


class _ScoredToolEnv(SimulatedToolEnv):
    """``SimulatedToolEnv`` whose episode reward is a checksum bit of the last reply: the
    samples of a group differ, so the run has a learning signal and its report gives
    throughput advice (a constant reward would hold that advice back)."""

    def _step_impl(self, action):
        result = super()._step_impl(action)
        if not result.done:
            return result
        return dataclasses.replace(result, reward=float(zlib.crc32(action.text.encode()) % 2))


class _ThreadEnv:
    """An env client running the environment's calls in a worker thread, as an env actor
    does, without the trip to another process."""

    def __init__(self, env):
        self.env = env

    async def reset(self, task):
        return await asyncio.to_thread(self.env.reset, task)

    async def step(self, action):
        return await asyncio.to_thread(self.env.step, action)

    async def close(self):
        self.env.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "scenario,expected",
    [
        # tools take 0.5 s a call; a turn generates 2 tokens
        (dict(tool_latency_s=0.5, max_new_tokens=2, update_delay_s=0.0), "environment/tools"),
        # tools take no time; a turn generates 96 tokens, a batch is 2 groups: the
        # engine's 192 decode steps per batch cost about the same for 4 rows as for 8, the
        # learner's update half (with 4 groups, on a loaded machine, the update's share
        # reached the engine's)
        (
            dict(tool_latency_s=0.0, max_new_tokens=96, update_delay_s=0.0, groups_per_batch=2),
            "engine",
        ),
        # rollouts are quick; each update takes 1.5 s more
        (dict(tool_latency_s=0.0, max_new_tokens=4, update_delay_s=1.5), "learner"),
    ],
    ids=["slow-tools", "slow-engine", "slow-learner"],
)
def test_bottleneck_report_names_what_was_made_slow(
    ray_session, tmp_path, policy, scenario, expected
):
    asyncio.run(_scripted_run(tmp_path, policy, **scenario))
    path, verdict = write_report(str(tmp_path))
    report = open(path).read()
    assert verdict.resource == expected, report
    assert f"Bounded by: {expected}" in report
    assert verdict.learning.signal == "ok", report
    if expected == "environment/tools":
        assert (
            verdict.evidence["episode_env_fraction"] > verdict.evidence["episode_generate_fraction"]
        )
        assert "max_concurrent_episodes from 16" in verdict.summary
    if expected == "learner":
        assert verdict.evidence["learner_wait_fraction"] < 0.3
    if expected == "engine":
        assert verdict.evidence["episode_generate_fraction"] > 0.5


# ------------------------------------------------------------------------- odd run dirs


def test_recording_off_gives_no_metrics_and_a_report_that_says_why(tmp_path):
    off = Recorder("engine 0", "engine", enabled=False).drain()
    assert WindowMetrics().compute([off], 2.0) == {"profiling_enabled": 0.0}
    rows = [
        {"phase": "rl", "step": s, "reward_mean": 0.5, "profiling_enabled": 0.0} for s in (1, 2, 3)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, verdict = write_report(str(tmp_path))
    assert verdict.resource == "unknown" and "RAYTUNIX_PROFILING=0" in verdict.summary


def test_steps_after_a_resume_compile_again_and_stay_out_of_the_means(tmp_path):
    from raytunix.profiling.report import compile_steps

    def step(n, window_s, busy):
        return {
            "phase": "rl",
            "step": n,
            "window_s": window_s,
            "engine_busy_fraction": busy,
            "staleness_max": n % 2,
        }

    records = [
        step(1, 30.0, 0.1),
        step(2, 1.0, 0.9),
        step(3, 1.0, 0.9),
        {"phase": "resume", "rl_step": 3},
        step(4, 30.0, 0.1),
        step(5, 1.0, 0.7),
    ]
    assert compile_steps(records) == {1, 4}
    # Hand-edited or damaged records without a step number: not steps (step -3 would
    # have passed for the run's first, the compiling one, and put step 1 in the means).
    records += [dict(step(2, 1.0, 0.0), step=bad) for bad in (-3, "six", 1e20, True)]
    assert compile_steps(records) == {1, 4}
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records) + '{"phase": "rl", "step": 6, "wi'
    )
    text = open(write_report(str(tmp_path))[0]).read()
    assert "left out of the means, as they include compiling: steps 1, 4" in text
    assert "engine busy                        83.3%" in text  # (0.9 + 0.9 + 0.7) / 3
    assert "staleness, largest (versions)      1" in text  # a maximum, not a mean
    assert "could not be read, skipped: 1 (line 11)" in text
    assert "RL records whose step is not a whole number >= 1, skipped: 4" in text


def test_append_after_a_torn_line_starts_a_line_of_its_own(tmp_path):
    from raytunix.profiling.collect import append_jsonl

    path = str(tmp_path / "metrics.jsonl")
    append_jsonl(path, ['{"a": 1}\n'])
    with open(path, "a") as f:
        f.write('{"phase": "rl", "st')  # a crash mid-write
    append_jsonl(path, ['{"phase": "resume"}\n'])
    append_jsonl(path, ['{"b": 2}\n'])
    skipped: list[int] = []
    assert list(read_jsonl(path, skipped)) == [{"a": 1}, {"phase": "resume"}, {"b": 2}]
    assert skipped == [2]


def test_span_lines_round_trip_what_json_would_write_and_read(tmp_path):
    import numpy as np

    from raytunix.profiling.collect import append_jsonl, dumps_line, loads_line

    chunk = {
        "spans": [("decode", 1.5, 2.25, "steps", {"rows": np.int64(3), 7: "key"}, None)],
        "odd": frozenset([1]),
        "nan": float("nan"),
    }
    line = dumps_line(chunk)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    back = loads_line(line)
    # tuples become lists, a non-string key a string, numpy a number, an unknown type its
    # str, NaN null (JSON has no NaN)
    assert back == {
        "spans": [["decode", 1.5, 2.25, "steps", {"rows": 3, "7": "key"}, None]],
        "odd": "frozenset({1})",
        "nan": None,
    }
    # an integer over 64 bits (orjson refuses it) is written exactly, by json
    assert loads_line(dumps_line({"big": 2**70, "t": (1, 2)})) == {"big": 2**70, "t": [1, 2]}
    # lines json.dumps wrote (NaN tokens included) still read
    assert loads_line('{"a": NaN}\n')["a"] != loads_line('{"a": NaN}\n')["a"]
    path = str(tmp_path / "spans.jsonl")
    append_jsonl(path, [dumps_line({"a": 1}), '{"b": 2}\n'])  # bytes and text mix
    assert list(read_jsonl(path)) == [{"a": 1}, {"b": 2}]


def test_profile_command_explains_bad_paths_and_writes_elsewhere_with_out(tmp_path, capsys):
    from raytunix.cli import main

    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(
        '{"phase": "rl", "step": 1, "window_s": 1.0, '
        '"learner_busy_fraction": 0.9, '
        '"learner_wait_fraction": 0.0}\n'
    )
    assert main(["profile", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["profile", str(run / "metrics.jsonl")]) == 2
    assert "is a file" in capsys.readouterr().err
    assert main(["profile", str(tmp_path / "runs")]) == 2
    assert f"pass one of them, e.g. {run}" in capsys.readouterr().err
    out = tmp_path / "elsewhere"
    out.mkdir()
    # no profile/spans.jsonl: the report and the plot are written, the trace is not
    assert main(["profile", str(run), "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert "Bounded by: learner" in captured.out
    assert "trace.json not written: FileNotFoundError" in captured.err
    assert sorted(os.listdir(out)) == ["profile.png", "report.txt"]
    assert sorted(os.listdir(run)) == ["metrics.jsonl"]


def _learner_bound_run(path):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text(
        '{"phase": "rl", "step": 1, "window_s": 1.0, '
        '"learner_busy_fraction": 0.9, '
        '"learner_wait_fraction": 0.0}\n'
    )
    return path


def test_profile_command_makes_out_reports_each_failure_once_and_refuses_a_file(
    tmp_path, capsys, caplog
):
    from raytunix.cli import main

    run = _learner_bound_run(tmp_path / "run")
    out = tmp_path / "not" / "yet"  # made, parents too
    assert main(["profile", str(run), "--out", str(out)]) == 1  # no spans: no trace
    captured = capsys.readouterr()
    assert sorted(os.listdir(out)) == ["profile.png", "report.txt"]
    # the failure is printed once, by the command, not also logged by write_artifacts
    assert captured.err.count("trace.json not written") == 1
    assert not [r for r in caplog.records if "not written" in r.getMessage()]
    (tmp_path / "a_file").write_text("x")
    assert main(["profile", str(run), "--out", str(tmp_path / "a_file")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "a_file" in err and "pass a directory you can write to" in err


def test_report_says_when_spans_are_missing_empty_or_damaged(tmp_path):
    run = _learner_bound_run(tmp_path / "run")
    report_path, _ = write_report(str(run))
    assert "profile/spans.jsonl is missing" in open(report_path).read()
    (run / "profile").mkdir()
    spans = run / "profile" / "spans.jsonl"
    spans.write_text("")
    assert "profile/spans.jsonl is empty" in open(write_report(str(run))[0]).read()
    chunk = {
        "phase": "rl",
        "step": 1,
        "process": "env actor 0",
        "spans": [["tool_call", "tool calculator", 1.0, 1.25, None, "g/0"]],
    }
    spans.write_text(
        json.dumps(chunk)
        + "\n"
        + "garbage\n"
        + "[1, 2]\n"
        + '{"no": "spans"}\n'
        + json.dumps(chunk)
        + "\n"
        + '{"phase": "rl", "sp'
    )  # torn last line
    report = open(write_report(str(run))[0]).read()
    # lines 2, 3 and 6 are not JSON objects; line 4 is an object but no chunk
    assert (
        "profile/spans.jsonl lines that could not be read, skipped: 4 (line 2, 3, 6; "
        "1 JSON object(s) that are no drained chunk)" in report
    )
    assert "calculator" in report and "      2 " in report  # the two good chunks count


def test_a_report_before_the_last_step_says_the_run_is_not_done(tmp_path):
    run = _learner_bound_run(tmp_path / "run")
    (run / "config.yaml").write_text(yaml.safe_dump({"learner": {"rl_steps": 8}}))
    report = open(write_report(str(run))[0]).read()
    assert "RL steps logged: 1 (of 8 planned: the run is still going or stopped early)" in report
    (run / "config.yaml").write_text(yaml.safe_dump({"learner": {"rl_steps": 1}}))
    assert "RL steps logged: 1\n" in open(write_report(str(run))[0]).read()


def test_unreadable_metrics_are_not_taken_for_a_run_before_rl(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("garbage\n" * 3)
    report = open(write_report(str(run))[0]).read()
    assert "Bounded by: unknown" in report
    assert "no RL step could be read: 3 line(s) of metrics.jsonl are not JSON" in report
    assert "before RL" not in report


def test_a_broken_artifact_module_costs_only_its_own_file(tmp_path, monkeypatch):
    import sys

    run = _learner_bound_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "raytunix.profiling.trace", None)  # import fails
    artifacts = profiling.write_artifacts(str(run))
    assert "raytunix.profiling.trace" in artifacts["errors"]["trace.json"]  # ImportError
    assert artifacts["bottleneck"] == "learner"
    assert os.path.exists(artifacts["report_path"]) and os.path.exists(artifacts["plot_path"])


def test_a_busy_engine_with_near_empty_batches_is_told_to_fill_them():
    v = diagnose(
        {
            "learner_wait_fraction": 0.9,
            "learner_busy_fraction": 0.1,
            "engine_busy_fraction": 0.85,
            "engine_batch_occupancy": 0.12,
            "engine_prefill_fraction": 0.6,
            "episode_generate_fraction": 0.9,
            "max_concurrent_episodes": 16,
        },
        {"engine": {"placement": "disaggregated", "num_replicas": 2}},
    )
    assert v.resource == "engine" and "only 12% full" in v.summary
    assert v.advice[0].startswith("raise rollout.max_concurrent_episodes from 16")
    colocated = diagnose(
        {
            "learner_wait_fraction": 0.9,
            "learner_busy_fraction": 0.1,
            "engine_busy_fraction": 0.95,
            "engine_batch_occupancy": 0.95,
            "episode_generate_fraction": 0.9,
        },
        {},
    )
    assert any("engine.placement=disaggregated" in a for a in colocated.advice)
