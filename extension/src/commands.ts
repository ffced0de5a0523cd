// /good, /bad, /correct <text>, /clawback: explicit feedback on the last reply of this session.
import type { AckOutcome } from "./client.js";
import { newEventId } from "./ids.js";
import type { FeedbackEvent, FeedbackKind } from "./outbox.js";
import type { RunRegistry } from "./runs.js";
import type { DaemonStatus } from "./status.js";
import type { AdapterLive, DaemonFrame, Trained } from "./wire.js";

export type CommandCtx = { args?: string; commandBody?: string; sessionKey?: string; sessionId?: string; channel?: string };
export type CommandReply = { text: string };
export type CommandDef = { name: string; description: string; acceptsArgs: boolean; handler: (ctx: CommandCtx) => Promise<CommandReply> };

export type CommandDeps = {
  registry: RunRegistry;
  send: (e: FeedbackEvent) => void;
  waitForAck: (eventId: string, timeoutMs: number) => Promise<AckOutcome | undefined>;
  status: () => Promise<DaemonStatus | undefined>;
  connection: () => { connected: boolean; pending: number; adapterVersion: string | null | undefined; lastPushes: DaemonFrame[] };
  daemonUrl: string;
  ackWaitMs?: number;
};

const EMOJI: Record<string, string> = { thumbs_up: "👍", thumbs_down: "👎", correction: "✍️" };

function progress(s: DaemonStatus | undefined): string {
  const t = s?.training;
  if (!t || typeof t.samples_ready !== "number" || typeof t.batch_size !== "number") return "";
  return ` — ${t.samples_ready} of ${t.batch_size} samples ready for the next update`;
}

/** The target for "the last reply in this session": its turn id when this gateway saw it, else the daemon's "last". */
function targetFor(deps: CommandDeps, sessionId: string): string {
  return deps.registry.lastReply(sessionId)?.runId ?? "last";
}

async function give(deps: CommandDeps, ctx: CommandCtx, kind: FeedbackKind, text?: string): Promise<CommandReply> {
  const sessionId = ctx.sessionId || deps.registry.sessionIdForKey(ctx.sessionKey);
  if (!sessionId) return { text: "clawback: there is no reply in this conversation to rate yet." };
  if (ctx.sessionKey) deps.registry.noteSessionKey(ctx.sessionKey, sessionId);
  const event: FeedbackEvent = {
    type: "feedback",
    event_id: newEventId(),
    kind,
    session_id: sessionId,
    target: targetFor(deps, sessionId),
    source: ctx.channel || "openclaw",
    ts: Date.now() / 1000,
    ...(text ? { text } : {}),
  };
  deps.send(event);
  const outcome = await deps.waitForAck(event.event_id, deps.ackWaitMs ?? 3000);
  const label = kind === "correction" ? "noted ✍️ correction" : `noted ${EMOJI[kind]}`;
  if (!outcome) return { text: `${label} — queued; the clawback daemon is not reachable right now, it will get it when it is back.` };
  if (outcome.status === "orphan") return { text: `${label} — the daemon has not seen that reply yet; it will attach when it arrives.` };
  return { text: `${label}${progress(await deps.status())}` };
}

export async function statusText(deps: CommandDeps): Promise<string> {
  const s = await deps.status();
  const c = deps.connection();
  const lines: string[] = [];
  if (!s) lines.push(`clawback: daemon ${deps.daemonUrl} is not reachable`);
  else {
    const t = s.training ?? {};
    lines.push(`clawback: daemon ${deps.daemonUrl} ${c.connected ? "connected" : "up (feedback socket reconnecting)"}`);
    lines.push(`adapter: ${s.adapter_version ?? "base model"}`);
    if (typeof t.samples_ready === "number") lines.push(`samples waiting: ${t.samples_ready}${typeof t.batch_size === "number" ? ` of ${t.batch_size}` : ""}`);
    lines.push(`last training step: ${t.last_step?.step ?? "none yet"}`);
    const m = s.memory;
    if (m) {
      const notes = m.notes ?? [];
      lines.push(`memory: ${m.enabled === false ? "off" : "on"}, ${notes.length} note${notes.length === 1 ? "" : "s"} (clawback memory list|edit|forget)`);
      for (const n of notes) lines.push(`  ${n.note_id}. ${n.text}${n.active === false ? ` (retired by v${n.retired_by})` : ""}`);
    }
    const newest = s.gate?.newest;
    if (s.gate?.reviewing) lines.push(`v${s.gate.reviewing} is being checked before it goes live`);
    else if (newest?.state === "refused") lines.push(`v${newest.version} not promoted: ${newest.reason ?? "refused"}`);
  }
  lines.push(`feedback queued here: ${c.pending}`);
  const last = c.lastPushes.filter((p): p is AdapterLive | Trained => p.type === "adapter_live" || p.type === "trained").at(-1);
  if (last) lines.push(`last update: ${last.type} ${String(last.version ?? "")}`.trim());
  return lines.join("\n");
}

export function makeCommands(deps: CommandDeps): CommandDef[] {
  return [
    { name: "good", description: "👍 the last reply (clawback learns from it)", acceptsArgs: false, handler: (ctx) => give(deps, ctx, "thumbs_up") },
    { name: "bad", description: "👎 the last reply (clawback learns from it)", acceptsArgs: false, handler: (ctx) => give(deps, ctx, "thumbs_down") },
    {
      name: "correct",
      description: "Say what the last reply should have done: /correct <text>",
      acceptsArgs: true,
      handler: async (ctx) => {
        const text = (ctx.args ?? "").trim();
        if (!text) return { text: "usage: /correct <what the last reply should have done>" };
        return give(deps, ctx, "correction", text.slice(0, 16000));
      },
    },
    { name: "clawback", description: "clawback status: adapter version, samples waiting, last training step, memory notes", acceptsArgs: false, handler: async () => ({ text: await statusText(deps) }) },
  ];
}
