// Drives our MCP server with the official TypeScript SDK client, as most agent hosts embed it.
//
// Usage: node ts_client.mjs SPEC.json  (tests/integration/test_mcp_clients.py writes SPEC)
// SPEC: {"command": str, "args": [str], "cwd": str,
//        "calls": [{"name": str, "arguments": {...}, "progress": bool, "timeoutMs": int?}]}
// A string argument "$sandbox_id" is replaced by the sandbox_id of the latest result that
// had one. Prints {"tools": [...], "calls": [{"ok", "result" | "error", "progress"}]} as JSON.
// The client runs with its defaults (a 60 s request timeout) unless a call says otherwise;
// "progress" asks for progress notifications and resets the timeout on each, as hosts do.
import { readFileSync } from "node:fs";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";

const spec = JSON.parse(readFileSync(process.argv[2], "utf8"));
const transport = new StdioClientTransport({
  command: spec.command,
  args: spec.args,
  cwd: spec.cwd,
  env: process.env,
  stderr: "inherit",
});
const client = new Client({ name: "devs-sandbox-tests", version: "1.0.0" });
await client.connect(transport);
// As hosts do: the list caches each tool's output schema, which callTool then enforces.
const tools = (await client.listTools()).tools;
const calls = [];
let sandboxId = null;
for (const call of spec.calls) {
  const args = Object.fromEntries(
    Object.entries(call.arguments ?? {}).map(([k, v]) => [k, v === "$sandbox_id" ? sandboxId : v]),
  );
  const progress = [];
  const options = {};
  if (call.progress) {
    options.onprogress = (p) => progress.push({ ...p, atMs: Date.now() });
    options.resetTimeoutOnProgress = true;
  }
  if (call.timeoutMs) options.timeout = call.timeoutMs;
  const started = Date.now();
  try {
    const result = await client.callTool({ name: call.name, arguments: args }, undefined, options);
    const id = result.structuredContent?.sandbox_id;
    if (typeof id === "string") sandboxId = id;
    calls.push({ ok: true, result, progress, elapsedMs: Date.now() - started });
  } catch (error) {
    calls.push({
      ok: false,
      error: String(error?.message ?? error),
      code: error?.code ?? null,
      progress,
      elapsedMs: Date.now() - started,
    });
  }
}
await client.close();
process.stdout.write(JSON.stringify({ tools, calls }) + "\n");
