"""One tiny run, trained once per test session and read by many tests (the ``tiny_run``
fixture of conftest.py): a run's directory is what ``raytunix eval``, ``raytunix
samples``, ``model.init_from`` and the metrics checks read, and each train costs half a
minute on 2 cores.

The run (``OVERRIDES``): tests/test_train.py's TINY on test_byo_env's ParityEnv (0..50,
one turn), a warm start of 20 steps from a demonstrations file (``write_demonstrations``:
36 answers, each after a system message, and one reply the answer agent cannot parse), 5
RL steps of 2 groups of 2, a checkpoint after each, 8 held-out tasks evaluated before RL,
after steps 2 and 4 (``eval.every=2``) and after RL, and every episode of each step in
samples.jsonl (``run.samples_per_step=4``). The tests that check these numbers say them
by hand.

The directory is shared: a test that writes into a run copies it first
(``shutil.copytree``). Under pytest-xdist the workers share one run too: the first to
ask trains it while the others wait on a file lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import traceback

DEMONSTRATIONS = "parity-demonstrations.jsonl"


def overrides(directory: str) -> list[str]:
    """The run's ``section.key=value`` settings, its output and warm-start file in
    ``directory``."""
    from test_train import TINY

    return TINY + [
        f"run.output_dir={os.path.join(directory, 'runs')}",
        "env.name=test_byo_env:ParityEnv",
        "env.kwargs.max_number=50",
        "env.max_turns=1",
        f"warmup.demonstrations={os.path.join(directory, DEMONSTRATIONS)}",
        "data.heldout_size=8",
        "eval.heldout_size=8",
        "eval.max_new_tokens=16",
        "eval.every=2",  # due after steps 2 and 4; step 5's is the after_rl one
        "learner.rl_steps=5",
        "run.samples_per_step=4",  # the whole batch (2 groups of 2): checkable against it
    ]


def write_demonstrations(path: str) -> None:
    """36 parity questions answered right, each after a system message (which the agent's
    own system prompt replaces), and a 37th whose reply has no ``<answer>`` tag."""
    rows = [
        [
            {"role": "system", "content": "Parity."},
            {"role": "user", "content": f"Is {n} even or odd? Reply even or odd."},
            {"role": "assistant", "content": f"<answer>{('even', 'odd')[n % 2]}</answer>"},
        ]
        for n in range(36)
    ]
    rows.append([rows[9][1], {"role": "assistant", "content": "odd"}])
    with open(path, "w") as f:
        f.writelines(json.dumps({"messages": messages}) + "\n" for messages in rows)


@dataclasses.dataclass(frozen=True)
class TinyRun:
    """A finished tiny run (see the module docstring)."""

    path: str  # the run directory; copy it before writing into it
    stdout: str  # what the driver printed
    demonstrations: str  # the warm start's file


def trained(directory: str) -> TinyRun:
    """The run under ``directory``: trained there by the first caller, read back by the
    others (one at a time: the caller holds a lock). A run that failed fails its readers
    with the same error rather than training again."""
    done, failed = os.path.join(directory, "done.json"), os.path.join(directory, "failed.txt")
    if not os.path.exists(done) and not os.path.exists(failed):
        _train(directory, done, failed)
    if os.path.exists(failed):
        with open(failed) as f:
            raise RuntimeError(f"the shared tiny run failed:\n{f.read()}")
    with open(done) as f:
        return TinyRun(**json.load(f))


def _train(directory: str, done: str, failed: str) -> None:
    from raytunix.config import load_config
    from raytunix.train import train

    os.makedirs(directory, exist_ok=True)
    demonstrations = os.path.join(directory, DEMONSTRATIONS)
    write_demonstrations(demonstrations)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            summary = train(load_config(None, overrides(directory)))
    except Exception:  # noqa: BLE001 - trained() raises it, with the driver's last lines
        with open(failed, "w") as f:
            f.write(out.getvalue()[-5000:] + traceback.format_exc())
        return
    run = TinyRun(summary["run_dir"], out.getvalue(), demonstrations)
    with open(done, "w") as f:
        json.dump(dataclasses.asdict(run), f)
