"""The Chrome JSON trace of a run's spans: one process per recorder, one thread per track
lane with properly nested slices, flow arrows binding an episode's spans across processes,
wall-clock alignment of processes, and a spans file damaged by a crash still converts."""

from __future__ import annotations

import collections
import json
import os
import socket
import time

import pytest

from raytunix.profiling.spans import Recorder
from raytunix.profiling.trace import trace_events, write_trace

NEEDS_TS = {"X", "C", "i", "s", "t", "f"}


def check_trace(trace: dict) -> list[dict]:
    """Asserts the trace-event structure every viewer needs; returns the events."""
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    for event in events:
        assert isinstance(event["ph"], str) and isinstance(event["name"], str)
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        if event["ph"] in NEEDS_TS:
            assert isinstance(event["ts"], int) and event["ts"] >= 0, event
        if event["ph"] == "X":
            assert isinstance(event["dur"], int) and event["dur"] >= 0, event
    # Every thread holds properly nested slices: two slices either do not overlap or one
    # holds the other whole.
    threads = collections.defaultdict(list)
    for event in events:
        if event["ph"] == "X":
            threads[event["pid"], event["tid"]].append((event["ts"], event["ts"] + event["dur"]))
    for thread, slices in threads.items():
        open_ends: list[int] = []
        for start, end in sorted(slices, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], f"partly overlapping slices on {thread}"
            open_ends.append(end)
    return events


def names(events: list[dict], kind: str) -> dict[tuple[int, int], str]:
    """(pid, tid) -> name of the process_name (tid 0) or thread_name metadata events."""
    return {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == kind
    }


def slices(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e["ph"] == "X" and e["name"] == name]


def write_spans(run_dir, chunks, tail: str = "") -> None:
    os.makedirs(run_dir / "profile", exist_ok=True)
    with open(run_dir / "profile" / "spans.jsonl", "w") as f:
        for chunk in chunks:
            f.write(json.dumps(chunk) + "\n")
        f.write(tail)


def test_two_recorders_become_two_processes_linked_by_episode_flows(tmp_path):
    orchestrator = Recorder("orchestrator", "orchestrator")
    env = Recorder("env 0", "env")
    t = time.perf_counter()
    orchestrator.add("episode", t, t + 1.0, track="episodes", flow="g0/0")
    orchestrator.add("episode", t + 0.1, t + 0.9, track="episodes", flow="g0/1")
    # Inside episode g0/0 in time, but it belongs to g0/1: it must sit under g0/1.
    orchestrator.add("generate", t + 0.2, t + 0.3, track="episodes", flow="g0/1")
    orchestrator.add("env_step", t + 0.4, t + 0.6, track="episodes", flow="g0/1")
    env.add("env_step", t + 0.45, t + 0.55, track="env", flow="g0/1")
    # Two calls of one tool partly overlap.
    env.add("tool_call", t + 0.46, t + 0.50, track="tool calculator", args={"tool": "calculator"})
    env.add(
        "tool_call",
        t + 0.48,
        t + 0.54,
        track="tool calculator",
        args={"tool": "calculator", "error": "timeout"},
    )
    with env.span("env_reset", track="env", flow="g0/0"):
        pass
    chunks = [dict(r.drain(), phase="rl", step=0) for r in (orchestrator, env)]
    write_spans(tmp_path, chunks, tail='{"process": "orchestrator", "spa')  # crash mid-line

    out = write_trace(tmp_path)
    assert out == str(tmp_path / "trace.json")
    with open(out) as f:
        trace = json.load(f)
    events = check_trace(trace)
    assert trace["metadata"]["bad_lines"] == 1 and trace["metadata"]["spans"] == 8

    processes = names(events, "process_name")
    host, pid = socket.gethostname(), os.getpid()
    assert sorted(processes.values()) == [
        f"env 0 (host {host}, pid {pid})",
        f"orchestrator (host {host}, pid {pid})",
    ]
    pid_of = {name.split(" (")[0]: key[0] for key, name in processes.items()}
    sort_index = {
        e["pid"]: e["args"]["sort_index"]
        for e in events
        if e["ph"] == "M" and e["name"] == "process_sort_index"
    }
    assert sort_index[pid_of["orchestrator"]] < sort_index[pid_of["env 0"]]

    threads = names(events, "thread_name")
    env_threads = {name for (p, _), name in threads.items() if p == pid_of["env 0"]}
    assert env_threads == {"env", "tool calculator", "tool calculator #2"}
    calls = slices(events, "tool_call")
    assert len({c["tid"] for c in calls}) == 2  # the overlapping calls are on two lanes
    assert {c["args"].get("error") for c in calls} == {None, "timeout"}

    episodes = {e["args"]["flow"]: e for e in slices(events, "episode")}
    assert episodes["g0/0"]["tid"] != episodes["g0/1"]["tid"]
    generate = slices(events, "generate")[0]
    assert generate["tid"] == episodes["g0/1"]["tid"] and generate["args"]["flow"] == "g0/1"

    # Flows: each flow event sits at the start of a slice of that flow, on its thread.
    flows = collections.defaultdict(list)
    for e in events:
        if e["ph"] in "stf":
            assert e["cat"] == "episode" and e["name"] == "episode"
            flows[e["id"]].append(e)
    by_place = {(e["pid"], e["tid"], e["ts"]): e for e in events if e["ph"] == "X"}
    linked = {}
    for steps in flows.values():
        assert [s["ph"] for s in steps] == ["s"] + ["t"] * (len(steps) - 2) + ["f"]
        assert steps[-1]["bp"] == "e"
        bound = [by_place[s["pid"], s["tid"], s["ts"]] for s in steps]
        assert len({b["args"]["flow"] for b in bound}) == 1
        linked[bound[0]["args"]["flow"]] = bound
    g0_0 = linked["g0/0"]
    assert [(b["name"], b["pid"]) for b in g0_0] == [
        ("episode", pid_of["orchestrator"]),
        ("env_reset", pid_of["env 0"]),
    ]
    g0_1 = linked["g0/1"]
    assert [b["name"] for b in g0_1] == ["episode", "generate", "env_step", "env_step"]
    assert g0_1[0]["pid"] != g0_1[-1]["pid"] == pid_of["env 0"]


