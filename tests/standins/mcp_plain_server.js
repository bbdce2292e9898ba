#!/usr/bin/env node
// A stdio MCP server of Node's standard library only, run by npx in tests/test_mcp_start.py.
const readline = require("readline");
const reply = (id, result) => process.stdout.write(JSON.stringify({jsonrpc: "2.0", id, result}) + "\n");
readline.createInterface({input: process.stdin}).on("line", (line) => {
  if (!line.trim()) return;
  const {id, method, params} = JSON.parse(line);
  if (id === undefined) return;
  if (method === "initialize") reply(id, {protocolVersion: params.protocolVersion, capabilities: {tools: {}},
                                          serverInfo: {name: "plain-node", version: "1"}});
  else if (method === "tools/list") reply(id, {tools: [{name: "where", description: "The server's script and cwd.",
                                                        inputSchema: {type: "object", properties: {}}}]});
  else if (method === "tools/call") reply(id, {content: [{type: "text", text: JSON.stringify(
      {executable: process.argv[1], prefix: __dirname, cwd: process.cwd()})}], isError: false});
  else process.stdout.write(JSON.stringify({jsonrpc: "2.0", id, error: {code: -32601, message: method}}) + "\n");
});
