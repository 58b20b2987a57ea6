"""A verifiers 0.4 environment defined in code, as a user's package would define one: a
taskset of one-line sums, scored by two ``@vf.reward`` functions; ``make_env`` builds the
single-seat environment that ``env.kwargs.env_id=verifiers_example:make_env`` names.

It is also a verifiers taskset package (``__all__`` exports its one ``Taskset``), so
``vf.load_environment`` can load it by the id ``verifiers_example``."""

import asyncio
from collections.abc import Iterator

import verifiers.v1 as vf

SUMS = [(a, b) for a in range(1, 7) for b in range(1, 4)]


class SumData(vf.TaskData):
    answer: str


def score(answer: str, reply: str) -> float:
    """The environment's whole score, for the tests to recompute: 1 when the reply holds
    the answer, plus 0.5 x a brevity term in (0, 1]."""
    return float(answer in reply) + 0.5 / (1.0 + len(reply))


class SumTaskConfig(vf.TaskConfig):
    explode: bool = False
    """The first reward function raises (a rubric's bug)."""
    stall_s: float = 0.0
    """Seconds the first reward function waits before scoring (a hanging rubric)."""


class SumTask(vf.Task[SumData, vf.State, SumTaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        if self.config.explode:
            raise ZeroDivisionError("the rubric's own bug")
        await asyncio.sleep(self.config.stall_s)
        return float(self.data.answer in trace.last_reply)

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return 1.0 / (1.0 + len(trace.last_reply))


class SumTasksetConfig(vf.TasksetConfig):
    task: SumTaskConfig = SumTaskConfig()


class SumTaskset(vf.Taskset[SumTask, SumTasksetConfig]):
    def load(self) -> Iterator[SumTask]:
        for a, b in SUMS:
            yield SumTask(SumData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)


def make_env(harness: str = "raytunix_chat", **task: object) -> vf.Env:
    """The single-seat environment over ``SumTaskset``, its seat played by ``harness`` on
    the local runtime (verifiers' default is a Prime cloud sandbox); ``task`` sets
    ``SumTaskConfig``'s fields."""
    seat = vf.AgentConfig(harness=vf.HarnessConfig(id=harness), runtime=vf.SubprocessConfig())
    taskset = SumTasksetConfig(id="verifiers_example", task=SumTaskConfig(**task))
    return vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset=taskset, agent=seat))


class TwoTurnEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class TwoTurnEnv(vf.Env[TwoTurnEnvConfig]):
    """A multi-turn environment: the agent answers, is asked to check, answers again; the
    task's rewards score the last reply."""

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as chat:
            await chat.turn()  # a prompted task speaks first
            await chat.turn("Check it and answer again.")


def make_two_turn_env() -> vf.Env:
    seat = vf.AgentConfig(
        harness=vf.HarnessConfig(id="raytunix_chat"), runtime=vf.SubprocessConfig()
    )
    taskset = SumTasksetConfig(id="verifiers_example")
    return TwoTurnEnv(TwoTurnEnvConfig(taskset=taskset, agent=seat))


__all__ = ["SumTaskset"]
