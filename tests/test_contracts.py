"""The contract page (``raytunix.types``) holds: every implementation has every member of
its protocol with the same signature, and the episode loop calls nothing on an agent, an
env or an engine that the protocols (and the loop shown in the docstring) leave out."""

from __future__ import annotations

import ast
import inspect

import pytest

from raytunix import types
from raytunix.agents.base import ConversationAgentBase
from raytunix.inference.engine import InferenceEngine
from raytunix.learner.learner import Learner
from raytunix.rollout import episode
from raytunix.rollout.actor import RayEngineClient
from raytunix.rollout.env_pool import LocalEnv, RemoteEnv


def _members(protocol: type) -> dict[str, object]:
    """Protocol members: methods and properties by value, annotated attributes as None."""
    names = {n for n in vars(protocol) if not n.startswith("_")} | set(protocol.__annotations__)
    return {n: vars(protocol).get(n) for n in names}


def _params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


IMPLEMENTATIONS = [
    (types.EngineClient, InferenceEngine),
    (types.EngineClient, RayEngineClient),
    (types.EnvClient, LocalEnv),
    (types.EnvClient, RemoteEnv),
    (types.Agent, ConversationAgentBase),
    (types.Learner, Learner),
]


@pytest.mark.parametrize(
    "protocol,impl", IMPLEMENTATIONS, ids=[f"{p.__name__}-{i.__name__}" for p, i in IMPLEMENTATIONS]
)
def test_implementation_has_every_protocol_member(protocol, impl):
    for name, spec in _members(protocol).items():
        if spec is None:  # a data attribute: set in __init__ or a property
            source = inspect.getsource(impl)
            assert hasattr(impl, name) or f"self.{name} =" in source or f"self.{name}:" in source, (
                f"{impl.__name__} lacks attribute {name!r} of {protocol.__name__}"
            )
            continue
        assert hasattr(impl, name), f"{impl.__name__} lacks {name!r} of {protocol.__name__}"
        got = inspect.getattr_static(impl, name)
        if isinstance(spec, property):
            assert isinstance(got, property), f"{impl.__name__}.{name} should be a property"
            continue
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(spec), (
            f"{impl.__name__}.{name}: async-ness differs from {protocol.__name__}.{name}"
        )
        assert _params(got)[: len(_params(spec))] == _params(spec), (
            f"{impl.__name__}.{name}{inspect.signature(got)} does not take the parameters of "
            f"{protocol.__name__}.{name}{inspect.signature(spec)}"
        )


def _calls_on(tree: ast.AST, receiver: str) -> set[str]:
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == receiver
    }


def test_episode_loop_uses_only_protocol_members_and_the_docstring_shows_them():
    # The loop is run_episode and the pieces it is made of, all in rollout/episode.py.
    tree = ast.parse(inspect.getsource(episode))
    optional = {"end_session"}  # looked up with getattr: an engine client may lack it
    for receiver, protocol in (
        ("agent", types.Agent),
        ("env", types.EnvClient),
        ("engine", types.EngineClient),
    ):
        used = _calls_on(tree, receiver)
        assert used, f"run_episode no longer calls anything on {receiver!r}"
        unknown = used - set(_members(protocol)) - optional
        assert not unknown, (
            f"run_episode uses {sorted(unknown)} on {receiver}, not in {protocol.__name__}"
        )
        for name in used - {"token_ids", "num_generated_tokens", "turn_finished"}:
            assert f"{receiver}.{name}" in types.__doc__, (
                f"the loop in raytunix.types' docstring does not show {receiver}.{name}"
            )
    end_session = [
        n for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value == "end_session"
    ]
    assert end_session and "end_session" in types.__doc__


def test_protocols_check_instances_at_runtime():
    class Scripted:
        async def generate(self, request):
            return None

    assert isinstance(Scripted(), types.EngineClient)
    assert not isinstance(object(), types.EnvClient)
