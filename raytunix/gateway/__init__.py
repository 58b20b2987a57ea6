"""An OpenAI-compatible gateway in front of the inference engine, recording exact tokens.

An agent program written against the OpenAI client runs unchanged: it gets a base URL and
an API key for its episode, and every call it makes is answered by the engine and recorded
as the exact token ids the engine was given and generated. Start it on the loop the
engine serves from, or in a thread of its own::

    from raytunix.gateway import Gateway, GatewayThread, make_renderer

    gateway = Gateway(engine, make_renderer(tokenizer), host="127.0.0.1", port=0)
    thread = GatewayThread(gateway)            # or: await gateway.start() on the engine's loop
    base_url, api_key = gateway.open_episode(episode_id="task-7/0")
    client = openai.OpenAI(base_url=base_url, api_key=api_key)
    client.chat.completions.create(model="raytunix", messages=[...], tools=[...])
    calls = gateway.close_episode(api_key)     # the key is refused (401) from now on
    trajectories = episode_trajectories(calls, "task-7", "0", reward, "completed")

Served: ``GET /v1/models``, ``POST /v1/chat/completions`` (tools and ``tool_choice``,
``n``, ``temperature``, ``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``stop``,
``logprobs``, ``seed``, ``stream``) and ``POST /v1/completions`` (a prompt as text or
token ids). Bound to loopback unless ``host`` says otherwise; one key per episode. Bad
input is answered 400 naming the field, an unknown or closed key 401, an engine failure
503, a call past its deadline (``call_timeout_s``) 504; the server keeps serving.

Recorded per call (``RecordedCall``): the prompt ids as sent to the engine; per choice the
completion ids, logprobs (nats) and policy versions as the engine returned them. The calls
of one episode share one engine session, so a turn prefills only its new tokens.
``segment_calls`` turns an episode's calls into segments by a documented rule (a call
whose prompt extends the previous segment's tokens continues it; any other starts a new
one), and ``segment_to_trajectory`` / ``episode_trajectories`` make them ``Trajectory``
objects; text is never re-tokenized.

Prompts are rendered as raytunix agents render them (``EncoderRenderer``: the chat
template's pieces, tool schemas where ``ToolAgent`` puts them, the model's own replies put
back as the ids it generated), or with a Hugging Face tokenizer's ``apply_chat_template``
(``HFRenderer``); replies are parsed by the configured tool-call parser into OpenAI
``tool_calls``. Nothing here imports JAX or Ray.
"""

from raytunix.gateway.protocol import GatewayError
from raytunix.gateway.recorder import (
    EXTEND_RULES,
    RecordedCall,
    RecordedChoice,
    Segment,
    episode_trajectories,
    segment_calls,
    segment_to_trajectory,
)
from raytunix.gateway.render import EncoderRenderer, HFRenderer, make_renderer
from raytunix.gateway.server import Gateway, GatewayThread

__all__ = [
    "EXTEND_RULES",
    "EncoderRenderer",
    "Gateway",
    "GatewayError",
    "GatewayThread",
    "HFRenderer",
    "RecordedCall",
    "RecordedChoice",
    "Segment",
    "episode_trajectories",
    "make_renderer",
    "segment_calls",
    "segment_to_trajectory",
]
