"""The gateway's HTTP server: an aiohttp app in front of an ``EngineClient``.

One API key per episode (``Gateway.open_episode``); every answered call of an episode is
recorded (``raytunix.gateway.recorder.RecordedCall``) and handed back by
``close_episode``. The engine is called on the gateway's event loop, so an
``InferenceEngine`` serves the gateway from the loop the gateway runs on (``GatewayThread``
gives it one of its own, for synchronous programs and tests).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from aiohttp import web

from raytunix.gateway import protocol
from raytunix.gateway.protocol import GatewayError
from raytunix.gateway.recorder import RecordedCall, RecordedChoice
from raytunix.gateway.render import AssistantKey, EncoderRenderer, HFRenderer, Reply
from raytunix.types import (
    EngineClient,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass
class _Episode:
    """The gateway's state for one episode (one API key)."""

    episode_id: str
    seed: int
    calls: list[RecordedCall] = dataclasses.field(default_factory=list)
    known: dict[AssistantKey, list[int]] = dataclasses.field(default_factory=dict)
    next_index: int = 0
    session_busy: bool = False
    open: bool = True
    dropped_calls: int = 0  # answered after the episode closed: not recorded

    @property
    def session_id(self) -> str:
        return f"gateway/{self.episode_id}"


def _error_response(error: GatewayError) -> web.Response:
    return web.json_response(error.body(), status=error.status)


