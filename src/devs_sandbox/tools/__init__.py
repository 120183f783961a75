"""Tools above the lifecycle: what agents call (``run_shell_monitored``, the MCP server's
sandboxes kept between calls). They use the library's public API and nothing below it."""