def test_a_turn_span_is_drawn_with_its_generation_and_env_step_as_children(tmp_path):
    orchestrator = Recorder("orchestrator", "orchestrator")
    t = time.perf_counter()
    orchestrator.add("episode", t, t + 1.0, track="episodes", flow="g0/0")
    orchestrator.add(
        "turn",
        t + 0.1,
        t + 0.5,
        "episodes",
        {"turn": 0, "tokens": 16, "generate_s": 0.1, "env_s": 0.25},
        "g0/0",
    )
    # the last turn: cut by the length limit, no env step
    orchestrator.add(
        "turn", t + 0.6, t + 0.7, "episodes", {"turn": 1, "tokens": 9, "generate_s": 0.1}, "g0/0"
    )
    write_spans(tmp_path, [dict(orchestrator.drain(), phase="rl", step=1)])
    with open(write_trace(tmp_path)) as f:
        events = check_trace(json.load(f))
    turns, generates, steps = (slices(events, name) for name in ("turn", "generate", "env_step"))
    assert len(turns) == 2 and len(steps) == 1
    assert len({e["tid"] for e in turns + generates + steps + slices(events, "episode")}) == 1
    # whole microseconds of wall clock: a duration may round either way by one
    assert [(g["ts"] - turn["ts"], g["args"]["tokens"]) for g, turn in zip(generates, turns)] == [
        (0, 16),
        (0, 9),
    ]
    assert all(abs(g["dur"] - 100_000) <= 1 for g in generates)
    (step,) = steps
    assert step["ts"] + step["dur"] == turns[0]["ts"] + turns[0]["dur"]
    assert abs(step["dur"] - 250_000) <= 1 and step["args"] == {"flow": "g0/0"}


def chunk(process, kind, host, pid, offset, spans, dropped=0, step=0):
    return {
        "process": process,
        "kind": kind,
        "pid": pid,
        "host": host,
        "clock_offset_s": offset,
        "dropped": dropped,
        "phase": "rl",
        "step": step,
        "spans": spans,
    }


def test_processes_line_up_on_the_wall_clock_not_on_their_own_clocks():
    # Same pid on two hosts: two processes. The engine's perf_counter reads later, but its
    # wall clock is 50 s earlier than the learner's.
    learner = chunk(
        "learner", "learner", "a", 7, 1000.0, [["update", "learner", 50.0, 50.5, None, None]]
    )
    engine = chunk(
        "engine 0",
        "engine",
        "b",
        7,
        900.0,
        [
            ["decode", "steps", 100.0, 100.25, {"rows": 3}, None],
            ["decode", "steps", 100.25, 100.5, {"rows": 5}, None],
        ],
        dropped=4,
    )
    trace = trace_events([learner, engine])
    events = check_trace(trace)
    assert trace["metadata"]["start_unix_s"] == 1000.0
    processes = {name.split(" (")[0]: key[0] for key, name in names(events, "process_name").items()}
    assert set(processes) == {"learner", "engine 0"}
    (update,) = slices(events, "update")
    decodes = slices(events, "decode")
    assert update["pid"] == processes["learner"]
    assert update["ts"] == 50_000_000 and update["dur"] == 500_000
    assert [(d["ts"], d["dur"]) for d in decodes] == [(0, 250_000), (250_000, 250_000)]

    counter = [
        (e["ts"], e["args"]["rows"]) for e in events if e["ph"] == "C" and e["name"] == "decode"
    ]
    assert counter == [(0, 3), (250_000, 5), (500_000, 0)]
    (instant,) = [e for e in events if e["ph"] == "i"]
    assert instant["pid"] == processes["engine 0"] and instant["args"]["dropped"] == 4
    assert "4 spans dropped" in instant["name"]
    assert trace["metadata"]["dropped_spans"] == 4


