"""``raytunix_chat``: a verifiers 0.4 harness that plays a seat in this process.

verifiers' own chat harnesses (``null``, ``bash``) run a PEP 723 script that ``uv``
provisions from the network, so they cannot run offline or on a host without ``uv``. This
one makes the same kind of calls from Python: one chat completion per turn against the
rollout's interception endpoint (which verifiers relays to the run's gateway), with the
task's system prompt and prompt (text or messages), and the whole conversation again when
the environment resumes it (``SUPPORTS_RESUME``: multi-turn envs such as a simulated user).
It exposes no tools of its own (no MCP), and runs no code.

Importing ``raytunix.envs.verifiers_env`` makes the id ``raytunix_chat`` resolvable by
verifiers' plugin loader (which imports a harness by its top-level module name), so a seat
pins it as ``{"agent": {"harness": {"id": "raytunix_chat"}}}``.
"""

from __future__ import annotations

from typing import Any

import openai
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

HARNESS_ID = "raytunix_chat"


class RaytunixChatHarness(vf.Harness[vf.HarnessConfig]):
    """One chat completion per turn through the rollout's endpoint (see the module
    docstring); the reply is the program's stdout."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
        tool_interception_url: str | None = None,
    ) -> vf.ProgramResult:
        """Sends the task's conversation once and returns the reply as stdout.

        Raises:
          openai.APIError: the endpoint refused or failed the call (verifiers records it
            on the trace and the episode fails).
        """
        system, prompt = self.resolve_prompt(data)
        messages: list[Any] = []
        if system:
            messages.append({"role": "system", "content": system})
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages += [message_to_wire(m) for m in prompt]
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
        finally:
            await client.close()
        return vf.ProgramResult(
            exit_code=0, stdout=reply.choices[0].message.content or "", stderr=""
        )


__all__ = ["RaytunixChatHarness"]
