import { describe, expect, it, vi } from "vitest";
import type { AckOutcome } from "./client.js";
import { type CommandDeps, makeCommands } from "./commands.js";
import type { FeedbackEvent } from "./outbox.js";
import { RunRegistry } from "./runs.js";
import type { DaemonStatus } from "./status.js";

const STATUS: DaemonStatus = {
  adapter_version: "v3",
  training: { samples_ready: 12, batch_size: 16, last_step: { step: 40, version: 3, outcome: "committed", samples: 16 } },
  memory: { enabled: true, notes: [{ note_id: 4, text: "Please start your reply with 'Sure!'.", active: true, retired_by: null },
                                   { note_id: 5, text: "Don't use bold.", active: false, retired_by: 3 }] },
  gate: { reviewing: null, newest: null },
};

function deps(over: Partial<CommandDeps> = {}, outcome: AckOutcome | null = { status: "applied", callId: "c1" }) {
  const registry = new RunRegistry();
  registry.start({ runId: "turn-7", trigger: "user", sessionKey: "agent:main:x", sessionId: "sid-x" });
  registry.end("turn-7");
  const sent: FeedbackEvent[] = [];
  const d: CommandDeps = {
    registry,
    send: (e) => sent.push(e),
    waitForAck: vi.fn(async () => outcome ?? undefined),
    status: vi.fn(async () => STATUS),
    connection: () => ({ connected: true, pending: 0, adapterVersion: "v3", lastPushes: [{ type: "adapter_live", version: "v3" }] }),
    daemonUrl: "http://127.0.0.1:30000",
    ...over,
  };
  const cmds = Object.fromEntries(makeCommands(d).map((c) => [c.name, c]));
  return { d, sent, cmds, registry };
}

const ctx = { sessionKey: "agent:main:x", sessionId: "sid-x", channel: "webchat" };

describe("commands", () => {
  it("registers /good /bad /correct /clawback", () => {
    expect(Object.keys(deps().cmds)).toEqual(["good", "bad", "correct", "clawback"]);
    expect(deps().cmds.correct!.acceptsArgs).toBe(true);
  });

  it("/bad sends thumbs_down for the last reply's turn and answers with progress", async () => {
    const { cmds, sent } = deps();
    const r = await cmds.bad!.handler(ctx);
    expect(r.text).toBe("noted 👎 — 12 of 16 samples ready for the next update");
    expect(sent).toHaveLength(1);
    expect(sent[0]).toMatchObject({ type: "feedback", kind: "thumbs_down", session_id: "sid-x", target: "turn-7", source: "webchat" });
    expect(sent[0]!.event_id).toMatch(/^[0-9a-f-]{36}$/);
  });

  it("/good targets 'last' when this gateway has not seen a reply of the session", async () => {
    const { cmds, sent } = deps();
    const r = await cmds.good!.handler({ sessionKey: "k2", sessionId: "sid-other", channel: "telegram" });
    expect(r.text).toContain("noted 👍");
    expect(sent[0]).toMatchObject({ kind: "thumbs_up", session_id: "sid-other", target: "last", source: "telegram" });
  });

  it("/correct needs text and sends it", async () => {
    const { cmds, sent } = deps();
    expect((await cmds.correct!.handler({ ...ctx, args: "  " })).text).toMatch(/^usage: \/correct/);
    expect(sent).toHaveLength(0);
    const r = await cmds.correct!.handler({ ...ctx, args: "use fewer words" });
    expect(r.text).toBe("noted ✍️ correction — 12 of 16 samples ready for the next update");
    expect(sent[0]).toMatchObject({ kind: "correction", text: "use fewer words", target: "turn-7" });
  });

  it("says the event is queued when the daemon is down, and explains orphans", async () => {
    const down = deps({ status: async () => undefined }, null);
    expect((await down.cmds.bad!.handler(ctx)).text).toMatch(/queued; the clawback daemon is not reachable/);
    expect(down.sent).toHaveLength(1);
    const orphan = deps({}, { status: "orphan", reason: "unknown_session" });
    expect((await orphan.cmds.good!.handler(ctx)).text).toMatch(/has not seen that reply yet/);
  });

  it("without any session there is nothing to rate", async () => {
    const { cmds, sent } = deps();
    expect((await cmds.good!.handler({ channel: "webchat" })).text).toMatch(/no reply in this conversation/);
    expect(sent).toHaveLength(0);
  });

  it("/clawback shows adapter, samples, last step, memory notes, queue and last update", async () => {
    const { cmds } = deps();
    const text = (await cmds.clawback!.handler(ctx)).text;
    expect(text).toContain("adapter: v3");
    expect(text).toContain("samples waiting: 12 of 16");
    expect(text).toContain("last training step: 40");
    expect(text).toContain("feedback queued here: 0");
    expect(text).toContain("last update: adapter_live v3");
    expect(text).toContain("memory: on, 2 notes (clawback memory list|edit|forget)\n  4. Please start your reply with 'Sure!'.\n"
      + "  5. Don't use bold. (retired by v3)");
    const off = deps({ status: async () => undefined, connection: () => ({ connected: false, pending: 2, adapterVersion: undefined, lastPushes: [] }) });
    expect((await off.cmds.clawback!.handler(ctx)).text).toBe("clawback: daemon http://127.0.0.1:30000 is not reachable\nfeedback queued here: 2");
  });

  it("/clawback says when the gate did not promote the newest version, and why", async () => {
    const refused = { ...STATUS, adapter_version: "v6", gate: { reviewing: null, newest: { version: 7, state: "refused", reason: "retention −5.4 points" } } };
    const { cmds } = deps({ status: async () => refused });
    const text = (await cmds.clawback!.handler(ctx)).text;
    expect(text).toContain("adapter: v6");
    expect(text).toContain("v7 not promoted: retention −5.4 points");
    const reviewing = deps({ status: async () => ({ ...refused, gate: { reviewing: 8, newest: { version: 8, state: "candidate", reason: null } } }) });
    expect((await reviewing.cmds.clawback!.handler(ctx)).text).toContain("v8 is being checked before it goes live");
    const live = deps({ status: async () => ({ ...STATUS, adapter_version: "v7", gate: { reviewing: null, newest: { version: 7, state: "live", reason: null } } }) });
    expect((await live.cmds.clawback!.handler(ctx)).text).not.toContain("not promoted");
  });
});
