"""Who may reach the HTTP server: a bearer token, loopback-only binds without one, and the
SDK's DNS-rebinding checks on loopback.

The CLI refuses a non-loopback ``--host`` without ``--auth-token-file`` (exit 125), and
``serve`` refuses it again for library callers: an open port would let anyone who can
reach it run commands on this host.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import stat
from pathlib import Path
from typing import Any, Final

from mcp.server.transport_security import TransportSecuritySettings

from devs_sandbox.errors import ConfigError

logger = logging.getLogger(__name__)

SERVER_NAME: Final = "devs-sandbox"
# A bearer token is a short line; anything longer is not the file the operator meant.
MAX_TOKEN_FILE_BYTES: Final = 4_096
# Online guessing of a shorter token is within reach; `openssl rand -hex 32` gives 64.
MIN_TOKEN_CHARS: Final = 16


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server to this machine: ``localhost`` or a loopback
    address. A name, ``0.0.0.0``, ``::`` or any other address is reachable from elsewhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


def read_auth_token(path: Path) -> str:
    """The bearer token in ``path``, read once at start.

    Refused, with one line naming the file: a file group or others may access (as ssh
    does for a private key), one owned by someone else than us or root, not a regular
    file, over ``MAX_TOKEN_FILE_BYTES``, or a token (the file less its trailing newline)
    that is empty, shorter than ``MIN_TOKEN_CHARS`` or not printable ASCII without spaces
    (the characters an ``Authorization: Bearer`` header carries).
    """
    key = "--auth-token-file"
    try:
        with path.open("rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"token file {path} is not a regular file", key=key)
            if st.st_mode & 0o077:
                raise ConfigError(
                    f"token file {path} has mode {stat.S_IMODE(st.st_mode):04o}: group or "
                    f"others may access it; run chmod 600 {path}",
                    key=key,
                )
            if st.st_uid not in {os.geteuid(), 0}:
                raise ConfigError(
                    f"token file {path} belongs to uid {st.st_uid}, neither this user nor root",
                    key=key,
                )
            raw = f.read(MAX_TOKEN_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read token file {path}: {exc.strerror}", key=key) from None
    if len(raw) > MAX_TOKEN_FILE_BYTES:
        raise ConfigError(
            f"token file {path} is over {MAX_TOKEN_FILE_BYTES} bytes: not a token", key=key
        )
    token = raw.decode("latin-1").rstrip("\r\n")
    if not token:
        raise ConfigError(f"token file {path} is empty", key=key)
    if not all("!" <= c <= "~" for c in token):
        raise ConfigError(
            f"the token in {path} must be printable ASCII without spaces (one line)", key=key
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"the token in {path} has {len(token)} characters; use at least "
            f"{MIN_TOKEN_CHARS} (e.g. openssl rand -hex 32 > {path})",
            key=key,
        )
    return token


class BearerTokenAuth:
    """ASGI middleware: an HTTP request runs only with ``Authorization: Bearer <token>``.

    Anything else (no header, another scheme, a wrong token, the header twice) is
    answered 401 with ``WWW-Authenticate: Bearer`` (RFC 6750) before the MCP app sees it,
    so no session opens and no tool runs. The comparison takes the same time wherever
    the tokens differ (``hmac.compare_digest``). The lifespan passes through; a WebSocket
    (the MCP app serves none) is closed.
    """

    def __init__(self, app: Any, token: str) -> None:
        self._app = app
        self._token = token.encode("ascii")

    def _authorized(self, scope: dict[str, Any]) -> bool:
        values = [v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, credentials = bytes(values[0]).strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(credentials.strip(), self._token)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind not in {"http", "websocket"} or self._authorized(scope):
            await self._app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        logger.debug("refused an HTTP request without the bearer token")
        body = b'{"error": "unauthorized", "error_description": "bearer token required"}'
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", f'Bearer realm="{SERVER_NAME}"'.encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def transport_security(host: str) -> TransportSecuritySettings | None:
    """The SDK's DNS-rebinding protection (Host and Origin must name this machine) for a
    loopback bind, the one a web page in the user's browser could otherwise reach under
    a name it rebinds to 127.0.0.1; the SDK turns it on by itself only for three spellings
    of loopback. A non-loopback bind requires a bearer token, which such a page lacks."""
    if not is_loopback(host):
        return None
    names = {"127.0.0.1", "localhost", "[::1]", f"[{host}]" if ":" in host else host}
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=[f"{n}:*" for n in sorted(names)],
        allowed_origins=[f"http://{n}:*" for n in sorted(names)],
    )
