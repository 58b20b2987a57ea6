"""The bottleneck report's verdict families, each a pure function of mean metrics and the
run's settings: where each one's threshold lies, and that it steps aside (None) when its
evidence is missing or below it, so ``diagnose`` falls through to the next."""

from __future__ import annotations

from raytunix.profiling.report import (
    ENGINE_BUSY_HIGH,
    EPISODE_OTHER_HIGH,
    LEARNER_BUSY_HIGH,
    LEARNER_WAIT_LOW,
    ORCHESTRATOR_CPU_HIGH,
    engine_verdict,
    environment_verdict,
    learner_verdict,
    more_episodes_advice,
    no_evidence_verdict,
    orchestrator_verdict,
)


def test_no_evidence_says_whether_recording_was_off_and_steps_aside_once_a_step_was_profiled():
    off = no_evidence_verdict({"profiling_enabled": 0.0})
    assert off is not None and off.resource == "unknown" and "RAYTUNIX_PROFILING=0" in off.summary
    before = no_evidence_verdict({})
    assert before is not None and "no RL step has been profiled" in before.summary
    assert no_evidence_verdict({"learner_busy_fraction": 0.5}) is None
    assert no_evidence_verdict({"episode_generate_fraction": 0.5}) is None


def test_learner_verdict_needs_both_a_short_wait_and_a_busy_learner():
    busy = {"learner_busy_fraction": LEARNER_BUSY_HIGH, "learner_wait_fraction": 0.1}
    verdict = learner_verdict(busy, {})
    assert verdict is not None and verdict.resource == "learner"
    assert "updated 40% of the time and waited for rollouts only 10%" in verdict.summary
    assert "engine busy n/a" in verdict.summary  # not recorded: said, not taken as 0
    assert learner_verdict({**busy, "learner_wait_fraction": LEARNER_WAIT_LOW}, {}) is None
    assert learner_verdict({**busy, "learner_busy_fraction": 0.39}, {}) is None
    assert learner_verdict({"learner_busy_fraction": 0.9}, {}) is None  # wait unknown


def test_orchestrator_verdict_on_a_saturated_core_or_on_time_spent_waiting_for_it():
    cpu = orchestrator_verdict({"orchestrator_cpu_fraction": ORCHESTRATOR_CPU_HIGH}, {})
    assert cpu is not None and cpu.resource == "orchestrator"
    waiting = orchestrator_verdict({"episode_other_fraction": EPISODE_OTHER_HIGH}, {})
    assert waiting is not None and "n/a of a core" in waiting.summary
    assert orchestrator_verdict({"orchestrator_cpu_fraction": 0.84}, {}) is None


def test_environment_verdict_puts_env_actors_first_when_they_are_cpu_bound():
    means = {
        "episode_env_fraction": 0.6,
        "episode_generate_fraction": 0.3,
        "env_cpu_fraction": 0.8,
        "engine_busy_fraction": 0.3,
        "max_concurrent_episodes": 8,
    }
    bound = environment_verdict(means, {"env": {"num_env_actors": 3}})
    assert bound is not None and bound.advice[0].startswith(
        "add env actors (env.num_env_actors 3 -> 6): they are CPU-bound (80%"
    )
    idle = environment_verdict({**means, "env_cpu_fraction": 0.2}, {"env": {"num_env_actors": 3}})
    assert idle is not None and idle.advice[-1] == "or add env actors (env.num_env_actors 3 -> 6)"
    assert idle.advice[0].startswith("raise rollout.max_concurrent_episodes from 8 to ~24")
    # Equal waits are no environment verdict: generation is at least as long.
    assert environment_verdict({**means, "episode_generate_fraction": 0.6}, {}) is None


def test_engine_verdict_reads_part_empty_full_and_underfed_engines_apart():
    busy = {"engine_busy_fraction": ENGINE_BUSY_HIGH, "max_concurrent_episodes": 16}
    sparse = engine_verdict({**busy, "engine_batch_occupancy": 0.4}, {})
    assert sparse.advice[0].endswith(": a decode step costs about the same with more rows")
    assert sparse.advice[-1].startswith("add engine replicas (engine.placement=disaggregated")
    full = engine_verdict(
        {**busy, "engine_batch_occupancy": 0.95},
        {"engine": {"placement": "disaggregated", "num_replicas": 2, "max_batch_size": 32}},
    )
    assert full.advice[0].startswith("batches are full (95% of engine.max_batch_size=32)")
    assert full.advice[1].startswith("add engine replicas (engine.num_replicas 2 -> more")
    underfed = engine_verdict({"engine_busy_fraction": 0.45, "max_concurrent_episodes": 16}, {})
    # 16 episodes keep it 45% busy; the default target 0.9 needs 0.9 / 0.45 x 16 = 32.
    assert underfed.advice == ["raise rollout.max_concurrent_episodes from 16 to ~32"]
    assert "batches n/a full" in underfed.summary
    assert all(v.resource == "engine" for v in (sparse, full, underfed))


def test_more_episodes_advice_asks_for_at_least_one_more_and_names_the_admission_cap():
    # Already above the target: still one more episode, never fewer.
    assert more_episodes_advice(
        {"engine_busy_fraction": 0.95, "max_concurrent_episodes": 10}, {}
    ).startswith("raise rollout.max_concurrent_episodes from 10 to ~11")
    # The budget comes from the settings when the metrics lack it.
    from_settings = more_episodes_advice(
        {"engine_busy_fraction": 0.3},
        {"max_concurrent_episodes": 4, "max_staleness": 0, "groups_per_batch": 2, "group_size": 4},
    )
    assert from_settings.startswith("raise rollout.max_concurrent_episodes from 4 to ~12")
    assert "admission lets at most 8 in flight" in from_settings
    assert more_episodes_advice({}, {}) == "raise rollout.max_concurrent_episodes"
