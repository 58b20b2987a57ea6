"""Metric sinks (TensorBoard, Ray gauges, console) and the run's profile.png."""

from __future__ import annotations

import io
import json
import logging
import os
import time
import re
import subprocess
import sys

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from raytunix.profiling.plots import tool_latencies, write_plots
from raytunix.profiling.sinks import (
    ConsoleProgress,
    MetricSinks,
    RayMetricsSink,
    TensorBoardSink,
    flatten_metrics,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PROMETHEUS_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")


def _rl_record(step: int, **extra) -> dict:
    return {
        "phase": "rl",
        "step": step,
        "reward_mean": 0.25 * step,
        "tool_use_rate": 0.5,
        "loss": -0.01 * step,
        "generated_tokens_per_s": 1000.0 + step,
        "tool_latency_s/calculator/p50": 0.002 * step,
        "statuses": {"completed": 10 + step, "env_error": 1},
        **extra,
    }


def _scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the TensorBoard runs (one per phase) under ``logdir``."""
    scalars = {}
    for run in sorted(os.listdir(logdir)):
        acc = EventAccumulator(os.path.join(logdir, run))
        acc.Reload()
        scalars.update(
            {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
        )
    return scalars


# flatten_metrics


def test_flatten_keeps_finite_numbers_and_joins_nested_keys():
    record = {
        "phase": "rl",
        "step": 3,
        "loss": -0.5,
        "ok": True,
        "off": False,
        "nan": float("nan"),
        "inf": float("inf"),
        "name": "x",
        "list": [1, 2],
        "none": None,
        "np": np.float32(0.25),
        "np_int": np.int64(7),
        "statuses": {"completed": 5, "env_error": 0, "deeper": {"a": 1.5, "b": "s"}},
    }
    assert flatten_metrics(record) == {
        "step": 3.0,
        "loss": -0.5,
        "ok": 1.0,
        "off": 0.0,
        "np": 0.25,
        "np_int": 7.0,
        "statuses/completed": 5.0,
        "statuses/env_error": 0.0,
        "statuses/deeper/a": 1.5,
    }


# TensorBoard


def test_tensorboard_scalars_read_back_with_tags_steps_and_values(tmp_path):
    logdir = str(tmp_path / "tb")
    sink = TensorBoardSink(logdir)
    for step in (1, 2):
        sink.write(dict(_rl_record(step), time=1_700_000_000.0 + step), step, "rl")
    sink.close()

    scalars = _scalars(logdir)
    assert scalars["rl/reward_mean"] == [(1, 0.25), (2, 0.5)]
    assert scalars["rl/statuses/completed"] == [(1, 11.0), (2, 12.0)]
    assert scalars["rl/loss"] == [(1, pytest.approx(-0.01)), (2, pytest.approx(-0.02))]
    assert scalars["rl/tool_latency_s/calculator/p50"] == [
        (1, pytest.approx(0.002)),
        (2, pytest.approx(0.004)),
    ]
    # step and time are the axes of each event, not scalars of their own
    assert not {"rl/step", "rl/time", "rl/phase"} & set(scalars)
    acc = EventAccumulator(os.path.join(logdir, "rl"))  # a TensorBoard run per phase
    acc.Reload()
    assert [e.wall_time for e in acc.Scalars("rl/loss")] == [1_700_000_001.0, 1_700_000_002.0]


def test_a_resumed_process_replaces_the_steps_it_redoes_in_tensorboard(tmp_path):
    """A run that crashed at step 5 with its checkpoint at step 3 is resumed by a new
    process, which writes a file of its own: TensorBoard shows steps 4 and 5 once, the
    redone ones; the warm start's steps, in a run of their own, are untouched."""
    logdir = str(tmp_path / "tb")
    crashed = TensorBoardSink(logdir)
    crashed.write({"loss": 2.0}, 50, "warmup")
    for step in range(1, 6):
        crashed.write({"reward_mean": 0.1 * step}, step, "rl")
    crashed.close()
    time.sleep(1.1)  # event files are named by the second they were made in
    resumed = TensorBoardSink(logdir)
    resumed.restart("rl", 4)
    for step in (4, 5):
        resumed.write({"reward_mean": 1.0}, step, "rl")
    resumed.close()
    assert len(os.listdir(os.path.join(logdir, "rl"))) == 2
    scalars = _scalars(logdir)
    assert scalars["rl/reward_mean"] == [
        (1, pytest.approx(0.1)),
        (2, pytest.approx(0.2)),
        (3, pytest.approx(0.3)),
        (4, 1.0),
        (5, 1.0),
    ]
    assert scalars["warmup/loss"] == [(50, 2.0)]


def test_tensorboard_sink_that_cannot_write_logs_once_and_turns_off(tmp_path, caplog):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the log directory should go")
    sink = TensorBoardSink(str(blocker / "tb"))
    with caplog.at_level(logging.WARNING, logger="raytunix.profiling.sinks"):
        sink.write(_rl_record(1), 1, "rl")  # must not raise
        sink.write(_rl_record(2), 2, "rl")
        sink.flush()
        sink.close()
    assert not sink.enabled
    warnings = [r for r in caplog.records if "TensorBoard" in r.getMessage()]
    assert len(warnings) == 1 and str(blocker) in warnings[0].getMessage()


def test_metric_sinks_route_each_phase_to_its_tags_and_steps(tmp_path):
    out = io.StringIO()
    sinks = MetricSinks(str(tmp_path), total_rl_steps=4, log_every=3, ray_metrics=False, stream=out)
    sinks.write({"phase": "warmup", "step": 5, "loss": 1.25, "dev_success_rate": 0.5})
    sinks.write({"phase": "eval", "when": "before_rl", "success_rate": 0.25, "tool_use_rate": 0.5})
    for step in range(1, 5):
        sinks.write(_rl_record(step))
    # eval.every's evaluation started after step 2 sits at step 2
    sinks.write({"phase": "eval", "when": "during_rl", "step": 2, "success_rate": 0.5})
    # Resumed from the checkpoint at step 2: steps 3 and 4 are redone, and TensorBoard
    # keeps only the new ones (here with reward 0).
    sinks.write({"phase": "resume", "rl_step": 2, "policy_version": 2})
    for step in (3, 4):
        sinks.write(_rl_record(step, reward_mean=0.0))
    sinks.write({"phase": "eval", "when": "after_rl", "success_rate": 0.75, "tool_use_rate": 1.0})
    sinks.close()

    scalars = _scalars(str(tmp_path / "tensorboard"))
    assert scalars["warmup/loss"] == [(5, 1.25)]
    assert scalars["warmup/dev_success_rate"] == [(5, 0.5)]
    # held-out success at both ends of the RL step axis
    assert scalars["eval/success_rate"] == [(0, 0.25), (2, 0.5), (4, 0.75)]
    assert scalars["rl/reward_mean"] == [(1, 0.25), (2, 0.5), (3, 0.0), (4, 0.0)]
    assert not any(tag.startswith("resume/") for tag in scalars)
    assert sorted(os.listdir(tmp_path / "tensorboard")) == ["eval", "rl", "warmup"]
    # console lines every log_every=3 steps and at the last step, and after the resume
    lines = out.getvalue().splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "RL step 3/4",
        "RL step 4/4",
        "RL step 3/4",
        "RL step 4/4",
    ]


