"""The rollout orchestrator with in-process fakes: a scripted engine, real calculator
environments in this process (``LocalEnv``) and the real ``ToolAgent``. No Ray."""

from __future__ import annotations

import asyncio
import random
import re

import pytest

from raytunix.agents import ToolAgent
from raytunix.envs import ENVS, CalculatorMathEnv
from raytunix.models.tokenizer import Tokenizer
from raytunix.rollout.batch import record_batch_to_trajectories
from raytunix.rollout.env_pool import LocalEnv
from raytunix.rollout.episode import EnvFailure
from raytunix.rollout.faults import Backoff
from raytunix.rollout.ledger import TaskLedger
from raytunix.rollout.orchestrator import RolloutOrchestrator
from raytunix.types import (
    EngineFailure,
    EpisodeStatus,
    FinishReason,
    GenerationResult,
    RolloutHalted,
    SamplingParams,
    Task,
)

# Tests retry on a millisecond scale: the schedule's shape matters, not its seconds.
FAST = Backoff(initial_delay_s=0.001, max_delay_s=0.004, max_attempts=3)

TOKENIZER = Tokenizer.byte_level()
TASKS = [Task(f"t{i}", f"Calculate {10 + i} + {20 + 3 * i}.", str(30 + 4 * i)) for i in range(40)]
_QUESTION = re.compile(r"Calculate (\d+) \+ (\d+)\.")


