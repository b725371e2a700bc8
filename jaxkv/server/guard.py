"""Who may talk to the server: bearer-token auth, Host / Origin checks, session owners.

- API keys (`server.api_key`, comma-separated, or the JAXKV_API_KEY environment
  variable when the config leaves it empty): when set, every endpoint but `/health`
  needs `Authorization: Bearer <key>` (401 `invalid_api_key` otherwise, compared in
  constant time), and a session belongs to the key that first used it: another key
  neither lists, uses nor deletes it (404, as for a session that does not exist).
- Hosts (`server.allowed_hosts`, comma-separated; empty: the loopback names when
  the server binds a loopback address, any host otherwise; `*`: any): a request
  whose Host header, or Origin header when it has one, names another host is 403
  `host_not_allowed`. That keeps a web page the user visits from reaching a
  server on the user's machine (DNS rebinding, cross-origin `text/plain` POSTs).

- Header deadline (`server.header_timeout_s`): a connection whose request headers
  are not complete that long after it opened, or that is still sending a body that
  long after its response went out (a 408 / 413 / 401 answered early), is closed
  (`header_deadline_protocol`: uvicorn's HTTP/1.1 protocol with a timer; uvicorn's
  keep-alive timer is cancelled by the first byte and not re-armed until a response,
  so a client trickling a header a byte at a time held a connection as long as it
  liked).

`Guard` is plain ASGI middleware (no `BaseHTTPMiddleware`, which would hide a
client's disconnect from the streaming endpoints); the key a request carried is
`request.state.api_key`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import urllib.parse

from fastapi.responses import JSONResponse

from jaxkv.config import ServerConfig
from jaxkv.server.protocol import APIError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
ENV_KEY = "JAXKV_API_KEY"


def api_keys(cfg: ServerConfig) -> tuple[str, ...]:
  """The keys the server accepts (empty: no auth)."""
  raw = cfg.api_key or os.environ.get(ENV_KEY, "")
  return tuple(k.strip() for k in raw.split(",") if k.strip())


def allowed_hosts(cfg: ServerConfig) -> frozenset[str] | None:
  """Host names requests may name (None: any)."""
  raw = [h.strip().lower() for h in cfg.allowed_hosts.split(",") if h.strip()]
  if "*" in raw:
    return None
  if raw:
    return frozenset(raw)
  try:
    loopback = ipaddress.ip_address(cfg.host).is_loopback
  except ValueError:
    loopback = cfg.host.lower() == "localhost"
  return LOOPBACK_NAMES if loopback else None


def hostname(netloc: str) -> str:
  """'Example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
  return (urllib.parse.urlsplit("//" + netloc).hostname or "").lower()


class Guard:
  """ASGI middleware: the host check, then the key check (module docstring)."""

  def __init__(self, app, keys: tuple[str, ...], hosts: frozenset[str] | None):
    self.app, self.keys, self.hosts = app, keys, hosts

  def check(self, path: str, headers: dict[str, str]) -> tuple[APIError | None, str]:
    if self.hosts is not None:
      origin = headers.get("origin")
      for name, value in (("Host", headers.get("host", "")),
                          ("Origin", urllib.parse.urlsplit(origin).netloc if origin else None)):
        if value is not None and hostname(value) not in self.hosts:
          return APIError(403, f"{name} {value!r} is not an allowed host (server."
                          "allowed_hosts)", code="host_not_allowed"), ""
    if not self.keys or path == "/health":
      return None, ""
    auth = headers.get("authorization", "")
    token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    ok = False
    for k in self.keys:     # every key compared, in constant time
      ok |= hmac.compare_digest(token.encode(), k.encode())
    if not ok:
      return APIError(401, "a valid API key is required (Authorization: Bearer <key>)",
                      code="invalid_api_key"), ""
    return None, token

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    err, token = self.check(scope.get("path", ""), headers)
    if err is not None:
      return await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)
    scope.setdefault("state", {})["api_key"] = token
    return await self.app(scope, receive, send)


class Owners:
  """Which key each session belongs to (auth on); everything passes with auth off."""

  def __init__(self, enabled: bool):
    self.enabled = enabled
    self._owner: dict[str, str] = {}     # session id -> digest of its key

  @staticmethod
  def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()

  def claim(self, sid: str, key: str) -> bool:
    """True if `key` may use session `sid` (taking it when nobody has)."""
    if not self.enabled:
      return True
    return self._owner.setdefault(sid, self._digest(key)) == self._digest(key)

  def owns(self, sid: str, key: str) -> bool:
    return not self.enabled or self._owner.get(sid) == self._digest(key)

  def forget_all_but(self, live) -> None:
    """Drops the owners of sessions that are gone (closed or expired)."""
    for sid in [s for s in self._owner if s not in live]:
      del self._owner[sid]


def header_deadline_protocol(timeout_s: float):
  """uvicorn's h11 HTTP protocol class that closes a connection whose request headers
  are still incomplete `timeout_s` after the connection opened or after its previous
  response (module docstring)."""
  import h11  # pylint: disable=import-outside-toplevel
  from uvicorn.protocols.http.h11_impl import H11Protocol  # pylint: disable=import-outside-toplevel

  class HeaderDeadline(H11Protocol):
    _deadline = None

    def _arm(self) -> None:
      if self._deadline is not None:
        self._deadline.cancel()
      self._deadline = self.loop.call_later(timeout_s, self._late)

    def _late(self) -> None:
      self._deadline = None
      if self.transport.is_closing():
        return
      # their_state is IDLE until a request's headers are complete (SEND_BODY / DONE
      # after), and again once a keep-alive connection waits for its next request; a
      # body still arriving after its response went out is no request either
      state = self.conn.their_state
      answered = self.cycle is not None and self.cycle.response_complete
      if state is h11.IDLE or (answered and state is not h11.DONE):
        self.transport.close()

    def connection_made(self, transport) -> None:
      super().connection_made(transport)
      self._arm()

    def on_response_complete(self) -> None:
      super().on_response_complete()
      self._arm()

    def connection_lost(self, exc) -> None:
      if self._deadline is not None:
        self._deadline.cancel()
        self._deadline = None
      super().connection_lost(exc)

  return HeaderDeadline