# Ray gauges


def test_ray_metrics_sink_does_nothing_without_ray():
    code = (
        "import ray\n"
        "from raytunix.profiling.sinks import RayMetricsSink\n"
        "sink = RayMetricsSink('run-a')\n"
        "sink.write({'loss': 1.0, 'statuses': {'completed': 3}}, 1, 'rl')\n"
        "assert sink.gauges == {}, sink.gauges\n"
        "assert not ray.is_initialized()\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


@pytest.mark.slow
def test_ray_metrics_sink_makes_one_sanitized_gauge_per_key(ray_session):
    sink = RayMetricsSink("run-b")
    sink.write(
        {
            "phase": "rl",
            "step": 7,
            "reward_mean": 0.5,
            "tool_calls/sql query": 4,
            "tool_latency_s/sql query/p99": 0.25,
            "statuses": {"env-error": 2},
            "weird:key": 1,
            "when": "skipped",
        },
        7,
        "rl",
    )
    sink.write({"phase": "rl", "step": 8, "reward_mean": 0.75}, 8, "rl")  # reuses its gauge

    gauges = sink.gauges
    assert set(gauges) == {
        "raytunix_rl_reward_mean",
        "raytunix_rl_tool_calls_sql_query",
        "raytunix_rl_tool_latency_s_sql_query_p99",
        "raytunix_rl_statuses_env_error",
        "raytunix_rl_weird_key",
        "raytunix_rl_step",
    }
    for name, gauge in gauges.items():
        assert PROMETHEUS_NAME.match(name)
        assert gauge.info["name"] == name
        assert gauge.info["default_tags"] == {"run": "run-b"}
        assert not gauge._discard_metric  # Ray accepts the name, so it is exported


@pytest.mark.slow
def test_ray_metrics_sink_caps_gauges_and_drops_colliding_names(ray_session, caplog):
    sink = RayMetricsSink("run-c", max_gauges=3)
    with caplog.at_level(logging.WARNING, logger="raytunix.profiling.sinks"):
        sink.write({f"key{i}": float(i) for i in range(10)}, 1, "rl")
    assert len(sink.gauges) == 3
    assert sum("not exported" in r.getMessage() for r in caplog.records) == 1

    sink = RayMetricsSink("run-d")
    sink.write({"a/b": 1.0, "a_b": 2.0}, 1, "rl")  # both would be raytunix_rl_a_b
    assert set(sink.gauges) == {"raytunix_rl_a_b", "raytunix_rl_step"}


# console


def test_console_off_terminal_prints_one_plain_line_per_update():
    out = io.StringIO()
    console = ConsoleProgress(30, stream=out)
    console.update(
        3,
        {
            "reward_mean": 0.512,
            "tool_use_rate": 0.98,
            "loss": 0.0123,
            "generated_tokens_per_s": 5321.4,
            "engine_busy_fraction": 0.41,
            "learner_busy_fraction": 0.63,
            "staleness_max": 1,
            "episodes_in_flight": 96,
            "statuses": {"completed": 120},
        },
    )
    console.update(4, {"reward_mean": 0.5})  # absent numbers are left out
    console.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert re.fullmatch(
        r"RL step 3/30: reward 0\.512  tool use 98\.0%  loss \+0\.0123  tok/s 5321  "
        r"engine busy 41%  learner busy 63%  staleness<= 1  in flight 96  \(\d+ s\)",
        lines[0],
    )
    assert re.fullmatch(r"RL step 4/30: reward 0\.500  \(\d+ s\)", lines[1])


def test_console_lines_show_each_steps_own_end_time():
    """The steps of one profiling window are printed together when it closes; each line's
    elapsed seconds come from its record's ``time`` (the step's end), not the print."""
    out = io.StringIO()
    console = ConsoleProgress(30, stream=out)
    start = console._t0
    for step, ended in ((1, start + 4.2), (2, start + 9.0), (3, start + 13.6)):
        console.update(step, {"reward_mean": 0.5, "time": ended})
    console.update(4, {"reward_mean": 0.5})  # no time: now
    console.close()
    assert [line.rsplit("(", 1)[1] for line in out.getvalue().splitlines()] == [
        "4 s)",
        "9 s)",
        "14 s)",
        "0 s)",
    ]


def test_console_disabled_prints_nothing():
    out = io.StringIO()
    console = ConsoleProgress(30, enabled=False, stream=out)
    console.update(1, {"reward_mean": 0.5})
    console.close()
    assert out.getvalue() == ""


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_console_on_terminal_draws_a_live_bar_instead_of_lines(monkeypatch):
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("COLUMNS", "200")
    out = _Terminal()
    console = ConsoleProgress(30, stream=out)
    assert console.live
    console.update(3, {"reward_mean": 0.512, "tool_use_rate": 0.98})
    console.close()
    text = out.getvalue()
    assert "3/30" in text and "reward 0.512" in text and "tool use 98.0%" in text
    assert "\x1b[" in text  # drawn with terminal control codes
    assert "RL step 3/30:" not in text  # not the plain line


# profile.png


def _write_jsonl(path, objs, truncated_tail: str = "") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(obj) + "\n" for obj in objs)
        f.write(truncated_tail)


