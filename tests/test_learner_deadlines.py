"""Every call to the learner has a deadline, and the hosts of a learner group restore the
same checkpoint: a multi-host run's group is built with the configured finite timeouts, a
learner that is alive but stuck is killed and named instead of hanging the driver, and a
group restores only a step every host can read, and stops when its hosts disagree."""

import dataclasses
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402
import ray  # noqa: E402
from test_train import TINY  # noqa: E402 - the tiny run of tests/test_train.py

from raytunix.config import ConfigError, load_config  # noqa: E402
from raytunix.learner.group import (  # noqa: E402
    LearnerGroup,
    LearnerStateDivergence,
    check_same_restore,
    common_steps,
)
from raytunix.models.tokenizer import Tokenizer  # noqa: E402


class _Recorder:
    """Stands in for ``ray.remote(cls)`` while a ``Job`` is built without a cluster:
    records the class and the arguments its actor would get."""

    calls: list = []

    def __init__(self, cls):
        self.cls = cls

    def options(self, **opts):
        return self

    def remote(self, *args, **kwargs):
        _Recorder.calls.append((self.cls, args, kwargs))
        return object()


def test_a_multi_host_run_builds_its_group_with_the_configured_deadlines(monkeypatch):
    import raytunix.driver.job as job_module

    cfg = load_config(
        None,
        [
            "learner.num_hosts=2",
            "engine.placement=disaggregated",
            "learner.call_timeout_s=90",
            "learner.slow_call_timeout_s=900",
        ],
    )
    _Recorder.calls = []
    monkeypatch.setattr(job_module.ray, "remote", _Recorder)
    job_module.Job(cfg, Tokenizer.byte_level(), [], env_pool=None)
    (kwargs,) = [kw for cls, _, kw in _Recorder.calls if cls is LearnerGroup]
    assert kwargs["call_timeout_s"] == 90.0 and kwargs["slow_call_timeout_s"] == 900.0


def test_the_deadlines_are_finite_and_ordered():
    defaults = load_config(None, [])
    assert 0 < defaults.learner.call_timeout_s <= defaults.learner.slow_call_timeout_s < 1e5
    with pytest.raises(ConfigError, match=r"learner.call_timeout_s=inf must be a finite"):
        load_config(None, ["learner.call_timeout_s=inf"])
    with pytest.raises(ConfigError, match=r"slow_call_timeout_s=60.0 is below"):
        load_config(None, ["learner.slow_call_timeout_s=60"])
    with pytest.raises(ValueError, match="call_timeout_s must be a finite"):
        LearnerGroup(None, None, 0, 0, call_timeout_s=float("inf"))  # refused before any start


@pytest.mark.slow
def test_a_stuck_single_learner_is_killed_and_named_instead_of_hanging_the_driver(
    ray_session, tmp_path
):
    from raytunix.driver.job import Job, LearnerStuck
    from raytunix.driver.run_dir import RunError

    cfg = load_config(None, TINY)
    job = Job(cfg, Tokenizer.byte_level(), [], env_pool=None)
    started = tmp_path / "blocked"

    def block(self, marker=str(started)):
        open(marker, "w").close()
        time.sleep(600)

    try:
        assert job.learner_get(job.learner.policy_version.remote(), "policy_version") == 0
        cfg.learner.call_timeout_s = 3.0  # once built: building it may take longer here
        # Alive but stuck: its event loop blocked (as a wedged device or storage call would).
        # An async actor may start calls out of submission order: wait until the block runs.
        job.learner.__ray_call__.remote(block)
        deadline = time.monotonic() + 120
        while not started.exists():
            assert time.monotonic() < deadline, "the blocking call never started"
            time.sleep(0.05)
        with pytest.raises(
            LearnerStuck,
            match=r"did not answer train_step within 3 s "
            r"\(learner.call_timeout_s=3.0\).*killed",
        ) as e:
            job.learner_get(job.learner.policy_version.remote(), "train_step")
        assert isinstance(e.value, RunError)  # the CLI reports it and exits; no traceback
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(job.learner.policy_version.remote(), timeout=60)
    finally:
        ray.kill(job.learner)


