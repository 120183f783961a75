"""Constants shared by the MCP server's modules."""

from __future__ import annotations

from typing import Final

SERVER_NAME: Final = "devs-sandbox"
DEFAULT_HTTP_HOST: Final = "127.0.0.1"
DEFAULT_HTTP_PORT: Final = 8000  # the SDK's default
HTTP_PATH: Final = "/mcp"
# uvicorn waits for open requests before it stops; a tool call may run for minutes, so cut
# them short and let the cancelled calls kill their sandboxes.
HTTP_GRACEFUL_SHUTDOWN_S: Final = 2.0
# After SIGTERM/SIGINT the sandboxes are destroyed first; the stdio transport may then
# still sit in a blocking read of stdin (anyio cannot abandon it), so exit after this.
SIGNAL_EXIT_GRACE_S: Final = 1.0
DEFAULT_VIOLATIONS_LIMIT: Final = 20
MAX_VIOLATIONS_LIMIT: Final = 1_000
# A bearer token is a short line; anything longer is not the file the operator meant.
MAX_TOKEN_FILE_BYTES: Final = 4_096
# Online guessing of a shorter token is within reach; `openssl rand -hex 32` gives 64.
MIN_TOKEN_CHARS: Final = 16
_CALLER_KEY: Final = "devs_sandbox.caller"  # our entry in the SDK's Connection.state