def _spans_chunk(step: int, spans: list) -> dict:
    return {
        "process": "env 0",
        "kind": "env",
        "pid": 1,
        "host": "h",
        "clock_offset_s": 0.0,
        "dropped": 0,
        "spans": spans,
        "phase": "rl",
        "step": step,
    }


def _read_png(path: str) -> np.ndarray:
    import matplotlib.image

    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    return matplotlib.image.imread(path)


def test_write_plots_draws_a_png_from_metrics_and_spans(tmp_path):
    run = tmp_path / "run"
    records = [
        {"phase": "warmup", "step": 10, "loss": 1.0, "dev_success_rate": 0.2},
        {"phase": "eval", "when": "before_rl", "success_rate": 0.3, "tool_use_rate": 0.4},
    ]
    for step in range(1, 6):
        records.append(
            _rl_record(
                step,
                trajectories_per_s=2.0,
                engine_busy_fraction=0.4,
                learner_busy_fraction=0.6,
                orchestrator_cpu_fraction=0.1,
                time=1e9 + step,
            )
        )
    del records[3]["engine_busy_fraction"]  # a key absent from one record
    records.append({"phase": "resume", "rl_step": 3, "policy_version": 3})
    records.append(_rl_record(4, reward_mean=0.9))
    records.append({"phase": "eval", "when": "after_rl", "success_rate": 0.6, "tool_use_rate": 0.9})
    _write_jsonl(str(run / "metrics.jsonl"), records, truncated_tail='{"phase": "rl", "st')
    spans = [
        ["tool_call", "tool calculator", 1.0, 1.002, None, "g/0"],
        ["tool_call", "tool calculator", 2.0, 2.004, {"ok": True}, "g/1"],
        ["tool_call", "tool python", 3.0, 4.5, None, "g/2"],
        ["env_step", "env", 0.0, 9.0, None, "g/0"],
    ]
    _write_jsonl(
        str(run / "profile" / "spans.jsonl"),
        [_spans_chunk(1, spans[:2]), _spans_chunk(2, spans[2:])],
        truncated_tail='{"spans": [["tool_call"',
    )

    latencies = tool_latencies(str(run / "profile" / "spans.jsonl"))
    assert latencies.keys() == {"calculator", "python"}
    assert latencies["calculator"] == [pytest.approx(0.002), pytest.approx(0.004)]
    assert latencies["python"] == [pytest.approx(1.5)]

    path = write_plots(str(run))
    assert path == str(run / "profile.png")
    image = _read_png(path)
    assert image.shape == (900, 1300, 4)
    assert image.std() > 0  # something was drawn on the white page
    assert not (run / "profile.png.tmp").exists()


def test_write_plots_on_a_run_without_records_still_draws(tmp_path):
    image = _read_png(write_plots(str(tmp_path)))
    assert image.size > 0
    assert tool_latencies(str(tmp_path / "profile" / "spans.jsonl")) == {}
    with pytest.raises(FileNotFoundError, match="no run directory"):
        write_plots(str(tmp_path / "missing"))