def test_a_span_drained_in_another_chunk_than_its_parent_stays_nested():
    # The clock offset sampled at each drain jitters by fractions of a microsecond; the
    # child ends with its parent and must not be pushed to a lane of its own by that.
    first = chunk(
        "orchestrator",
        "orchestrator",
        "h",
        1,
        1000.0000006,
        [["generate", "episodes", 10.0, 10.5, None, "e"]],
    )
    second = chunk(
        "orchestrator",
        "orchestrator",
        "h",
        1,
        1000.0000004,
        [["episode", "episodes", 9.0, 10.5, None, "e"]],
        step=1,
    )
    events = check_trace(trace_events([first, second]))
    assert len(names(events, "thread_name")) == 1
    (episode,) = slices(events, "episode")
    (generate,) = slices(events, "generate")
    assert episode["ts"] + episode["dur"] == generate["ts"] + generate["dur"]


def test_lanes_stay_few_when_many_spans_overlap():
    # 20 episodes, at most 4 running at once, each with a turn inside it.
    spans = []
    for i in range(20):
        start = i * 0.25
        spans.append(["episode", "episodes", start, start + 1.0, None, f"g/{i}"])
        spans.append(["generate", "episodes", start + 0.1, start + 0.2, {"tokens": 8}, f"g/{i}"])
    trace = trace_events([chunk("orchestrator", "orchestrator", "h", 1, 0.0, spans)])
    events = check_trace(trace)
    lanes = sorted(names(events, "thread_name").values())
    assert lanes == ["episodes", "episodes #2", "episodes #3", "episodes #4"]
    tid_of = {e["args"]["flow"]: e["tid"] for e in slices(events, "episode")}
    assert all(g["tid"] == tid_of[g["args"]["flow"]] for g in slices(events, "generate"))
    in_flight = [
        e["args"]["in flight"] for e in events if e["ph"] == "C" and e["name"] == "episodes"
    ]
    assert max(in_flight) == 4 and in_flight[-1] == 0


def test_malformed_chunks_and_spans_are_counted_not_fatal():
    good = chunk(
        "driver",
        "driver",
        "h",
        1,
        0.0,
        [
            ["train_step", "main", 1.0, 2.0, None, None],
            ["eval", "main", 3.0, 2.0, None, None],  # ends before it starts
            ["broken"],
        ],
    )
    trace = trace_events([good, "not a chunk", {"spans": []}])
    assert trace["metadata"]["bad_chunks"] == 2 and trace["metadata"]["bad_spans"] == 2
    assert [e["name"] for e in check_trace(trace) if e["ph"] == "X"] == ["train_step"]


def test_a_run_without_spans_says_where_they_come_from(tmp_path):
    with pytest.raises(FileNotFoundError, match="spans.jsonl.*first drain"):
        write_trace(tmp_path)


def test_a_spans_file_path_writes_next_to_its_run(tmp_path):
    write_spans(
        tmp_path,
        [chunk("learner", "learner", "h", 1, 0.0, [["update", "learner", 1.0, 2.0, None, None]])],
    )
    out = write_trace(tmp_path / "profile" / "spans.jsonl")
    assert out == str(tmp_path / "trace.json")
    custom = write_trace(tmp_path, tmp_path / "elsewhere.json")
    with open(custom) as f:
        assert [e["name"] for e in check_trace(json.load(f)) if e["ph"] == "X"] == ["update"]


def test_a_session_id_used_again_later_starts_a_new_flow():
    # An evaluation (or a resumed run) gives a later episode the same session id: one
    # flow per episode, not one arrow chain through both.
    orch = chunk(
        "orchestrator",
        "orchestrator",
        "h",
        1,
        0.0,
        [
            ["episode", "episodes", 1.0, 2.0, None, "eval0/0"],
            ["generate", "episodes", 1.1, 1.5, None, "eval0/0"],
            ["episode", "episodes", 10.0, 11.0, None, "eval0/0"],
            ["generate", "episodes", 10.1, 10.5, None, "eval0/0"],
        ],
    )
    engine = chunk(
        "engine 0",
        "engine",
        "h",
        2,
        0.0,
        [
            ["request", "slot 0", 1.2, 1.4, None, "eval0/0"],
            ["request", "slot 0", 10.2, 10.4, None, "eval0/0"],
        ],
    )
    events = trace_events([orch, engine])["traceEvents"]
    flows = collections.defaultdict(list)
    for e in events:
        if e["ph"] in ("s", "t", "f"):
            flows[e["id"]].append(e["ts"])
    assert len(flows) == 2
    for times in flows.values():  # each chain stays inside its own episode's second
        assert max(times) - min(times) < 1_000_000
