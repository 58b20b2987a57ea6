"""The pieces ``WindowMetrics.combine`` is made of: the processes' summaries added up
(``add_up``), then each family of metrics a pure function of the totals."""

from __future__ import annotations

import pytest

from raytunix.profiling.metrics import (
    add_up,
    cost_metrics,
    engine_metrics,
    episode_metrics,
    learner_metrics,
    tool_and_env_step_metrics,
)


def _summary(**fields):
    return {"process": "p", "kind": "orchestrator", "host": "h", "pid": 1, **fields}


def test_add_up_sums_two_processes_and_counts_each_engine_process_once():
    engine = _summary(
        kind="engine", pid=2, seconds={"decode": 3.0}, decode_rows=[12.0, 3], dropped=2
    )
    orchestrator = _summary(
        seconds={"episode": 10.0},
        counts={"episode": 2},
        generated_tokens=40,
        episode_generate_s=6.0,
        episode_env_s=3.0,
        tool_latency_s={"calc": [0.1, 0.3]},
        env_step_s=[0.5],
    )
    totals = add_up([engine, orchestrator, dict(engine, dropped=0)])
    assert totals.engine_processes == 1  # the same (host, pid, process) drained twice
    assert totals.seconds == {"decode": 6.0, "episode": 10.0}
    assert totals.decode_rows == [24.0, 6] and totals.dropped == 2
    assert totals.tool_latency == {"calc": [0.1, 0.3]} and totals.env_steps == [0.5]

    assert engine_metrics(totals, 4.0, max_batch_size=8) == {
        "engine_busy_fraction": 1.0,  # 6 s of steps in a 4 s window: capped at 1
        "engine_prefill_fraction": 0.0,
        "engine_decode_rows_mean": 4.0,
        "engine_batch_occupancy": 0.5,
    }
    assert episode_metrics(totals, 4.0) == pytest.approx(
        {
            "trajectories_per_s": 0.5,
            "generated_tokens_per_s": 10.0,
            "episode_generate_fraction": 0.6,
            "episode_env_fraction": 0.3,
            "episode_other_fraction": 0.1,
            "episode_wall_s_mean": 5.0,
        }
    )
    tools = tool_and_env_step_metrics(totals)
    assert tools["tool_calls/calc"] == 2.0 and tools["env_step_latency_s/p50"] == 0.5


def test_a_family_with_nothing_to_read_gives_no_metric_rather_than_zero():
    empty = add_up([])
    assert engine_metrics(empty, 1.0, max_batch_size=8) == {}
    assert learner_metrics(empty, 1.0) == {}
    assert cost_metrics(empty) == {}
    assert tool_and_env_step_metrics(empty) == {}
    waited = add_up([_summary(seconds={"next_batch_wait": 0.5}, counts={"next_batch_wait": 1})])
    assert learner_metrics(waited, 2.0) == {
        "learner_busy_fraction": 0.0,
        "learner_idle_fraction": 1.0,
        "learner_wait_fraction": 0.25,
    }
    published = add_up([_summary(seconds={"weight_publish": 1.5}, counts={"weight_publish": 1})])
    assert cost_metrics(published) == {"weight_publish_s": 1.5}
