// clawback for OpenClaw: provider `clawback` tags every LLM call; commands, reactions and session
// lifecycle become feedback events sent over one durable WebSocket to the clawback daemon.
import { homedir } from "node:os";
import { dirname, join } from "node:path";
import { definePluginEntry, type OpenClawPluginApi } from "openclaw/plugin-sdk/plugin-entry";
import { FeedbackClient, type Logger, type WsFactory } from "./client.js";
import { makeCommands } from "./commands.js";
import { type ClawbackConfig, feedbackWsUrl, readApiKey, type RawConfig, resolveConfig } from "./config.js";
import { stableEventId } from "./ids.js";
import { type FeedbackEvent, Outbox } from "./outbox.js";
import { type Peek, ReactionWatcher } from "./reactions.js";
import { RunRegistry } from "./runs.js";
import { fetchDaemonStatus } from "./status.js";
import { makeWrapSimpleCompletionStreamFn, makeWrapStreamFn, PROVIDER_ID } from "./tagging.js";

export const PLUGIN_ID = "clawback";

/** Where OpenClaw keeps state when no service context tells us (mirrors OpenClaw's own resolution). */
export function defaultStateDir(env: NodeJS.ProcessEnv = process.env): string {
  if (env.OPENCLAW_STATE_DIR?.trim()) return env.OPENCLAW_STATE_DIR.trim();
  if (env.OPENCLAW_CONFIG_PATH?.trim()) return dirname(env.OPENCLAW_CONFIG_PATH.trim());
  return join(env.OPENCLAW_HOME?.trim() || homedir(), ".openclaw");
}

export function outboxPath(stateDir: string): string {
  return join(stateDir, "plugins", PLUGIN_ID, "outbox.jsonl");
}

/** The part of OpenClaw's plugin API the plugin uses. */
export type PluginApi = Pick<OpenClawPluginApi, "pluginConfig" | "logger" | "on" | "registerProvider" | "registerCommand" | "registerService">;

/**
 * State shared by every registration in this process. OpenClaw calls `register` several times (and the
 * agent runtime may hold a different plugin instance than the gateway service), so the run registry and
 * the one socket per daemon live here. Everything in it is keyed (run id, session id, outbox path): there
 * is no "current run" value.
 */
export type Shared = { registry: RunRegistry; clients: Map<string, FeedbackClient>; sentLifecycle: Set<string> };
declare global {
  // On globalThis rather than in this module: OpenClaw may load the module more than once.
  var clawbackOpenClawShared: Shared | undefined;
}
export function newShared(): Shared {
  return { registry: new RunRegistry(), clients: new Map(), sentLifecycle: new Set() };
}
export function processShared(): Shared {
  return (globalThis.clawbackOpenClawShared ??= newShared());
}

export type Overrides = { wsFactory?: WsFactory; peek?: Peek; stateDir?: string; backoffMs?: number; shared?: Shared };

/** The one socket per daemon (and outbox) this process uses, and a `send` that never throws. */
function feedbackChannel(raw: RawConfig, cfg: ClawbackConfig, shared: Shared, stateDir: string, log: Logger, overrides: Overrides) {
  const clientKey = `${feedbackWsUrl(cfg.daemonUrl)}|${outboxPath(stateDir)}`;
  const getClient = (): FeedbackClient => {
    let client = shared.clients.get(clientKey);
    if (!client) {
      client = new FeedbackClient({
        url: feedbackWsUrl(cfg.daemonUrl),
        apiKey: () => readApiKey(raw),
        outbox: new Outbox(outboxPath(stateDir)),
        logger: log,
        wsFactory: overrides.wsFactory,
        initialBackoffMs: overrides.backoffMs ?? 500,
      });
      shared.clients.set(clientKey, client);
    }
    return client;
  };
  const send = (e: FeedbackEvent) => {
    try {
      getClient().enqueue(e);
    } catch (err) {
      log.error(`clawback: could not queue ${e.kind}: ${String(err)}`);
    }
  };
  const stop = () => shared.clients.get(clientKey)?.stop();
  return { getClient, send, stop };
}

/** The `clawback` provider tags every LLM call with the run it belongs to (main or side). */
function registerTagging(api: PluginApi, registry: RunRegistry): void {
  api.registerProvider({
    id: PROVIDER_ID,
    label: "clawback (self-hosted, learns from feedback)",
    auth: [],
    wrapStreamFn: makeWrapStreamFn(registry),
    wrapSimpleCompletionStreamFn: makeWrapSimpleCompletionStreamFn(registry),
  });
  // The context of agent hooks (before_prompt_build, llm_input, agent_end, ...), as `on` declares it.
  type AgentHookContext = Parameters<Parameters<typeof api.on<"llm_input">>[1]>[1];
  const recordRun = (ctx: AgentHookContext, event: { runId?: string; sessionId?: string }) => {
    const runId = ctx.runId ?? event.runId;
    if (!runId) return;
    registry.start({
      runId,
      trigger: ctx.trigger,
      sessionKey: ctx.sessionKey,
      sessionId: ctx.sessionId || event.sessionId,
      inputProvenance: ctx.inputProvenance,
      channel: ctx.channel ?? ctx.messageProvider,
    });
  };
  api.on("before_prompt_build", (_event, ctx) => {
    recordRun(ctx, {});
    return undefined;
  });
  api.on("llm_input", (event, ctx) => recordRun(ctx, event));
  api.on("agent_end", (event, ctx) => {
    registry.end(event.runId ?? ctx.runId, event.success !== false);
  });
}

