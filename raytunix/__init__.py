"""raytunix: reinforcement learning for LLM agents that act in environments and call tools,
on Ray (actors for environments, rollouts and the learner) and JAX (model and updates)."""

__version__ = "0.1.0"
