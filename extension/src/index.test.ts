import { mkdtempSync, readFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describe, expect, it, vi } from "vitest";
import type { WsLike } from "./client.js";
import entry, { createPlugin, defaultStateDir, newShared, outboxPath, processShared } from "./index.js";
import type { SystemEventEntry } from "./reactions.js";

class FakeWs implements WsLike {
  readyState = 0;
  sent: any[] = [];
  onopen: WsLike["onopen"] = null;
  onmessage: WsLike["onmessage"] = null;
  onclose: WsLike["onclose"] = null;
  onerror: WsLike["onerror"] = null;
  constructor(readonly url: string, private readonly autoAck: boolean) {
    queueMicrotask(() => {
      this.readyState = 1;
      this.onopen?.({});
      this.onmessage?.({ data: JSON.stringify({ type: "hello", protocol: 1, adapter_version: null }) });
    });
  }
  send(data: string) {
    const f = JSON.parse(data);
    this.sent.push(f);
    if (this.autoAck && f.type === "feedback") {
      queueMicrotask(() => this.onmessage?.({ data: JSON.stringify({ type: "ack", event_id: f.event_id, status: "applied", call_id: "c1" }) }));
    }
  }
  close() {
    this.readyState = 3;
  }
}

/** A hand-made OpenClaw api: records hooks, provider, commands and services. */
function mockApi(pluginConfig: Record<string, unknown> = {}) {
  const hooks = new Map<string, (event: any, ctx: any) => unknown>();
  const api = {
    id: "clawback",
    registrationMode: "full",
    pluginConfig,
    logger: { info: vi.fn(), warn: vi.fn(), error: vi.fn(), debug: vi.fn() },
    on: vi.fn((name: string, handler: (event: any, ctx: any) => unknown) => void hooks.set(name, handler)),
    registerProvider: vi.fn(),
    registerCommand: vi.fn(),
    registerService: vi.fn(),
  };
  const provider = () => api.registerProvider.mock.calls[0]![0] as any;
  const command = (name: string) => api.registerCommand.mock.calls.map((c) => c[0] as any).find((c) => c.name === name);
  const service = () => api.registerService.mock.calls[0]![0] as any;
  const fire = (name: string, event: any, ctx: any) => hooks.get(name)!(event, ctx);
  return { api, hooks, provider, command, service, fire };
}

function setup(pluginConfig: Record<string, unknown> = {}, queues: Record<string, SystemEventEntry[]> = {}) {
  const m = mockApi(pluginConfig);
  const sockets: FakeWs[] = [];
  const stateDir = mkdtempSync(join(tmpdir(), "cb-index-"));
  const plugin = createPlugin(m.api, {
    stateDir,
    wsFactory: (u) => {
      const ws = new FakeWs(u, true);
      sockets.push(ws);
      return ws;
    },
    peek: (k) => queues[k],
    shared: newShared(),
  });
  return { ...m, plugin, sockets, stateDir };
}

const tick = () => new Promise((r) => setTimeout(r, 5));