def _node_address() -> str:
    """This node's address on the cluster network: Ray's idea of it when Ray is up, else
    the address the host name resolves to."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class Gateway:
    """An OpenAI-compatible endpoint (``GET /v1/models``, ``POST /v1/chat/completions``,
    ``POST /v1/completions``) in front of ``engine``.

    Args:
      engine: anything with ``async generate(GenerationRequest) -> GenerationResult``
        (``InferenceEngine``, ``RayEngineClient``); ``end_session`` is called when an
        episode closes if it has one.
      renderer: ``EncoderRenderer`` or ``HFRenderer`` (``make_renderer``) for the engine's
        tokenizer.
      model_name: the id ``/v1/models`` lists and replies carry (any requested model name
        is accepted: programs are run unchanged).
      host: the interface to bind; loopback by default (the cluster network by config).
      port: TCP port; 0 takes any free one (``port`` holds it after ``start``).
      call_timeout_s: a call's deadline in seconds; past it the call is answered 504 and
        its engine requests are cancelled.
      default_max_tokens: ``max_new_tokens`` of a call that sets no ``max_tokens``.
      max_n: the largest ``n`` accepted.
      max_model_len: longest context in tokens (prompt + completion); default the
        engine's ``max_seq_len`` when it has one. A longer prompt is answered 400.
      vocab_size: token ids a completions prompt may hold are ``[0, vocab_size)``.

    Errors are answered, never raised into the server: 400 (a bad field, named), 401 (an
    unknown or closed key), 404 (an unknown path), 503 (the engine failed), 504 (deadline).
    """

    def __init__(
        self,
        engine: EngineClient,
        renderer: EncoderRenderer | HFRenderer,
        *,
        model_name: str = "raytunix",
        host: str = "127.0.0.1",
        port: int = 0,
        call_timeout_s: float = 300.0,
        default_max_tokens: int = 1024,
        max_n: int = 16,
        max_model_len: int | None = None,
        vocab_size: int | None = None,
    ):
        for name, value in (
            ("call_timeout_s", call_timeout_s),
            ("default_max_tokens", default_max_tokens),
            ("max_n", max_n),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"Gateway: {name} must be a positive number, got {value!r}.")
        self.engine = engine
        self.renderer = renderer
        self.model_name = model_name
        self.host, self.port = host, port
        self.call_timeout_s = float(call_timeout_s)
        self.default_max_tokens = int(default_max_tokens)
        self.max_n = int(max_n)
        self.max_model_len = (
            max_model_len if max_model_len is not None else getattr(engine, "max_seq_len", None)
        )
        self.vocab_size = vocab_size
        self._episodes: dict[str, _Episode] = {}
        self._closed_keys: set[str] = set()
        self._lock = threading.Lock()
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> str:
        """Binds and serves on the running event loop; returns the root URL
        (``http://host:port``).

        Raises:
          OSError: the address cannot be bound.
        """
        app = web.Application(middlewares=[self._errors], client_max_size=64 * 2**20)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        if self.port == 0:  # the port the system picked
            self.port = int(self._runner.addresses[0][1])
        self._loop = asyncio.get_running_loop()
        return self.url

    async def stop(self) -> None:
        """Stops serving (the engine is the caller's, and stays up). Idempotent."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server; a wildcard ``host`` (``0.0.0.0``,
        ``::``) is given as this node's address, which programs on other nodes can reach."""
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = _node_address()
        if ":" in host:  # IPv6 literal
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    # -- episodes --------------------------------------------------------------------------

    def open_episode(
        self, episode_id: str | None = None, seed: int | None = None
    ) -> tuple[str, str]:
        """Starts recording an episode; returns ``(base_url, api_key)`` for its program
        (``base_url`` ends in ``/v1``, as ``openai.OpenAI(base_url=...)`` takes it).
        Safe to call from any thread.

        Args:
          episode_id: names its engine requests and session; default a fresh id.
          seed: base of the per-request seeds of calls that set none (each request gets
            its own); default random.

        Raises:
          ValueError: ``episode_id`` is already open.
          RuntimeError: the server has not been started (``start``).
        """
        if self._runner is None:
            raise RuntimeError(
                "Gateway.open_episode: the server is not running; await "
                "Gateway.start() (or use GatewayThread) first."
            )
        episode_id = episode_id or uuid.uuid4().hex[:12]
        key = "rtx-" + secrets.token_urlsafe(24)
        with self._lock:
            if any(e.episode_id == episode_id for e in self._episodes.values()):
                raise ValueError(
                    f"episode {episode_id!r} is already open; close it first or use another id."
                )
            self._episodes[key] = _Episode(
                episode_id=episode_id, seed=secrets.randbits(62) if seed is None else int(seed)
            )
        return f"{self.url}/v1", key

    def close_episode(self, api_key: str) -> list[RecordedCall]:
        """Ends an episode: its key is refused from now on (401), its engine session is
        ended, and its recorded calls are returned in the order they arrived. A call
        still in flight is answered 401 and not recorded. Safe to call from any thread.

        Raises:
          KeyError: ``api_key`` is not an open episode's key.
        """
        with self._lock:
            episode = self._episodes.pop(api_key, None)
            if episode is None:
                raise KeyError(f"{api_key[:8]}... is not the key of an open episode.")
            episode.open = False
            self._closed_keys.add(api_key)
        end_session = getattr(self.engine, "end_session", None)
        if end_session is not None:
            self._on_loop(end_session, episode.session_id)
        return sorted(episode.calls, key=lambda c: c.index)

    def recorded_calls(self, api_key: str) -> list[RecordedCall]:
        """The calls an open episode has recorded so far (a copy).

        Raises:
          KeyError: ``api_key`` is not an open episode's key.
        """
        with self._lock:
            return sorted(self._episodes[api_key].calls, key=lambda c: c.index)

    def _on_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        """Runs ``fn(*args)`` on the gateway's loop (the engine is not thread-safe)."""
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or running is loop or loop.is_closed():
            fn(*args)
        else:
            loop.call_soon_threadsafe(fn, *args)

    def _episode(self, request: web.Request) -> _Episode:
        header = request.headers.get("Authorization", "")
        key = header[7:].strip() if header.lower().startswith("bearer ") else ""
        with self._lock:
            episode = self._episodes.get(key)
            closed = key in self._closed_keys
        if episode is None:
            reason = "belongs to an episode that has ended" if closed else "is not known"
            raise GatewayError(
                401,
                f"API key {key[:8]!r}... {reason}; use the key of an open "
                "episode (Gateway.open_episode).",
                code="invalid_api_key",
                kind="authentication_error",
            )
        return episode

    # -- handlers --------------------------------------------------------------------------

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except GatewayError as e:
            return _error_response(e)
        except web.HTTPException as e:
            return _error_response(
                GatewayError(
                    e.status, f"{request.method} {request.path}: {e.reason}", code=str(e.status)
                )
            )
        except Exception as e:  # noqa: BLE001 - one bad call must never take the server down
            logger.exception("gateway: %s %s failed", request.method, request.path)
            return _error_response(GatewayError(500, f"internal error: {e!r}", kind="server_error"))

    async def _models(self, request: web.Request) -> web.Response:
        self._episode(request)
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "raytunix",
                        "max_model_len": self.max_model_len,
                    }
                ],
            }
        )

    async def _body(self, request: web.Request) -> Any:
        try:
            return await request.json(loads=json.loads)
        except (ValueError, UnicodeDecodeError) as e:
            raise protocol.bad_request("body", f"is not valid JSON ({e}).") from None
        except RecursionError:
            raise protocol.bad_request(
                "body", "nests deeper than the JSON parser allows; send a flatter body."
            ) from None

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        episode = self._episode(request)
        call = protocol.parse_chat(await self._body(request), self.max_n)
        self._check_length_before_rendering(
            sum(
                len(m.content) + sum(len(c.name) + len(c.arguments) for c in m.tool_calls)
                for m in call.messages
            ),
            "messages",
        )
        started = time.time()
        prompt = self.renderer.chat_prompt(call.messages, call.tools, episode.known)
        forced = self.renderer.forced_prefix(call.tool_choice)
        index, results = await self._generate(episode, prompt + forced, call.sampling)
        replies = [
            self.renderer.reply(
                forced,
                r.token_ids,
                r.finish_reason,
                call.sampling.stop,
                parse_tools=call.tool_choice != "none",
            )
            for r in results
        ]
        readable = (
            tuple({"role": m.role, "content": m.content} for m in call.messages),
            [(reply.text, len(reply.tool_calls)) for reply in replies],
        )
        self._record(
            episode, index, "chat.completions", prompt + forced, results, started, readable
        )
        for reply, result in zip(replies, results):
            # A reply cut at max_tokens that the program keeps in its history is closed
            # as the template closes any message, so its next call still extends these ids.
            closing = self.renderer.close_turn(
                result.token_ids, result.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            )
            if closing is not None:
                episode.known[reply.key] = [*forced, *result.token_ids, *closing]
        response = _ChatResponse(self, episode, index, call, prompt + forced, results, replies)
        if call.sampling.stream:
            return await response.stream(request)
        return web.json_response(response.body())

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        episode = self._episode(request)
        call = protocol.parse_completion(await self._body(request), self.max_n, self.vocab_size)
        if call.sampling.stream:
            raise protocol.bad_request(
                "stream", "is supported on /v1/chat/completions only; send false here."
            )
        choices: list[dict[str, Any]] = []
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        for prompt in call.prompts:
            started = time.time()
            if isinstance(prompt, str):
                self._check_length_before_rendering(len(prompt), "prompt")
            ids = self.renderer.encode_text(prompt) if isinstance(prompt, str) else list(prompt)
            index, results = await self._generate(episode, ids, call.sampling)
            replies = [
                self.renderer.reply(
                    [], r.token_ids, r.finish_reason, call.sampling.stop, parse_tools=False
                )
                for r in results
            ]
            asked = ({"role": "user", "content": prompt},) if isinstance(prompt, str) else ()
            readable = (asked, [(reply.text, 0) for reply in replies])
            self._record(episode, index, "completions", ids, results, started, readable)
            usage["prompt_tokens"] += len(ids)
            for result, reply in zip(results, replies):
                choices.append(
                    _completion_choice(self.renderer, len(choices), result, reply, call.logprobs)
                )
                usage["completion_tokens"] += len(result.token_ids)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return web.json_response(
            {
                "id": f"cmpl-{episode.episode_id}-{index}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": usage,
            }
        )

    # -- the engine ------------------------------------------------------------------------

    def _check_length_before_rendering(self, chars: int, param: str) -> None:
        """A 400 for text too long for the context whatever it encodes to (at least
        ``chars / max_token_chars`` tokens): a multi-megabyte message is refused in
        microseconds instead of after rendering and encoding it."""
        if self.max_model_len is None:
            return
        at_least = chars // self.renderer.max_token_chars()
        if at_least > self.max_model_len - 1:
            raise GatewayError(
                400,
                f"the {param} hold {chars} characters, at least {at_least} tokens, but the "
                f"model's context is {self.max_model_len} tokens; shorten the conversation.",
                param=param,
                code="context_length_exceeded",
            )

    def _sampling(self, prompt_len: int, sampling: protocol.Sampling) -> SamplingParams:
        if self.max_model_len is not None and prompt_len > self.max_model_len - 1:
            raise GatewayError(
                400,
                f"the prompt has {prompt_len} tokens but the model's context "
                f"is {self.max_model_len} tokens; shorten the conversation.",
                param="messages",
                code="context_length_exceeded",
            )
        return SamplingParams(
            max_new_tokens=sampling.max_tokens or self.default_max_tokens,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            stop_token_ids=self.renderer.stop_token_ids,
            stop_strings=sampling.stop,
        )

    async def _generate(
        self, episode: _Episode, prompt: Sequence[int], sampling: protocol.Sampling
    ) -> tuple[int, list[GenerationResult]]:
        """``(the call's index in the episode, the engine's results)`` for ``sampling.n``
        samples of ``prompt``; the first uses the episode's session when no other call of
        the episode holds it.

        Raises:
          GatewayError: 400 (the engine refused the request), 503 (it failed or aborted),
            504 (the call's deadline passed).
        """
        params = self._sampling(len(prompt), sampling)
        index = episode.next_index
        episode.next_index += 1
        use_session = not episode.session_busy
        base = episode.seed if sampling.seed is None else sampling.seed
        requests = [
            GenerationRequest(
                request_id=f"{episode.episode_id}/{index}/{j}",
                prompt_ids=tuple(prompt),
                sampling=params,
                seed=_request_seed(base, index if sampling.seed is None else 0, j),
                session_id=episode.session_id if use_session and j == 0 else None,
            )
            for j in range(sampling.n)
        ]
        tasks = [asyncio.ensure_future(self.engine.generate(r)) for r in requests]
        episode.session_busy = episode.session_busy or use_session
        try:
            async with asyncio.timeout(self.call_timeout_s):
                results = list(await asyncio.gather(*tasks))
        except TimeoutError:
            raise GatewayError(
                504,
                f"the call did not finish within its deadline of {self.call_timeout_s:g} s.",
                kind="timeout",
                code="timeout",
            ) from None
        except ValueError as e:
            raise GatewayError(
                400, f"the engine refused the request: {e}", code="invalid_request"
            ) from None
        except Exception as e:  # noqa: BLE001 - any engine failure is answered, not raised
            raise GatewayError(
                503,
                f"the engine failed: {e!r}; retry the call.",
                kind="server_error",
                code="engine_unavailable",
            ) from None
        finally:
            for task in tasks:
                task.cancel()
            if use_session:
                episode.session_busy = False
        if any(r.finish_reason == FinishReason.ABORT for r in results):
            raise GatewayError(
                503,
                "the engine aborted the call (paused or stopping); retry it.",
                kind="server_error",
                code="engine_unavailable",
            )
        return index, results

    def _record(
        self,
        episode: _Episode,
        index: int,
        endpoint: str,
        prompt: Sequence[int],
        results: Sequence[GenerationResult],
        started: float,
        readable: tuple[tuple[dict[str, str], ...], Sequence[tuple[str, int]]],
    ) -> None:
        """Appends the call to the episode; ``readable`` is ``(the request's messages, each
        choice's (reply text, tool calls parsed))``, the text kept for people to read
        (``RecordedCall.messages``)."""
        messages, replies = readable
        call = RecordedCall(
            index=index,
            endpoint=endpoint,
            prompt_ids=tuple(prompt),
            choices=tuple(
                RecordedChoice(
                    token_ids=tuple(r.token_ids),
                    logprobs=tuple(r.logprobs),
                    policy_versions=tuple(r.policy_versions),
                    finish_reason=r.finish_reason.value,
                    request_id=r.request_id,
                    num_cached_tokens=r.num_cached_tokens,
                    text=text,
                    tool_calls=tool_calls,
                )
                for r, (text, tool_calls) in zip(results, replies)
            ),
            started_s=started,
            duration_s=time.time() - started,
            messages=messages,
        )
        with self._lock:
            if not episode.open:
                episode.dropped_calls += 1
                raise GatewayError(
                    401,
                    "the episode ended while this call ran; it was not recorded.",
                    code="invalid_api_key",
                    kind="authentication_error",
                )
            episode.calls.append(call)