def test_a_group_restores_only_a_step_every_host_lists():
    hosts = ["host 0 (10.0.0.1)", "host 1 (10.0.0.2)"]
    # A shared filesystem that shows host 1 step 20 late: both restore 10.
    assert common_steps([[10, 20], [10]], hosts) == [10]
    assert common_steps([[0, 10, 20], [0, 10, 20]], hosts) == [0, 10, 20]
    with pytest.raises(FileNotFoundError):  # nothing saved yet: a rebuild starts fresh
        common_steps([[], []], hosts)
    # A directory that is local to each host: no step on both.
    with pytest.raises(
        LearnerStateDivergence, match=r"host 0 \(10.0.0.1\): \[10, 20\]; host 1 \(10.0.0.2\): none"
    ):
        common_steps([[10, 20], []], hosts)


def test_hosts_that_restored_different_checkpoints_stop_the_run_naming_each():
    hosts = ["host 0 (10.0.0.1)", "host 1 (10.0.0.2)"]

    def extras(step, position):
        return {"rl_step": step, "policy_version": step, "orchestrator": {"next_index": position}}

    check_same_restore([extras(20, 80), extras(20, 80)], hosts)
    with pytest.raises(
        LearnerStateDivergence,
        match=r"host 0 \(10.0.0.1\): step 20, policy version 20, data position "
        r"80; host 1 \(10.0.0.2\): step 10, policy version 10, data "
        r"position 40",
    ):
        check_same_restore([extras(20, 80), extras(10, 40)], hosts)
    # Same step, another data position (a copy of the directory written by another run).
    with pytest.raises(LearnerStateDivergence, match="data position 81"):
        check_same_restore([extras(20, 80), extras(20, 81)], hosts)
    with pytest.raises(LearnerStateDivergence, match="host 1 .*: no checkpoint"):
        check_same_restore([extras(20, 80), None], hosts)


@pytest.mark.slow
def test_a_host_restores_only_the_steps_it_is_given(ray_session, tmp_path):
    """The host call the group makes (``LearnerActor.restore(among=...)``) on a real
    learner actor: with steps 1 and 2 on disk and ``among=[1]``, step 1 is restored."""
    from raytunix.learner.actor import LearnerActor
    from raytunix.learner.learner import RLHyperparams
    from raytunix.models.llama import ModelConfig
    from test_learner_group import CONFIG_KW

    config = ModelConfig(**CONFIG_KW)
    hp = RLHyperparams(temperature=1.0, top_k=0, top_p=1.0, rl_steps=4, learning_rate=1e-2)
    actor = ray.remote(LearnerActor).remote(config, 3, 0)
    try:
        from test_checkpoints import _record_batch

        directory = str(tmp_path / "ckpt")
        ray.get(actor.start_rl.remote(hp))
        for step in range(2):
            ray.get(actor.train_step.remote([ray.put(_record_batch(step))]))
            ray.get(actor.save.remote(directory, {"orchestrator": {"next_index": 4 * (step + 1)}}))
        ray.get(actor.finish_checkpoints.remote())
        assert ray.get(actor.checkpoint_steps.remote(directory)) == [1, 2]
        extras = ray.get(actor.restore.remote(directory, among=[1]))
        assert extras["rl_step"] == 1 and extras["orchestrator"]["next_index"] == 4
        assert ray.get(actor.policy_version.remote()) == 1
    finally:
        ray.kill(actor)


def test_the_learner_config_keys_are_documented():
    from raytunix.config import LearnerConfig

    names = {f.name for f in dataclasses.fields(LearnerConfig)}
    assert {"call_timeout_s", "slow_call_timeout_s"} <= names
    readme = open(os.path.join(os.path.dirname(__file__), os.pardir, "README.md")).read()
    assert "learner.call_timeout_s" in readme and "learner.slow_call_timeout_s" in readme
