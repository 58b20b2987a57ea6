"""Which engine replica serves a request: least loaded, with session affinity.

Plain Python, no Ray and no JAX, so that the rollout orchestrator (which runs without JAX)
can route its own requests without an extra actor hop::

    router = EngineRouter(num_replicas=2)
    replica = router.acquire(request)      # index of the replica to call
    ...                                    # await replicas[replica].generate(request)
    router.release(request)                # the call returned, failed or was cancelled
    router.end_session(session_id)         # -> the replica holding the session, or None

A session's turns go to the replica that holds its KV cache, as long as the session is
known; a request without a session, or a session's first request, goes to the replica
with the fewest requests in flight (ties: the lowest index).
"""

from __future__ import annotations

from raytunix.types import GenerationRequest


class EngineRouter:
    """Routing state for ``num_replicas`` engine replicas (see module docstring).

    Raises:
      ValueError: ``num_replicas`` is not a positive int.
    """

    def __init__(self, num_replicas: int):
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(
                f"EngineRouter: num_replicas must be a positive int, got {num_replicas!r}."
            )
        self._in_flight = [0] * num_replicas
        self._sessions: dict[str, int] = {}
        self._requests: dict[str, int] = {}

    @property
    def in_flight(self) -> tuple[int, ...]:
        """Requests in flight per replica."""
        return tuple(self._in_flight)

    def acquire(self, request: GenerationRequest) -> int:
        """Chooses the replica for ``request`` and counts it as in flight there.

        Raises:
          ValueError: a request with the same id is already in flight.
        """
        if request.request_id in self._requests:
            raise ValueError(
                f"EngineRouter: request id {request.request_id!r} is already in "
                "flight; request ids must be unique among requests in flight."
            )
        session_id = getattr(request, "session_id", None)
        replica = self._sessions.get(session_id) if session_id is not None else None
        if replica is None:
            replica = min(range(len(self._in_flight)), key=self._in_flight.__getitem__)
            if session_id is not None:
                self._sessions[session_id] = replica
        self._in_flight[replica] += 1
        self._requests[request.request_id] = replica
        return replica

    def release(self, request: GenerationRequest) -> None:
        """The request is no longer in flight (finished, failed or cancelled)."""
        replica = self._requests.pop(request.request_id, None)
        if replica is not None:
            self._in_flight[replica] -= 1

    def end_session(self, session_id: str) -> int | None:
        """Forgets a session; returns the replica that holds its KV (to free it), or None."""
        return self._sessions.pop(session_id, None)