class FakeEngine:
    """Solves ``Calculate A + B.`` through the calculator: turn 0 calls the tool, later
    turns answer. Every token is stamped with the version the engine held when the request
    arrived. Records the requests and how many were in flight at once.

    Args:
      delay: request -> seconds to wait before answering (lets episodes interleave).
      direct: (a, b) -> answer at once, without the tool.
      wrong: (a, b) -> give a wrong answer.
    """

    def __init__(
        self, delay=lambda request: 0.0, direct=lambda a, b: False, wrong=lambda a, b: False
    ):
        self.version = 0
        self.delay, self.direct, self.wrong = delay, direct, wrong
        self.fail_first_call_of: set[str] = set()  # group ids whose first request raises
        self.requests = []
        self.outputs: dict[str, str] = {}  # request id -> text
        self.in_flight = 0
        self.max_in_flight = 0

    async def generate(self, request):
        version = self.version
        self.requests.append(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            group_id, _, turn = request.request_id.split("/")
            if group_id in self.fail_first_call_of:
                self.fail_first_call_of.discard(group_id)
                raise EngineFailure(f"engine crashed on {request.request_id}")
            await asyncio.sleep(self.delay(request))
            a, b = map(int, _QUESTION.search(TOKENIZER.decode(list(request.prompt_ids))).groups())
            answer = a + b + (1 if self.wrong(a, b) else 0)
            if int(turn) == 0 and not self.direct(a, b):
                text = (
                    '<tool_call>{"name": "calculator", "arguments": {"expression": '
                    f'"{a} + {b}"}}}}</tool_call>'
                )
            else:
                text = f"<answer>{answer}</answer>"
            ids = TOKENIZER.encode(text) + [TOKENIZER.end_id]
            self.outputs[request.request_id] = text
            return GenerationResult(
                request_id=request.request_id,
                token_ids=tuple(ids),
                logprobs=(-0.25,) * len(ids),
                policy_versions=(version,) * len(ids),
                finish_reason=FinishReason.STOP,
                text=text + "<|end|>",
            )
        finally:
            self.in_flight -= 1


class FlakyEnv:
    """An env client whose ``step`` fails the way a dead env actor does."""

    def __init__(self, env):
        self._env = env

    async def reset(self, task):
        return await self._env.reset(task)

    async def step(self, action):
        raise EnvFailure("env actor died")

    async def close(self):
        await self._env.close()


class EnvLeases:
    """``env_provider`` handing out in-process calculator environments; records the
    episodes in flight and the order in which groups asked for environments.

    Args:
      flaky: (group id, member number within the group) -> give a ``FlakyEnv``.
      env_name: the registered environment to build.
    """

    def __init__(self, flaky=lambda group_id, member: False, env_name="calculator_math"):
        self.flaky = flaky
        self.env_name = env_name
        self.outstanding = 0
        self.max_outstanding = 0
        self.leases_per_group: dict[str, int] = {}

    def __call__(self, group_id):
        member = self.leases_per_group.get(group_id, 0)
        self.leases_per_group[group_id] = member + 1
        self.outstanding += 1
        self.max_outstanding = max(self.max_outstanding, self.outstanding)
        env = LocalEnv(self.env_name, {"max_tool_errors": 2})
        if self.flaky(group_id, member):
            env = FlakyEnv(env)

        def release():
            self.outstanding -= 1

        return env, release

    def group_order(self) -> list[str]:
        return list(self.leases_per_group)  # dicts keep insertion order


def make_orchestrator(engine, env_provider=None, **kwargs) -> RolloutOrchestrator:
    args = dict(
        group_size=2,
        groups_per_batch=2,
        max_concurrent_episodes=8,
        max_staleness=1,
        max_turns=4,
        max_context_tokens=1024,
        sampling=SamplingParams(max_new_tokens=128, temperature=1.0),
        episode_timeout_s=60.0,
        batch_queue_size=2,
        engine_backoff=FAST,
        retry_backoff=FAST,
    )
    args.update(kwargs)
    return RolloutOrchestrator(
        tasks=TASKS,
        agent_factory=lambda: ToolAgent(TOKENIZER),
        engine=engine,
        env_provider=env_provider or EnvLeases(),
        **args,
    )


async def settle(rounds: int = 200) -> None:
    """Lets every runnable coroutine make progress (the fake engine never really waits)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


async def learner_loop(orchestrator, engine, num_batches, train_s=0.0, on_batch=None):
    """What the driver does: take a batch, 'train' on it, publish weights (bump the engine's
    version), then mark the batch trained. Returns ``[(trajectories, info, consumed_at)]``."""
    consumed = []
    for _ in range(num_batches):
        [batch], info = await orchestrator.next_batch()
        consumed.append((record_batch_to_trajectories(batch), info, engine.version))
        if on_batch is not None:
            await on_batch(len(consumed) - 1)
        await asyncio.sleep(train_s)
        engine.version += 1
        orchestrator.mark_trained(info["batch_id"], engine.version)
    return consumed


def index_of(group_id: str) -> int:
    return int(group_id[1:])


def run(coro):
    return asyncio.run(coro)


# -- groups, batches and the exact tokens ----------------------------------------------------


def test_batches_hold_whole_groups_with_exact_tokens_and_loss_mask():
    async def main():
        engine = FakeEngine()
        orchestrator = make_orchestrator(engine, group_size=3, groups_per_batch=2)
        [batch], info = await orchestrator.next_batch()
        await orchestrator.stop()
        return engine, batch, info

    engine, batch, info = run(main())
    trajectories = record_batch_to_trajectories(batch)
    assert len(trajectories) == 6
    groups: dict[str, list] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    assert len(groups) == 2 and all(len(g) == 3 for g in groups.values())
    for group_id, members in groups.items():
        task = TASKS[index_of(group_id)]
        assert {t.task_id for t in members} == {task.task_id}
        for t in members:
            assert t.status == EpisodeStatus.COMPLETED and t.reward == 1.0 and t.num_turns == 2
            a, b = map(int, _QUESTION.search(task.question).groups())
            call = (
                '<tool_call>{"name": "calculator", "arguments": {"expression": '
                f'"{a} + {b}"}}}}</tool_call><|end|>'
            )
            answer = f"<answer>{a + b}</answer><|end|>"
            prompt = TOKENIZER.encode(f"<|user|>{task.question}<|end|><|assistant|>")
            observation = TOKENIZER.encode(f"<|tool|>{a + b}<|end|><|assistant|>")
            expected = prompt + TOKENIZER.encode(call) + observation + TOKENIZER.encode(answer)
            assert t.token_ids == expected
            mask = (
                [0] * len(prompt)
                + [1] * len(TOKENIZER.encode(call))
                + [0] * len(observation)
                + [1] * len(TOKENIZER.encode(answer))
            )
            assert t.loss_mask == mask
            assert all((lp == -0.25) == bool(m) for lp, m in zip(t.logprobs, t.loss_mask))
            assert all(
                (v == 0) == bool(m) and (v == -1) != bool(m)
                for v, m in zip(t.policy_versions, t.loss_mask)
            )
    assert info["batch_id"] == 0 and info["consume_version"] == 0
    assert info["num_trajectories"] == 6
    assert info["reward_mean"] == 1.0 and info["tool_use_rate"] == 1.0
    # every sample solved its task: each group's rewards are equal, so no advantage
    assert info["zero_variance_group_fraction"] == 1.0 and info["truncated_fraction"] == 0.0
    assert info["statuses"] == {"completed": 6}
    # Each sample of a group gets its own seed, or every sample would be identical.
    for group_id in groups:
        seeds = [
            r.seed
            for r in engine.requests
            if r.request_id.startswith(f"{group_id}/") and r.request_id.endswith("/0")
        ]
        assert len(seeds) == 3 and len(set(seeds)) == 3


# -- staleness ---------------------------------------------------------------------------------


def test_zero_staleness_starts_no_group_before_the_previous_batch_is_trained():
    async def main():
        engine = FakeEngine(delay=lambda r: random.random() * 0.002)
        orchestrator = make_orchestrator(
            engine, max_staleness=0, group_size=2, groups_per_batch=3, max_concurrent_episodes=64
        )
        started = []

        async def after_batch(k):
            await settle()
            started.append(orchestrator.stats()["groups_started"])

        consumed = await learner_loop(orchestrator, engine, 4, on_batch=after_batch)
        await orchestrator.stop()
        return consumed, started

    random.seed(0)
    consumed, started = run(main())
    assert started == [3, 6, 9, 12]  # batch k+1's groups wait for mark_trained(k)
    for trajectories, info, version in consumed:
        assert info["consume_version"] == version
        assert {v for t in trajectories for v, m in zip(t.policy_versions, t.loss_mask) if m} == {
            version
        }
        assert info["staleness_max"] == 0


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_every_consumed_token_is_at_most_max_staleness_versions_old(max_staleness):
    async def main():
        rng = random.Random(max_staleness)
        # Uneven generation times: groups finish out of order, weights change mid-episode.
        engine = FakeEngine(delay=lambda r: rng.choice([0.0, 0.0, 0.001, 0.005, 0.02]))
        orchestrator = make_orchestrator(
            engine,
            max_staleness=max_staleness,
            group_size=2,
            groups_per_batch=2,
            max_concurrent_episodes=16,
        )
        consumed = await learner_loop(orchestrator, engine, 8, train_s=0.003)
        stats = orchestrator.stats()
        await orchestrator.stop()
        return consumed, stats

    consumed, stats = run(main())
    for trajectories, info, version in consumed:
        assert info["consume_version"] == version
        ages = [
            version - v for t in trajectories for v, m in zip(t.policy_versions, t.loss_mask) if m
        ]
        assert ages and 0 <= min(ages) and max(ages) <= max_staleness
        assert info["staleness_max"] == max(ages)
    # Admission lets the producer run ahead, but never beyond the staleness window.
    assert stats["groups_started"] - stats["groups_dropped"] <= (8 + max_staleness + 1) * 2


# -- concurrency and backpressure ---------------------------------------------------------------


def test_max_concurrent_episodes_is_never_exceeded():
    async def main():
        engine = FakeEngine(delay=lambda r: 0.001)
        leases = EnvLeases()
        orchestrator = make_orchestrator(
            engine,
            leases,
            group_size=2,
            groups_per_batch=4,
            max_concurrent_episodes=5,
            max_staleness=2,
        )
        await learner_loop(orchestrator, engine, 4)
        await orchestrator.stop()
        return engine, leases

    engine, leases = run(main())
    assert leases.max_outstanding <= 5
    assert leases.max_outstanding >= 4  # two groups of two did run at once
    assert engine.max_in_flight <= 5
    assert leases.outstanding == 0  # every environment was released


def test_producer_stops_when_the_batch_queue_is_full():
    async def main():
        engine = FakeEngine()
        # A staleness window far wider than the queue: only the queue can hold it back.
        orchestrator = make_orchestrator(
            engine,
            group_size=2,
            groups_per_batch=1,
            max_concurrent_episodes=2,
            max_staleness=100,
            batch_queue_size=1,
        )
        [_], _ = await orchestrator.next_batch()
        await settle(500)
        stalled = orchestrator.stats()
        await learner_loop(orchestrator, engine, 2)  # consuming lets it go on
        await settle(500)
        resumed = orchestrator.stats()
        await orchestrator.stop()
        return stalled, resumed

    stalled, resumed = run(main())
    # One batch queued, one formed and waiting to be queued, one group in flight.
    assert stalled["queue_depth"] == 1
    assert stalled["groups_started"] <= 4
    assert resumed["groups_started"] > stalled["groups_started"]
    assert resumed["groups_started"] <= stalled["groups_started"] + 3


# -- exactly-once accounting and resume -------------------------------------------------------


def _trained_indices(consumed) -> list[int]:
    return sorted(
        index_of(g) for trajectories, _, _ in consumed for g in {t.group_id for t in trajectories}
    )


def _assert_accounted(trained: list[int], state: dict) -> None:
    handed_out = set(range(state["next_index"]))
    pending = set(state["pending"])
    assert len(trained) == len(set(trained)), "a task was trained twice"
    assert not set(trained) & pending
    assert set(trained) | pending <= handed_out
    filtered = handed_out - set(trained) - pending
    counted = sum(v for k, v in state["counters"].items() if k.startswith("groups_filtered_"))
    assert len(filtered) == counted
    # The saved ledger says the same, index by index.
    ledger = TaskLedger.from_json(state["ledger"])
    ledger.check(state["next_index"], pending)
    assert list(ledger.trained) == sorted(trained)
    assert {i for r in ledger.filtered.values() for i in r} == filtered


def test_every_task_is_trained_filtered_or_pending_and_resume_redoes_pending_first():
    def flaky(group_id, member):  # every third task fails; its group is dropped
        return member == 0 and index_of(group_id) % 3 == 0

    async def first_run():
        engine = FakeEngine(delay=lambda r: 0.001)
        orchestrator = make_orchestrator(
            engine,
            EnvLeases(flaky),
            drop_failed_groups=True,
            group_size=2,
            groups_per_batch=2,
            max_concurrent_episodes=4,
            max_staleness=1,
        )
        consumed = await learner_loop(orchestrator, engine, 4)
        await orchestrator.next_batch()  # taken by the learner, crash before training on it
        await settle()
        await orchestrator.stop()
        return engine, consumed, orchestrator.state()

    engine, consumed, state = run(first_run())
    trained = _trained_indices(consumed)
    assert len(trained) == 8
    assert state["counters"]["groups_filtered_failed_episode"] >= 1
    assert state["pending"], "the untrained batch's tasks stay pending"
    _assert_accounted(trained, state)
    assert all(
        index_of(g) % 3 != 0
        for g in {t.group_id for trajectories, _, _ in consumed for t in trajectories}
    )

    async def resumed_run():
        leases = EnvLeases(flaky)
        orchestrator = make_orchestrator(
            engine,
            leases,
            drop_failed_groups=True,
            group_size=2,
            groups_per_batch=2,
            max_concurrent_episodes=4,
            max_staleness=1,
            state=state,
            policy_version=engine.version,
        )
        consumed = await learner_loop(orchestrator, engine, 4)
        await orchestrator.stop()
        return leases, consumed, orchestrator.state()

    leases, consumed_after, state_after = run(resumed_run())
    order = [index_of(g) for g in leases.group_order()]
    pending = state["pending"]
    assert order[: len(pending)] == pending  # the pending tasks first, in order
    assert order[len(pending)] == state["next_index"]  # then on from the data position
    assert all(i >= state["next_index"] for i in order[len(pending) :])
    _assert_accounted(trained + _trained_indices(consumed_after), state_after)


# -- failures -------------------------------------------------------------------------------------


def test_env_failure_ends_one_episode_and_masks_it_but_keeps_the_group():
    async def main():
        engine = FakeEngine()
        orchestrator = make_orchestrator(
            engine, EnvLeases(lambda g, member: member == 0), group_size=3, groups_per_batch=1
        )
        [batch], info = await orchestrator.next_batch()
        await orchestrator.stop()
        return record_batch_to_trajectories(batch), info, orchestrator.stats()["counters"]

    trajectories, info, counters = run(main())
    assert len(trajectories) == 3
    failed = [t for t in trajectories if t.status == EpisodeStatus.ENV_ERROR]
    assert len(failed) == 1
    assert failed[0].reward == 0.0 and set(failed[0].loss_mask) == {0}
    assert len(failed[0].token_ids) > 0  # the tokens stay; only the mask is zeroed
    for t in trajectories:
        if t is not failed[0]:
            assert t.status == EpisodeStatus.COMPLETED and sum(t.loss_mask) > 0
    assert info["statuses"] == {"completed": 2, "env_error": 1}
    assert counters["episodes_env_error"] >= 1


def test_groups_with_a_failed_episode_are_dropped_and_counted_when_configured():
    def flaky(group_id, member):
        return member == 1 and index_of(group_id) % 2 == 0

    async def main():
        engine = FakeEngine()
        orchestrator = make_orchestrator(
            engine,
            EnvLeases(flaky),
            drop_failed_groups=True,
            group_size=2,
            groups_per_batch=2,
            max_concurrent_episodes=4,
        )
        consumed = await learner_loop(orchestrator, engine, 3)
        await orchestrator.stop()
        return consumed, orchestrator.state()

    consumed, state = run(main())
    for trajectories, info, _ in consumed:
        assert all(t.status == EpisodeStatus.COMPLETED for t in trajectories)
        assert all(index_of(t.group_id) % 2 == 1 for t in trajectories)
    assert state["counters"]["groups_filtered_failed_episode"] >= 3
    _assert_accounted(_trained_indices(consumed), state)


class ExplodingEnv(CalculatorMathEnv):
    """A real environment with a bug: it raises on every final answer."""

    def _step_impl(self, action):
        if action.answer is not None:
            raise ZeroDivisionError("verifier bug")
        return super()._step_impl(action)


class BrokenResetEnv(CalculatorMathEnv):
    def _initial_observation(self, task):
        raise OSError("dataset file vanished")


def test_an_environment_that_raises_in_step_trips_the_breaker_with_one_clear_error(monkeypatch):
    """Every episode ends as env_error: no batch of failures is emitted as if it were data;
    each group is retried a bounded number of times, then the breaker stops the rollout."""
    monkeypatch.setitem(ENVS, "exploding", ExplodingEnv)

    async def main():
        orchestrator = make_orchestrator(
            FakeEngine(),
            EnvLeases(env_name="exploding"),
            groups_per_batch=1,
            max_group_retries=1,
            max_consecutive_failures=12,
        )
        evaluation = await orchestrator.evaluate(TASKS[:3], max_new_tokens=64)
        assert evaluation["statuses"] == {"env_error": 3}
        assert "verifier bug" in evaluation["error"]
        with pytest.raises(
            RolloutHalted, match="12 episodes in a row failed: the environment raised"
        ) as halted:
            await asyncio.wait_for(orchestrator.next_batch(), 30)
        with pytest.raises(RolloutHalted):  # it stays halted
            await asyncio.wait_for(orchestrator.next_batch(), 30)
        await orchestrator.stop()
        return halted.value, orchestrator.state()

    error, state = run(main())
    assert "env_error" in str(error) and "resume" in str(error)
    assert "verifier bug" in str(error)  # the environment's own error reaches the user
    assert "infrastructure" not in str(error) and "look down" not in str(error)
    counters = state["counters"]
    assert counters["episodes_env_error"] >= 12
    assert counters["groups_retried_env_error"] >= 1
    assert counters.get("groups_retried_engine_error", 0) == 0
    assert counters.get("groups_trained", 0) == 0
    _assert_accounted([], state)  # every task handed out is filtered (counted) or pending


def test_an_environment_that_raises_in_reset_is_retried_then_filtered_not_retried_forever(
    monkeypatch,
):
    monkeypatch.setitem(ENVS, "broken_reset", BrokenResetEnv)

    async def main():
        orchestrator = make_orchestrator(
            FakeEngine(),
            EnvLeases(env_name="broken_reset"),
            groups_per_batch=1,
            max_group_retries=2,
            max_consecutive_failures=0,
        )  # breaker off
        next_batch = asyncio.ensure_future(orchestrator.next_batch())
        for _ in range(2000):
            await asyncio.sleep(0.001)
            if orchestrator.counters["groups_filtered_env_error"] >= 3:
                break
        assert not next_batch.done()  # nothing to train on was handed out
        next_batch.cancel()
        await orchestrator.stop()
        return orchestrator.state()

    state = run(main())
    counters = state["counters"]
    assert counters["groups_filtered_env_error"] >= 3
    # A filtered task was retried max_group_retries (2) times before it was given up; one
    # still pending, at most that often.
    filtered = counters["groups_filtered_env_error"]
    assert (
        2 * filtered
        <= counters["groups_retried_env_error"]
        <= 2 * (filtered + len(state["pending"]))
    )
    assert counters.get("groups_retried_engine_error", 0) == 0
    _assert_accounted([], state)


def test_a_short_engine_outage_is_retried_inside_the_episode_and_costs_no_task():
    async def main():
        engine = FakeEngine(delay=lambda r: 0.005)
        engine.fail_first_call_of = {"g1"}
        leases = EnvLeases()
        orchestrator = make_orchestrator(
            engine,
            leases,
            group_size=3,
            groups_per_batch=1,
            max_concurrent_episodes=3,
            max_staleness=1,
        )
        consumed = await learner_loop(orchestrator, engine, 4)
        await orchestrator.stop()
        return leases, consumed, orchestrator.state()

    leases, consumed, state = run(main())
    assert state["counters"]["engine_retries"] == 1
    assert state["counters"].get("groups_retried_engine_error", 0) == 0
    trained = _trained_indices(consumed)
    assert trained == [0, 1, 2, 3]
    _assert_accounted(trained, state)
    assert leases.outstanding == 0


def test_an_engine_down_past_the_episode_retries_retries_the_group_without_orphans():
    async def main():
        engine = FakeEngine(delay=lambda r: 0.005)
        engine.fail_first_call_of = {"g1"}
        leases = EnvLeases()
        orchestrator = make_orchestrator(
            engine,
            leases,
            group_size=3,
            groups_per_batch=1,
            max_concurrent_episodes=3,
            max_staleness=1,
            engine_backoff=Backoff(0.001, 0.001, max_attempts=1),
        )
        consumed = await learner_loop(orchestrator, engine, 4)
        await orchestrator.stop()
        return leases, consumed, orchestrator.state()

    leases, consumed, state = run(main())
    assert state["counters"]["groups_retried_engine_error"] == 1
    trained = _trained_indices(consumed)
    assert 1 in trained  # the failed group was redone, not lost
    _assert_accounted(trained, state)
    # The failed group's other episodes did not keep running beside the next groups.
    assert leases.max_outstanding <= 3
    assert leases.outstanding == 0


class AlwaysFailingFor(FakeEngine):
    """Every request of the named groups raises, every time."""

    def __init__(self, groups, **kwargs):
        super().__init__(**kwargs)
        self.broken = set(groups)
        self.failed_calls = 0

    async def generate(self, request):
        if request.request_id.split("/")[0] in self.broken:
            self.failed_calls += 1
            raise ConnectionError(f"engine unreachable for {request.request_id}")
        return await super().generate(request)


def test_a_task_whose_engine_calls_always_fail_is_filtered_after_bounded_retries():
    async def main():
        engine = AlwaysFailingFor({"g0"}, delay=lambda r: 0.001)
        orchestrator = make_orchestrator(
            engine, group_size=2, groups_per_batch=1, max_concurrent_episodes=2, max_group_retries=2
        )
        consumed = await learner_loop(orchestrator, engine, 3)
        await orchestrator.stop()
        return engine, consumed, orchestrator.state()

    engine, consumed, state = run(main())
    assert state["counters"]["groups_retried_engine_error"] == 2  # then given up
    assert state["counters"]["groups_filtered_engine_error"] == 1
    # 3 group tries; in each, one episode spends FAST.max_attempts calls and then its
    # sibling is cancelled (at most as many): bounded, not a tight loop.
    assert 3 * FAST.max_attempts <= engine.failed_calls <= 3 * 2 * FAST.max_attempts
    trained = _trained_indices(consumed)
    assert 0 not in trained and 0 not in state["pending"]
    _assert_accounted(trained, state)


class BuggyAgent(ToolAgent):
    def parse(self, text):
        raise KeyError("a bug in the parser")


def test_a_bug_in_agent_code_is_raised_not_retried_as_an_engine_failure():
    async def main():
        engine = FakeEngine()
        orchestrator = RolloutOrchestrator(
            tasks=TASKS,
            agent_factory=lambda: BuggyAgent(TOKENIZER),
            engine=engine,
            env_provider=EnvLeases(),
            group_size=2,
            groups_per_batch=1,
            max_concurrent_episodes=2,
            max_staleness=0,
            max_turns=2,
            max_context_tokens=1024,
            sampling=SamplingParams(max_new_tokens=128),
            engine_backoff=FAST,
            retry_backoff=FAST,
        )
        with pytest.raises(KeyError, match="a bug in the parser"):
            await asyncio.wait_for(orchestrator.next_batch(), 30)
        await orchestrator.stop()
        return engine, orchestrator.state()

    engine, state = run(main())
    assert len(engine.requests) == 2  # one call per episode of the first group, no retry
    assert not any(k.startswith("groups_retried") for k in state["counters"])
    assert state["pending"] == [0]  # the task is kept for a fixed run to redo


def test_an_episode_over_its_time_budget_ends_as_timeout_and_leaves_group_statistics():
    async def main():
        # Member 0 of every group (seed = index * 2 + member) never gets its answer turn.
        def delay(r):
            _, seed, turn = r.request_id.split("/")
            return 3600.0 if turn == "1" and int(seed) % 2 == 0 else 0.0

        engine = FakeEngine(delay=delay)
        orchestrator = make_orchestrator(
            engine, group_size=2, groups_per_batch=1, episode_timeout_s=0.05
        )
        [batch], info = await orchestrator.next_batch()
        await orchestrator.stop()
        return record_batch_to_trajectories(batch), info, orchestrator.stats()["counters"]

    trajectories, info, counters = run(main())
    assert sorted(t.status.value for t in trajectories) == ["completed", "timeout"]
    timed_out = next(t for t in trajectories if t.status == EpisodeStatus.TIMEOUT)
    assert timed_out.reward == 0.0 and set(timed_out.loss_mask) == {0}
    assert info["valid_trajectories"] == 1
    assert counters["episodes_timeout"] >= 1
    assert counters["episodes_failed_infrastructure"] >= 1


# -- evaluation ----------------------------------------------------------------------------------


def test_evaluate_reports_success_and_tool_use_rates():
    async def main():
        # Odd first operands are answered directly, and wrongly; even ones use the tool.
        engine = FakeEngine(direct=lambda a, b: a % 2 == 1, wrong=lambda a, b: a % 2 == 1)
        orchestrator = make_orchestrator(engine)
        result = await orchestrator.evaluate(TASKS[:6], max_new_tokens=128)
        return engine, result

    engine, result = run(main())
    assert result["num_tasks"] == 6
    assert result["success_rate"] == pytest.approx(0.5)
    assert result["reward_mean"] == pytest.approx(0.5)  # rewards are 1 or 0 here
    assert result["tool_use_rate"] == pytest.approx(0.5)
    assert result["tool_path_accuracy"] == 1.0
    assert result["direct_accuracy"] == 0.0
    assert result["statuses"] == {"completed": 6}
    assert all(r.sampling.temperature == 0.0 for r in engine.requests)  # greedy


def test_batches_reach_the_learner_in_the_order_they_were_formed():
    """Many groups finish while the queue is full; a batch formed earlier must not be
    overtaken, or it would be consumed later than its staleness check assumed."""

    async def main():
        rng = random.Random(3)
        engine = FakeEngine(delay=lambda r: rng.choice([0.0, 0.0, 0.0005, 0.002]))
        orchestrator = make_orchestrator(
            engine,
            group_size=2,
            groups_per_batch=1,
            max_concurrent_episodes=32,
            max_staleness=8,
            batch_queue_size=1,
        )
        consumed = await learner_loop(orchestrator, engine, 30)
        await orchestrator.stop()
        return consumed

    consumed = run(main())
    assert [info["batch_id"] for _, info, _ in consumed] == list(range(30))
    for trajectories, info, version in consumed:
        assert info["consume_version"] == version
        assert all(
            version - v <= 8
            for t in trajectories
            for v, m in zip(t.policy_versions, t.loss_mask)
            if m
        )