def _request_seed(base: int, index: int, choice: int) -> int:
    """A distinct seed per (call, choice): samples of one call must differ."""
    return (base * 1_000_003 + index * 1_009 + choice) % (1 << 63)


def _token_logprobs(
    renderer: EncoderRenderer | HFRenderer, result: GenerationResult
) -> list[dict[str, Any]]:
    entries = []
    for token, logprob in zip(result.token_ids, result.logprobs):
        text = renderer.decode([token])
        entries.append(
            {
                "token": text,
                "logprob": float(logprob),
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [],
            }
        )
    return entries


def _completion_choice(
    renderer: EncoderRenderer | HFRenderer,
    index: int,
    result: GenerationResult,
    reply: Reply,
    logprobs: bool,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "text": reply.content or "",
        "finish_reason": reply.finish_reason,
        "logprobs": None,
    }
    if logprobs:
        entries = _token_logprobs(renderer, result)
        choice["logprobs"] = {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": None,
            "text_offset": None,
        }
    return choice


class _ChatResponse:
    """One chat call's answer, as a JSON body or as server-sent events."""

    def __init__(
        self,
        gateway: Gateway,
        episode: _Episode,
        index: int,
        call: protocol.ChatCall,
        prompt: Sequence[int],
        results: Sequence[GenerationResult],
        replies: Sequence[Reply],
    ):
        self.gateway, self.call, self.results, self.replies = gateway, call, results, replies
        self.id = f"chatcmpl-{episode.episode_id}-{index}"
        self.created = int(time.time())
        self.tool_call_ids = [
            [f"call_{episode.episode_id}_{index}_{j}_{k}" for k in range(len(r.tool_calls))]
            for j, r in enumerate(replies)
        ]
        completion = sum(len(r.token_ids) for r in results)
        self.usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": completion,
            "total_tokens": len(prompt) + completion,
        }

    def _tool_calls(self, j: int, streamed: bool) -> list[dict[str, Any]]:
        return [
            {
                **({"index": k} if streamed else {}),
                "id": self.tool_call_ids[j][k],
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            for k, (name, arguments) in enumerate(self.replies[j].tool_calls)
        ]

    def _logprobs(self, j: int) -> dict[str, Any] | None:
        if not self.call.logprobs:
            return None
        return {"content": _token_logprobs(self.gateway.renderer, self.results[j])}

    def body(self) -> dict[str, Any]:
        choices = []
        for j, reply in enumerate(self.replies):
            message: dict[str, Any] = {"role": "assistant", "content": reply.content}
            if reply.tool_calls:
                message["tool_calls"] = self._tool_calls(j, streamed=False)
            choices.append(
                {
                    "index": j,
                    "message": message,
                    "logprobs": self._logprobs(j),
                    "finish_reason": reply.finish_reason,
                }
            )
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.gateway.model_name,
            "choices": choices,
            "usage": self.usage,
        }

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.gateway.model_name,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events in OpenAI's chunk format: per choice a role chunk, content
        pieces along token boundaries, its tool calls, a finish chunk; the usage chunk when
        ``stream_options.include_usage``; then ``data: [DONE]``. (The engine returns whole
        completions, so the events follow the finished generation.)"""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        for j, (reply, result) in enumerate(zip(self.replies, self.results)):
            await response.write(
                self._chunk(
                    [
                        {
                            "index": j,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            )
            for piece in _pieces(self.gateway.renderer, result.token_ids, reply.content or ""):
                await response.write(
                    self._chunk(
                        [
                            {
                                "index": j,
                                "delta": {"content": piece},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
                )
            if reply.tool_calls:
                await response.write(
                    self._chunk(
                        [
                            {
                                "index": j,
                                "delta": {"tool_calls": self._tool_calls(j, streamed=True)},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
                )
            await response.write(
                self._chunk(
                    [
                        {
                            "index": j,
                            "delta": {},
                            "logprobs": self._logprobs(j),
                            "finish_reason": reply.finish_reason,
                        }
                    ]
                )
            )
        if self.call.sampling.include_usage:
            await response.write(self._chunk([], self.usage))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _pieces(renderer: EncoderRenderer | HFRenderer, ids: Sequence[int], content: str) -> list[str]:
    """``content`` cut where the decoded prefixes of ``ids`` end (a piece per few tokens),
    joined back exactly; what the ids do not spell in order comes as one last piece."""
    pieces, emitted = [], 0
    stride = max(1, len(ids) // 64)
    for k in range(stride, len(ids) + 1, stride):
        text = renderer.decode(ids[:k])
        if not content.startswith(text.rstrip("\ufffd")):
            break
        if len(text) > emitted and not text.endswith("\ufffd"):
            pieces.append(content[emitted : len(text)])
            emitted = len(text)
    if emitted < len(content):
        pieces.append(content[emitted:])
    return pieces


class GatewayThread:
    """Runs a ``Gateway`` on its own event loop in a daemon thread, so that synchronous
    programs (``openai.OpenAI``) and tests can call it; the engine is served from that loop.

    Usage::

        thread = GatewayThread(Gateway(engine, make_renderer(tokenizer)))
        base_url, key = thread.gateway.open_episode()
        ...  # openai.OpenAI(base_url=base_url, api_key=key)
        calls = thread.gateway.close_episode(key)
        thread.stop()

    Raises:
      OSError: the server could not bind (raised by the constructor).
    """

    def __init__(self, gateway: Gateway, start_timeout_s: float = 60.0):
        self.gateway = gateway
        self.loop = asyncio.new_event_loop()
        started: threading.Event = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(gateway.start())
            except BaseException as e:  # noqa: BLE001 - handed to the constructor's caller
                failure.append(e)
                started.set()
                return
            started.set()
            self.loop.run_forever()
            self.loop.run_until_complete(gateway.stop())
            self.loop.close()

        self._thread = threading.Thread(target=main, name="raytunix-gateway", daemon=True)
        self._thread.start()
        if not started.wait(start_timeout_s):
            raise TimeoutError(f"the gateway did not start within {start_timeout_s:g} s.")
        if failure:
            raise failure[0]

    def run(self, coroutine: Awaitable[T], timeout_s: float | None = None) -> T:
        """Runs ``coroutine`` on the gateway's loop (e.g. ``engine.pause()``) and returns
        its result."""

        async def wrapped() -> T:
            return await coroutine

        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stops the server and the loop; idempotent."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
