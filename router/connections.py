"""HTTP connection hygiene of the gateway: read deadlines and a bounded number of open connections.

uvicorn's h11 protocol, extended (one instance per connection):

    open ----------- headers within header_timeout_s ----> body within body_timeout_s ----> request runs
      ^                 (silent or dribbling: closed;          (dribbling: 408, closed)      (its own deadlines)
      |                  partial headers: 408 first)                                              |
      +--- idle keep-alive: uvicorn closes it after keep_alive_timeout_s without a byte <---------+
           (a first byte starts the header deadline again)

Open connections are capped at ``max_connections`` (and below the process's file limit, so that accept()
never fails for want of a descriptor): a new connection beyond it closes the connection idle the longest
(waiting for a request, none in progress); when every connection has a request in progress, the new one gets
503 with Retry-After and is closed.
"""

from __future__ import annotations

import json
import logging
import os
import resource
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

FD_HEADROOM = 64  # descriptors kept free of client connections: worker channels, files, logs
_HEADERS, _BODY, _IDLE = "headers", "body", "idle"


@dataclass
class ConnectionLimits:
    """The deadlines and the cap, and the open connections in order of how long they have been idle."""

    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    retry_after_s: int = 1
    open: OrderedDict[Any, None] = field(default_factory=OrderedDict)
    num_evicted: int = 0
    num_refused: int = 0
    num_timed_out: int = 0


def fd_capped_connections(max_connections: int) -> int:
    """``max_connections``, lowered to what the file limit leaves free (the soft limit is raised to the hard one
    first, as servers do)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 32
    room = max(8, soft - in_use - FD_HEADROOM)
    if room < max_connections:
        log.warning("router: at most %d HTTP connections at once (file limit %d; --max-connections %d)", room,
                    soft, max_connections)
    return min(max_connections, room)


def _raw_response(status: int, reason: str, message: str, code: str, retry_after_s: int | None = None) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "server_error", "param": None, "code": code}}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", "connection: close",
            f"content-length: {len(body)}"]
    if retry_after_s is not None:
        head.append(f"retry-after: {retry_after_s}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol enforcing ``_limits`` (set on the subclass ``guarded_protocol`` makes)."""

    _limits: ConnectionLimits

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase: str | None = None
        self._deadline: Any = None

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._limits.open[self] = None
        self._arm(_HEADERS)
        if len(self._limits.open) > self._limits.max_connections:
            self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self._limits.open.pop(self, None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow(got_data=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow(got_data=False)

    # -- deadlines ---------------------------------------------------------------------------------
    def _follow(self, got_data: bool) -> None:
        """Track which part of a request the client owes us and keep that part's deadline running."""
        state = self.conn.their_state
        phase = _HEADERS if state is h11.IDLE else _BODY if state is h11.SEND_BODY else None
        if phase == _HEADERS and not got_data:
            phase = _IDLE  # between requests: uvicorn's keep-alive timeout until the next first byte
        if phase == self._phase or (phase == _IDLE and self._phase == _HEADERS):
            return
        if phase in (_HEADERS, _IDLE):
            self._limits.open.move_to_end(self)  # idle since now
        if phase == _IDLE:
            self._cancel()
            self._phase = _IDLE
        else:
            self._arm(phase)

    def _arm(self, phase: str | None) -> None:
        self._cancel()
        self._phase = phase
        if phase == _HEADERS:
            self._deadline = self.loop.call_later(self._limits.header_timeout_s, self._expire, phase)
        elif phase == _BODY:
            self._deadline = self.loop.call_later(self._limits.body_timeout_s, self._expire, phase)

    def _cancel(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, phase: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        self._limits.num_timed_out += 1
        if phase == _BODY:
            timeout, what = self._limits.body_timeout_s, "request body"
        else:
            timeout, what = self._limits.header_timeout_s, "request headers"
        partial = phase == _BODY or self.conn.their_state is not h11.IDLE or bool(self.conn.trailing_data[0])
        if partial:  # a client that sent something is told why; a silent one is just closed
            if self.scope is not None and phase == _BODY:
                outcome = self.scope.get("nvfp4.outcome")
                if outcome is not None:
                    outcome["status"] = 408
            msg = f"the {what} did not arrive within {timeout:g} s; the connection is closed"
            self.transport.write(_raw_response(408, "Request Timeout", msg, "request_timeout"))
        log.info("closed connection of %s: no complete %s within %g s", _peer(self.client), what, timeout)
        self.transport.close()

    # -- the cap -----------------------------------------------------------------------------------
    def _make_room(self) -> None:
        """Close the connection idle the longest, or refuse this one when every other has a request."""
        for other in self._limits.open:
            if other is not self and other._phase in (_HEADERS, _IDLE) and not other.transport.is_closing():
                self._limits.num_evicted += 1
                log.info("closed the longest idle connection (%s): %d connections open (--max-connections)",
                         _peer(other.client), len(self._limits.open))
                other._cancel()
                other.transport.close()
                self._limits.open.pop(other, None)
                return
        self._limits.num_refused += 1
        log.warning("refused a connection: %d open, each with a request in progress (--max-connections)",
                    len(self._limits.open) - 1)
        msg = f"the server has {self._limits.max_connections} connections open, all busy; retry later"
        self.transport.write(_raw_response(503, "Service Unavailable", msg, "too_many_connections",
                                           self._limits.retry_after_s))
        self._cancel()
        self.transport.close()
        self._limits.open.pop(self, None)


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """The uvicorn ``http`` protocol class enforcing ``limits`` (uvicorn's ``timeout_keep_alive`` does the rest)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"_limits": limits})


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"
