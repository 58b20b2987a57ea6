"""Each benchmark script runs end to end with tiny settings and prints one JSON object
with the keys its claim is read from. Numbers are not checked against targets (a test
never asserts on speed); these only keep the scripts from rotting.

Marked ``benchmark``. Each script runs in a subprocess of its own; those on Ray connect to
the session's cluster (``--ray-address``) rather than start one, and every one compiles
with XLA's optimizations off (``_run``). The chaos one runs ``raytunix train`` twice
(killed, then resumed) on a cluster of its own, which the driver's kill must take down:
the longest, a minute or two on a 2-core machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Every test here runs end to end (a Ray session, a train, a benchmark): the slow tier.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _ray_address(ray_session) -> tuple[str, str]:
    """``--ray-address`` of the session's cluster: a script connects to it instead of
    starting its own (about 7 s of CPU each on 2 cores)."""
    return "--ray-address", ray_session.get_runtime_context().gcs_address


def _run(script: str, *args: str, timeout_s: float) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "JAX_PLATFORMS": "cpu",
        # XLA's cheapest compile: the tiny programs here take longer to compile than to
        # run, and these runs check what the scripts report, not how fast. The processes
        # a script starts inherit it (chaos's `raytunix train` and its Ray workers), and
        # --ray-address passes it to the script's actors on the session's cluster.
        "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.benchmark
def test_orchestrator_overhead_runs_and_reports_cpu_per_turn(ray_session):
    report = _run(
        "orchestrator_overhead.py",
        *_ray_address(ray_session),
        "--concurrency",
        "32",
        "--group-size",
        "4",
        "--groups-per-batch",
        "2",
        "--turns",
        "3",
        "--turns-measured",
        "300",
        "--warmup-turns",
        "100",
        "--repeats",
        "2",
        "--ray-concurrency",
        "32",
        "--env-actors",
        "1",
        timeout_s=900,
    )
    assert report["benchmark"] == "orchestrator_overhead"
    assert report["cpu_ms_per_turn"] > 0
    assert len(report["runs"]) == 2
    # With Ray in the loop: the orchestrator actor's own process CPU over its turns.
    assert len(report["ray"]["runs"]) == 2 and report["ray_cpu_ms_per_turn"] > 0
    for run in report["ray"]["runs"]:
        assert run["turns"] >= 300 // 4 and run["trajectories"] > 0
    assert report["ray_cpu_ms_per_turn_repeats"]["worst"] >= report["ray_cpu_ms_per_turn"]
    for run in report["runs"]:
        assert run["turns"] >= 300 and run["trajectories"] > 0
        assert 0 < run["mean_episodes_in_flight"] <= 32
    # 700+ turns of 3-turn episodes: every episode ran to the end
    assert report["counters"]["episodes_completed"] >= 200


@pytest.mark.benchmark
def test_gateway_overhead_runs_both_arms_on_equal_work_and_reports_its_keys():
    report = _run(
        "gateway_overhead.py",
        *("--prompts", "2", "--group-size", "2", "--repeats", "1", "--calls", "3"),
        *("--max-batch-size", "4", "--concurrency", "4"),
        *("--system-tokens", "16", "--question-tokens", "8", "--tool-tokens", "4"),
        # a 1-layer model and one attention-span bucket: a third of the programs to compile
        *("--d-model", "32", "--n-layers", "1", "--max-seq-len", "256"),
        timeout_s=600,
    )
    assert report["tokens_per_s_ratio_vs_native"] > 0
    assert isinstance(report["overhead_ms_per_call"], float)
    assert isinstance(report["overhead_ms_per_call_openai_client"], float)
    assert report["tokens_per_s_ratio_vs_native_client_per_episode"] > 0
    for arm in ("native", "program", "program_client_per_episode"):
        (run,) = report["runs"][arm]
        assert run["calls"] == 4 * 3 and 0 < run["generated_tokens"] <= 4 * 3 * 32
    for arm in ("native", "http", "openai"):
        stats = report["single_call_ms"][arm]
        assert 0 < stats["median"] <= stats["worst"]


@pytest.mark.benchmark
def test_rollout_overlap_runs_and_reports_its_three_keys(ray_session):
    # One engine row and a short context: 4 programs to compile, the bulk of the time.
    report = _run(
        "rollout_overlap.py",
        *_ray_address(ray_session),
        "--d-model",
        "32",
        "--n-layers",
        "1",
        "--max-seq-len",
        "96",
        "--max-batch-size",
        "1",
        "--trajectories",
        "4",
        "--lockstep-trajectories",
        "2",
        "--warmup-trajectories",
        "2",
        "--turns",
        "2",
        "--max-new-tokens",
        "4",
        "--tool-latency-s",
        "0.02",
        "--straggler-fraction",
        "0.5",
        "--straggler-factor",
        "3",
        "--concurrency",
        "4",
        "--repeats",
        "1",
        timeout_s=900,
    )
    for key in (
        "engine_busy_fraction",
        "throughput_ratio_vs_zero_latency",
        "speedup_trajectories_per_s",
        "speedup_vs_batch_sync",
        "speedup_vs_batch_sync_no_stragglers",
    ):
        assert report[key] > 0, key
    for mode in (
        "lockstep",
        "async",
        "async_zero_latency",
        "batch_sync",
        "async_no_stragglers",
        "batch_sync_no_stragglers",
    ):
        (run,) = report[mode]["runs"]
        assert run["statuses"] == {"completed": run["trajectories"]}
        assert run["compiled_during_run"] == 0  # warmed up before the clock
        spread = report[mode]["repeats"]["trajectories_per_s"]  # one repeat: all agree
        assert spread["worst"] == spread["median"] == run["trajectories_per_s"]
        assert spread["mean"] == pytest.approx(run["trajectories_per_s"])
    assert report["async"]["runs"][0]["trajectories"] == 4
    assert report["lockstep"]["runs"][0]["trajectories"] == 2
    # The batch-synchronous baseline runs whole batches of the async run's concurrency.
    assert report["batch_sync"]["runs"][0]["trajectories"] == 4
    assert report["batch_sync"]["runs"][0]["concurrency"] == 4


@pytest.mark.benchmark
def test_profiling_overhead_alternates_profiling_and_reports_its_cost(ray_session):
    # The rollout test's engine (one row, a 96-token context): its 4 programs, which the
    # session's compilation cache holds once either test has run.
    report = _run(
        "profiling_overhead.py",
        *_ray_address(ray_session),
        "--d-model",
        "32",
        "--n-layers",
        "1",
        "--max-seq-len",
        "96",
        "--max-batch-size",
        "1",
        "--pairs",
        "2",
        "--block-batches",
        "2",
        "--settle-batches",
        "1",
        "--warmup-batches",
        "1",
        "--batch",
        "4",
        "--tasks",
        "16",
        "--concurrency",
        "8",
        "--turns",
        "2",
        "--max-new-tokens",
        "4",
        "--tool-latency-s",
        "0.01",
        "--env-actors",
        "1",
        "--window-s",
        "0",
        timeout_s=900,
    )  # a drain after every batch
    assert report["benchmark"] == "profiling_overhead"
    assert isinstance(report["overhead_fraction"], float)
    low, high = report["overhead_fraction_ci95"]
    assert low <= report["overhead_fraction"] <= high
    # off-on, then on-off: the order alternates so that drift hits both alike
    assert [block["profiled"] for block in report["blocks"]] == [False, True, True, False]
    assert len(report["overhead_fraction_per_pair"]) == 2
    assert report["overhead_pooled"] == report["overhead_fraction_pooled"]
    low_mean, high_mean = report["overhead_fraction_mean_ci95"]
    assert report["overhead_mean_upper95"] == high_mean >= report["overhead_fraction_mean"]
    for block in report["blocks"]:
        assert block["trajectories"] == 2 * 4  # --block-batches x --batch, timed
        assert block["cpu_s"] > 0
        if not block["profiled"]:
            assert block["spans_recorded"] == {}  # off: nothing drained
        else:
            # the engine, the orchestrator, the env actor and the driver all recorded
            assert {"engine 0", "orchestrator", "env actor 0"} <= set(block["spans_recorded"])
    assert report["span_record_cost_us"] > 0 and report["spans_jsonl_bytes"] > 0


@pytest.mark.benchmark
def test_profiling_drain_cost_drains_the_shaped_spans_and_reports_cpu_per_drain(ray_session):
    report = _run(
        "profiling_drain_cost.py",
        *_ray_address(ray_session),
        "--rounds",
        "4",
        "--batch",
        "8",
        "--env-actors",
        "1",
        timeout_s=120,
    )
    assert report["benchmark"] == "profiling_drain_cost"
    # per episode of 3 turns: 5 orchestrator spans (a reset, 3 turns, the episode); 3
    # requests, 2 decode steps (1 on every 10th episode) and a prefill in the engine; 4
    # env spans
    assert 8 * 14 < report["spans_per_drain"] <= 8 * 15
    assert set(report["cpu_ms_per_drain_by_process"]) >= {
        "driver",
        "engine 0",
        "orchestrator",
        "env actor 0",
    }
    assert report["wall_ms_per_drain"] > 0 and report["spans_jsonl_bytes_per_drain"] > 0
    assert report["machine_fraction_at_interval"] == pytest.approx(
        report["cpu_ms_per_drain"] / (1e3 * 1.4 * report["machine"]["cpu_count"])
    )


def test_median_interval_is_the_sign_test_interval():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from profiling_overhead import median_ci95
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    # n = 20: P(Binomial(20, 1/2) <= 5) = 0.021 <= 0.025 < P(<= 6): the 6th smallest
    # and 6th largest; n = 30: the 10th; n = 10: the 2nd; n = 5: no k, (min, max)
    # (coverage 1 - 2 P(B < k): 0.9586, 0.9572, 0.9785; 1 - 2/32 = 0.9375 for 5)
    low, high, coverage = median_ci95([float(i) for i in range(20)])
    assert (low, high) == (5.0, 14.0) and round(coverage, 4) == 0.9586
    low, high, coverage = median_ci95([float(i) for i in range(30)][::-1])
    assert (low, high) == (9.0, 20.0) and round(coverage, 4) == 0.9572
    low, high, coverage = median_ci95([float(i) for i in range(10)])
    assert (low, high) == (1.0, 8.0) and round(coverage, 4) == 0.9785
    assert median_ci95([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0, 1 - 2 / 32)
    assert median_ci95([0.2, 0.1])[2] == 0.5  # 2 pairs: a 50% interval, and it says so


@pytest.mark.benchmark
def test_learner_step_compares_the_update_with_a_bare_train_step():
    report = _run(
        "learner_step.py",
        "--config",
        "tiny",
        "--steps",
        "2",
        "--batch-size",
        "8",
        "--seq-len",
        "32",
        timeout_s=900,
    )
    assert report["benchmark"] == "learner_step"
    tiny = report["configs"]["tiny"]
    assert report["ratio_vs_bare"] == tiny["ratio_vs_bare"] > 0
    assert tiny["batch"]["padded_tokens"] == 8 * 32  # the longest trajectory fills the width
    assert 0 < tiny["batch"]["trainable_tokens"] < 8 * 32  # prompts are not trained on
    assert len(tiny["step_s"]["learner"]) == len(tiny["step_s"]["bare"]) == 2
    assert report["gemm_gflops"] > 0
    assert (
        report["fraction_of_gemm_rate"]
        == tiny["fraction_of_gemm_rate"]
        == round(tiny["update_gflops"] / report["gemm_gflops"], 3)
    )
    assert tiny["flops_per_update"] > 6 * 8 * 32  # at least 6 FLOPs per token per weight


@pytest.mark.benchmark
def test_device_check_runs_every_part_on_the_cpu_without_ray():
    report = _run(
        "device_check.py",
        *("--shape", "tiny", "--rows", "4", "--prompt", "32", "--decode-steps", "8"),
        *("--learner-rows", "2", "--learner-seq", "64", "--learner-steps", "1"),
        *("--peak-tflops", "1", "--hbm-gbps", "10"),  # a CPU has no data-sheet entry
        timeout_s=900,
    )
    decode = report["decode"]
    assert report["model"] == {"shape": "tiny", "dtype": "bfloat16", "params": 106_816}
    assert decode["engine"]["decode_steps"] >= 7 and decode["bare_tokens_per_s"] > 0
    # the roofline: rows x bandwidth / (bf16 weights + the KV bytes read per step)
    kv = 4 * (32 + 8 / 2) * 2 * 2 * 2 * 16 * 2  # rows x context x (k, v) x layers x kv heads
    assert decode["bytes_per_step"] == 106_816 * 2 + kv
    assert decode["roofline_tokens_per_s"] == round(4 * 10e9 / decode["bytes_per_step"], 1)
    assert 0 < report["prefill"]["mfu"] and 0 < report["learner"]["mfu"]
    assert report["publish"]["bytes"] == 106_816 * 2  # published in bfloat16
    assert report["machine"]["backend"] == "cpu"


@pytest.mark.benchmark
@pytest.mark.timeout(
    2700
)  # three launches of raytunix train: past the suite's 600 s on a loaded machine
def test_chaos_kills_every_kind_and_the_run_survives_with_nothing_lost():
    # One actor of each kind, 3 RL steps, kills at most 1 s after their step: the driver's
    # kill (after step 0 or 1) always comes before the run ends.
    report = _run(
        "chaos.py",
        "--seeds",
        "1",
        "--rl-steps",
        "3",
        "--max-delay-s",
        "1",
        "--env-actors",
        "1",
        "--sandbox-actors",
        "1",
        "--engine-replicas",
        "1",
        "--seed-timeout-s",
        "2400",
        timeout_s=2700,
    )
    assert report["benchmark"] == "chaos" and report["seeds"] == [0]
    (row,) = report["runs"]
    assert row["finished"], row.get("log_tail")
    assert report["runs_survived"] == 1 and report["seeds_unchecked"] == []
    assert report["tasks_lost"] == report["tasks_duplicated"] == 0, row
    assert report["checkpoints_lost"] == report["processes_left"] == 0, row
    # Every kind was killed once: a kill at most 1 s after RL step 1 comes seconds before
    # a 3-step run ends (step 2, step 3, the held-out evaluation), so none is missed.
    kinds = {"env_actor", "sandbox_actor", "engine_replica", "driver"}
    assert report["kills"] == dict.fromkeys(kinds, 1) and report["kills_missed"] == 0, row
    assert row["launches"] - row["ray_startup_retries"] == 2  # killed, resumed
    (resume,) = row["resumes"]
    assert resume["resumed_at"] >= resume["committed_at_kill"]
    # the final checkpoint holds every RL step's batch: 2 tasks a step, each trained once
    assert row["final_checkpoint"] == 3 and row["tasks_trained"] == 3 * 2