/** Where replies and reactions live: session keys and sent message ids, so a reaction finds its run. */
function registerReplyTracking(api: PluginApi, registry: RunRegistry): void {
  api.on("message_received", (_event, ctx) => {
    if (ctx.sessionKey) registry.noteSessionKey(ctx.sessionKey);
  });
  api.on("reply_payload_sending", (event, ctx) => {
    const key = event.sessionKey ?? ctx.sessionKey;
    if (key) registry.noteSessionKey(key, registry.sessionIdForRun(event.runId ?? ctx.runId));
  });
  api.on("message_sent", (event, ctx) => {
    const key = event.sessionKey ?? ctx.sessionKey;
    const runId = event.runId ?? ctx.runId ?? registry.lastReply(registry.sessionIdForKey(key))?.runId;
    if (event.success !== false) registry.noteMessage(ctx.channelId, event.messageId, runId);
  });
}

/** Session ends and compaction links. Idempotent by construction (stable ids), sent once per gateway. */
function registerSessionLifecycle(api: PluginApi, shared: Shared, send: (e: FeedbackEvent) => void): void {
  const { registry, sentLifecycle } = shared;
  const sessionEnd = (sessionId: string | undefined, source: string) => {
    if (!sessionId || sentLifecycle.has(`end:${sessionId}`)) return;
    sentLifecycle.add(`end:${sessionId}`);
    send({ type: "feedback", event_id: stableEventId(`session_end:${sessionId}`), kind: "session_end", session_id: sessionId, source, ts: Date.now() / 1000 });
  };
  const sessionLink = (from: string | undefined, to: string | undefined) => {
    if (!from || !to || from === to || sentLifecycle.has(`link:${from}:${to}`)) return;
    sentLifecycle.add(`link:${from}:${to}`);
    registry.rotateSession(from, to);
    send({ type: "feedback", event_id: stableEventId(`session_link:${from}:${to}`), kind: "session_link", from, to, source: "openclaw", ts: Date.now() / 1000 });
  };
  api.on("before_reset", (_event, ctx) => sessionEnd(ctx.sessionId, "openclaw"));
  api.on("session_end", (event, ctx) => {
    const sid = event.sessionId ?? ctx.sessionId;
    if (event.nextSessionId && event.reason === "compaction") sessionLink(sid, event.nextSessionId);
    else sessionEnd(sid, "openclaw");
  });
  api.on("after_compaction", (event, ctx) => sessionLink(event.previousSessionId, ctx.sessionId));
}

/** The slash commands (/good, /bad, /correct, /clawback) when the config enables them; their deps. */
function registerCommands(api: PluginApi, cfg: ClawbackConfig, raw: RawConfig, registry: RunRegistry, channel: ReturnType<typeof feedbackChannel>) {
  const commandDeps = {
    registry,
    send: channel.send,
    waitForAck: (id: string, ms: number) => channel.getClient().waitForAck(id, ms),
    status: () => fetchDaemonStatus(cfg.daemonUrl, readApiKey(raw)),
    connection: () => {
      const c = channel.getClient();
      return { connected: c.connected, pending: c.pending, adapterVersion: c.adapterVersion, lastPushes: c.lastPushes };
    },
    daemonUrl: cfg.daemonUrl,
  };
  if (cfg.commands) {
    for (const c of makeCommands(commandDeps)) api.registerCommand({ ...c, requireAuth: true });
  }
  return commandDeps;
}

/** The gateway service that owns the socket and the reaction poller; returns the poller's `poll`. */
function registerFeedbackService(api: PluginApi, cfg: ClawbackConfig, registry: RunRegistry, channel: ReturnType<typeof feedbackChannel>,
                                 stateDir: string, log: Logger, overrides: Overrides): () => number {
  let watcher: ReactionWatcher | undefined;
  api.registerService({
    id: "clawback-feedback",
    start: async () => {
      const c = channel.getClient();
      c.start();
      if (cfg.reactions) {
        let peek = overrides.peek;
        if (!peek) {
          try {
            const mod = await import("openclaw/plugin-sdk/system-event-runtime");
            peek = (key) => mod.peekSystemEventEntries(key);
          } catch (err) {
            log.warn(`clawback: reactions off, system events unavailable: ${String(err)}`);
          }
        }
        if (peek) {
          watcher = new ReactionWatcher(peek, registry, cfg, channel.send, log);
          watcher.start();
        }
      }
      log.info(`clawback: feedback service started (daemon ${cfg.daemonUrl}, outbox ${outboxPath(stateDir)}, ${c.pending} queued)`);
    },
    stop: () => {
      watcher?.stop();
      watcher = undefined;
      channel.stop();
    },
  });
  return () => watcher?.poll() ?? 0;
}

/** Everything one registration owns; exported for tests. */
export function createPlugin(api: PluginApi, overrides: Overrides = {}) {
  const raw = (api.pluginConfig ?? {}) as RawConfig; // OpenClaw checked it against openclaw.plugin.json's configSchema
  const cfg: ClawbackConfig = resolveConfig(raw);
  const shared = overrides.shared ?? processShared();
  const stateDir = overrides.stateDir ?? defaultStateDir();
  const channel = feedbackChannel(raw, cfg, shared, stateDir, api.logger, overrides);
  registerTagging(api, shared.registry);
  registerReplyTracking(api, shared.registry);
  registerSessionLifecycle(api, shared, channel.send);
  const commandDeps = registerCommands(api, cfg, raw, shared.registry, channel);
  const poll = registerFeedbackService(api, cfg, shared.registry, channel, stateDir, api.logger, overrides);
  return { cfg, registry: shared.registry, getClient: channel.getClient, commandDeps, poll };
}

export default definePluginEntry({
  id: PLUGIN_ID,
  name: "clawback",
  description: "Tags main/side LLM calls for the clawback daemon and sends 👍/👎, corrections and session events to it.",
  register(api: OpenClawPluginApi) {
    createPlugin(api);
  },
});