describe("plugin entry", () => {
  it("is a definePluginEntry with id clawback", () => {
    expect(entry.id).toBe("clawback");
    expect(typeof entry.register).toBe("function");
  });

  it("registers the provider, hooks, four commands and one service, and opens no socket in register", () => {
    const m = mockApi();
    const factory = vi.fn();
    createPlugin(m.api, { wsFactory: factory as any, shared: newShared() });
    expect(m.provider().id).toBe("clawback");
    expect(typeof m.provider().wrapStreamFn).toBe("function");
    expect(typeof m.provider().wrapSimpleCompletionStreamFn).toBe("function");
    expect([...m.hooks.keys()].sort()).toEqual([
      "after_compaction", "agent_end", "before_prompt_build", "before_reset", "llm_input",
      "message_received", "message_sent", "reply_payload_sending", "session_end",
    ]);
    expect(m.api.registerCommand.mock.calls.map((c) => (c[0] as any).name)).toEqual(["good", "bad", "correct", "clawback"]);
    expect(m.service().id).toBe("clawback-feedback");
    expect(factory).not.toHaveBeenCalled();
  });

  it("commands can be switched off", () => {
    const m = mockApi({ commands: { enabled: false } });
    createPlugin(m.api, { shared: newShared() });
    expect(m.api.registerCommand).not.toHaveBeenCalled();
  });

  it("tags calls from the run recorded in before_prompt_build, then /bad targets that turn over the socket", async () => {
    const s = setup();
    await s.service().start({ stateDir: s.stateDir });
    const ctx = { runId: "run-1", trigger: "user", sessionKey: "agent:main:e2e", sessionId: "sid-1", channel: "webchat" };
    s.fire("before_prompt_build", { prompt: "hi", messages: [] }, ctx);
    const inner = vi.fn();
    s.provider().wrapStreamFn({ provider: "clawback", modelId: "m", streamFn: inner })({}, {}, { sessionId: "sid-1", requestId: "run-1:model:1" });
    expect(inner.mock.calls[0]![2].headers).toEqual({ "X-Session-Id": "sid-1", "X-Turn-Type": "main", "X-Turn-Id": "run-1", "X-Request-Id": "run-1:model:1" });
    s.fire("agent_end", { runId: "run-1", success: true, messages: [] }, ctx);
    const reply = await s.command("bad").handler({ sessionKey: "agent:main:e2e", sessionId: "sid-1", channel: "webchat", args: "" });
    expect(reply.text).toMatch(/^noted 👎/);
    const fb = s.sockets[0]!.sent.filter((f) => f.type === "feedback");
    expect(fb).toEqual([expect.objectContaining({ kind: "thumbs_down", session_id: "sid-1", target: "run-1", source: "webchat" })]);
    expect(readFileSync(outboxPath(s.stateDir), "utf8")).toBe(""); // acked and compacted
    s.service().stop({});
  });

  it("session_end, before_reset and compaction rotation become session_end / session_link once each", async () => {
    const s = setup();
    await s.service().start({ stateDir: s.stateDir });
    s.fire("before_reset", { reason: "new" }, { sessionId: "old-1", sessionKey: "k" });
    s.fire("session_end", { sessionId: "old-1", reason: "new", messageCount: 4 }, { sessionId: "old-1" });
    s.fire("after_compaction", { messageCount: 3, compactedCount: 10, previousSessionId: "gen-1" }, { sessionId: "gen-2", sessionKey: "k" });
    s.fire("session_end", { sessionId: "gen-1", reason: "compaction", nextSessionId: "gen-2", messageCount: 9 }, { sessionId: "gen-1" });
    s.fire("after_compaction", { messageCount: 3, compactedCount: 10 }, { sessionId: "gen-2" }); // no rotation
    await tick();
    const fb = s.sockets[0]!.sent.filter((f) => f.type === "feedback");
    expect(fb.map((f) => [f.kind, f.session_id ?? `${f.from}->${f.to}`])).toEqual([
      ["session_end", "old-1"], ["session_link", "gen-1->gen-2"],
    ]);
    s.service().stop({});
  });

  it("a reaction system event on a seen session becomes thumbs feedback for the run that sent the message", async () => {
    const queues: Record<string, SystemEventEntry[]> = {};
    const s = setup({ pollIntervalMs: 100000 }, queues);
    await s.service().start({ stateDir: s.stateDir });
    const ctx = { runId: "run-7", trigger: "user", sessionKey: "agent:main:telegram:direct:5", sessionId: "sid-7", channel: "telegram" };
    s.fire("before_prompt_build", {}, ctx);
    s.fire("agent_end", { runId: "run-7", success: true }, ctx);
    s.fire("message_sent", { to: "5", content: "hi", success: true, messageId: "42", sessionKey: ctx.sessionKey }, { channelId: "telegram", sessionKey: ctx.sessionKey });
    queues[ctx.sessionKey] = [{ id: "e1", text: "Telegram reaction added: 👎 by Al on msg 42", contextKey: "telegram:reaction:add:5:42:9:👎" }];
    expect(s.plugin.poll()).toBe(1);
    expect(s.plugin.poll()).toBe(0);
    await tick();
    const fb = s.sockets[0]!.sent.filter((f) => f.type === "feedback");
    expect(fb).toEqual([expect.objectContaining({ kind: "thumbs_down", session_id: "sid-7", target: "run-7", source: "telegram" })]);
    s.service().stop({});
  });

  it("registrations in one process share the run registry and one socket (hooks in one, service in another)", async () => {
    const shared = newShared();
    const stateDir = mkdtempSync(join(tmpdir(), "cb-index-"));
    const sockets: FakeWs[] = [];
    const opts = { stateDir, shared, wsFactory: (u: string) => { const ws = new FakeWs(u, true); sockets.push(ws); return ws; }, peek: () => [] };
    const agentSide = mockApi();
    const gatewaySide = mockApi();
    createPlugin(agentSide.api, opts);
    createPlugin(gatewaySide.api, opts);
    await gatewaySide.service().start({});
    const ctx = { runId: "r", trigger: "user", sessionKey: "agent:main:z", sessionId: "sz" };
    agentSide.fire("before_prompt_build", {}, ctx);
    agentSide.fire("agent_end", { runId: "r", success: true }, ctx);
    expect(shared.registry.sessionIdForKey("agent:main:z")).toBe("sz");
    await agentSide.command("good").handler({ sessionKey: "agent:main:z", sessionId: "sz", channel: "webchat" });
    expect(sockets).toHaveLength(1);
    expect(sockets[0]!.sent.filter((f) => f.type === "feedback")).toEqual([expect.objectContaining({ kind: "thumbs_up", target: "r" })]);
    gatewaySide.service().stop({});
    expect(processShared()).toBe(processShared());
  });

  it("resolves the state dir like OpenClaw", () => {
    expect(defaultStateDir({ OPENCLAW_STATE_DIR: "/s" })).toBe("/s");
    expect(defaultStateDir({ OPENCLAW_CONFIG_PATH: "/c/openclaw.json" })).toBe("/c");
    expect(defaultStateDir({ OPENCLAW_HOME: "/h" })).toBe("/h/.openclaw");
    expect(outboxPath("/s")).toBe("/s/plugins/clawback/outbox.jsonl");
  });
});
