"""``raytunix train`` reports a Ray cluster that does not start or cannot be joined as a
one-line error naming what to try, not Ray's traceback (a raylet missing its start-up
deadline on a loaded machine raised a bare ``Exception`` through the CLI)."""

from __future__ import annotations

import pytest
import ray

from raytunix import cli
from raytunix.driver import prepare
from raytunix.driver.run_dir import RunError

TIMEOUT = (
    "The current node timed out during startup. This could happen because some of "
    "the Ray processes failed to startup.\nmore lines"
)


@pytest.fixture
def ray_down(monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    shutdowns = []
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(1))
    return shutdowns


def _raise(error):
    def init(*args, **kwargs):
        raise error

    return init


def test_a_local_cluster_that_times_out_is_a_run_error(monkeypatch, ray_down):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "init", _raise(Exception(TIMEOUT)))
    with pytest.raises(RunError) as e:
        prepare.connect_ray()
    message = str(e.value)
    assert "Ray could not start a local cluster" in message
    assert "timed out during startup" in message and "more lines" not in message
    assert "RAY_raylet_start_wait_time_s=120" in message
    assert ray_down == [1]  # what it had started is shut down


@pytest.mark.parametrize(
    "error",
    [
        ConnectionError("could not connect to 10.0.0.9:6379"),
        RuntimeError("version mismatch"),
        Exception(""),
    ],
)
def test_a_cluster_that_cannot_be_joined_names_the_address(monkeypatch, ray_down, error):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")
    monkeypatch.setattr(prepare, "_check_reachable", lambda address: None)  # something answers
    monkeypatch.setattr(ray, "init", _raise(error))
    with pytest.raises(
        RunError,
        match=r"cannot join the Ray cluster at "
        r"RAY_ADDRESS='10.0.0.9:6379': " + type(error).__name__,
    ):
        prepare.connect_ray()


def test_the_cli_prints_it_on_one_line_and_exits_2(monkeypatch, ray_down, tmp_path, capsys):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ray, "init", _raise(Exception(TIMEOUT)))
    code = cli.main(["train", "learner.rl_steps=1", "warmup.enabled=false"])
    err = capsys.readouterr().err
    assert code == 2
    assert "raytunix: Ray could not start a local cluster" in err
    assert "Traceback" not in err
    # The run directory that had nothing in it is gone with the failed start.
    runs = tmp_path / "runs"
    assert not runs.exists() or not any(runs.iterdir())


@pytest.mark.parametrize("address", ["127.0.0.1:1", "ray://127.0.0.1:1", "nosuchhost.invalid:6379"])
def test_an_address_where_nothing_listens_is_named_before_ray_retries_it(
    monkeypatch, ray_down, address
):
    # Ray retried such an address for over 10 minutes without a word.
    monkeypatch.setenv("RAY_ADDRESS", address)
    monkeypatch.setattr(ray, "init", _raise(AssertionError("ray.init must not be reached")))
    with pytest.raises(
        RunError,
        match=r"cannot join the Ray cluster at RAY_ADDRESS=.*nothing "
        r"answered at",
    ):
        prepare.connect_ray()
