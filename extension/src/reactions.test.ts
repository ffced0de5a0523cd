import { describe, expect, it, vi } from "vitest";
import { resolveConfig } from "./config.js";
import { normalizeEmoji, parseReaction, ReactionWatcher, reactionKind, reactionToEvent, type SystemEventEntry } from "./reactions.js";
import { RunRegistry } from "./runs.js";

// Fixtures in each channel's format (text as enqueued; contextKey where the channel sets one).
const FIXTURES: Record<string, { entry: SystemEventEntry; expected: ReturnType<typeof parseReaction> }> = {
  telegram: {
    entry: { id: "t1", text: "Telegram reaction added: 👍 by Alice (@alice) on msg 42", contextKey: "telegram:reaction:add:-100123:42:777:👍", ts: 1_795_990_000_000 },
    expected: { channel: "telegram", action: "added", emoji: "👍", messageId: "42" },
  },
  telegramTextOnly: {
    entry: { id: "t2", text: "Telegram reaction added: 👎 by Bob on msg 43" },
    expected: { channel: "telegram", action: "added", emoji: "👎", messageId: "43" },
  },
  discord: {
    entry: { id: "d1", text: "Discord reaction added: 🔥 by bob#1234 on my-guild #general msg 1180000000000000001 from clawbot", contextKey: "discord:reaction:added:1180000000000000001:555:🔥" },
    expected: { channel: "discord", action: "added", emoji: "🔥", messageId: "1180000000000000001" },
  },
  discordRemoved: {
    entry: { id: "d2", text: "Discord reaction removed: 👍 by bob on g #c msg 9", contextKey: "discord:reaction:removed:9:555:👍" },
    expected: { channel: "discord", action: "removed", emoji: "👍", messageId: "9" },
  },
  slack: {
    entry: { id: "s1", text: "Slack reaction added: :thumbsup: by alice in #general msg 1732906502.139329 from bob", contextKey: "slack:reaction:added:C024BE91L:1732906502.139329:U1:thumbsup" },
    expected: { channel: "slack", action: "added", emoji: ":thumbsup:", messageId: "1732906502.139329" },
  },
  slackMinus: {
    entry: { id: "s2", text: "Slack reaction added: :-1: by alice in #general msg 1732906502.1", contextKey: "slack:reaction:added:C1:1732906502.1:U1:-1" },
    expected: { channel: "slack", action: "added", emoji: ":-1:", messageId: "1732906502.1" },
  },
  signal: {
    entry: { id: "g1", text: "Signal reaction added: ❤️ by Alice msg 1717171717 from +15550002222 in Family" },
    expected: { channel: "signal", action: "added", emoji: "❤️", messageId: "1717171717" },
  },
  drained: {
    entry: { id: "x1", text: "System: [2026-11-29 20:00:00] Telegram reaction added: 👍 by Ada (@ada) on msg 7" },
    expected: { channel: "telegram", action: "added", emoji: "👍", messageId: "7" },
  },
};

describe("parseReaction", () => {
  it.each(Object.entries(FIXTURES))("%s", (_name, { entry, expected }) => {
    expect(parseReaction(entry)).toEqual(expected);
  });
  it("ignores other system events", () => {
    expect(parseReaction({ text: "Node: laptop (10.0.0.2) · app 1.2" })).toBeUndefined();
    expect(parseReaction({ text: "Exec finished: ls" })).toBeUndefined();
  });
  it("falls back to the contextKey when the text is unfamiliar", () => {
    expect(parseReaction({ text: "something new", contextKey: "telegram:reaction:add:1:99:5:👎" }))
      .toEqual({ channel: "telegram", action: "added", emoji: "👎", messageId: "99" });
  });
});

describe("emoji mapping", () => {
  const cfg = resolveConfig({});
  it.each([
    ["👍", "thumbs_up"], ["👍🏽", "thumbs_up"], ["❤️", "thumbs_up"], ["❤", "thumbs_up"], ["🔥", "thumbs_up"],
    [":+1:", "thumbs_up"], [":thumbsup:", "thumbs_up"], [":heart:", "thumbs_up"], [":fire:", "thumbs_up"],
    ["👎", "thumbs_down"], [":-1:", "thumbs_down"], [":thumbsdown:", "thumbs_down"],
    ["😂", undefined], ["✅", undefined],
  ])("%s → %s", (emoji, kind) => {
    expect(reactionKind(emoji, cfg)).toBe(kind);
  });
  it("is configurable", () => {
    const custom = resolveConfig({ reactions: { positive: ["✅"], negative: ["❌"] } });
    expect(reactionKind("✅", custom)).toBe("thumbs_up");
    expect(reactionKind("❌", custom)).toBe("thumbs_down");
    expect(reactionKind("👍", custom)).toBeUndefined();
    expect(normalizeEmoji(":Thumbsup:")).toBe("thumbsup");
  });
});

function registryWithSession() {
  const reg = new RunRegistry();
  reg.start({ runId: "run-1", trigger: "user", sessionKey: "agent:main:telegram:direct:9", sessionId: "sid-9" });
  reg.end("run-1");
  reg.start({ runId: "run-2", trigger: "user", sessionKey: "agent:main:telegram:direct:9", sessionId: "sid-9" });
  reg.end("run-2");
  return reg;
}

describe("reactionToEvent", () => {
  const cfg = resolveConfig({});
  it("targets the run whose reply carried the message when known", () => {
    const reg = registryWithSession();
    reg.noteMessage("telegram", "42", "run-1");
    const e = reactionToEvent("agent:main:telegram:direct:9", FIXTURES.telegram!.entry, cfg, reg)!;
    expect(e).toMatchObject({ type: "feedback", kind: "thumbs_up", session_id: "sid-9", target: "run-1", source: "telegram", ts: 1_795_990_000 });
    expect(reactionToEvent("agent:main:telegram:direct:9", FIXTURES.telegram!.entry, cfg, reg)!.event_id).toBe(e.event_id);
  });
  it("else the session's last reply", () => {
    const e = reactionToEvent("agent:main:telegram:direct:9", FIXTURES.telegramTextOnly!.entry, cfg, registryWithSession())!;
    expect(e).toMatchObject({ kind: "thumbs_down", target: "run-2" });
  });
  it("else 'last'; removed reactions, uncounted emoji and disabled channels give nothing", () => {
    const reg = new RunRegistry();
    reg.noteSessionKey("k", "sid");
    expect(reactionToEvent("k", FIXTURES.slack!.entry, cfg, reg)).toMatchObject({ kind: "thumbs_up", target: "last", source: "slack" });
    expect(reactionToEvent("k", FIXTURES.discordRemoved!.entry, cfg, reg)).toBeUndefined();
    expect(reactionToEvent("k", { id: "z", text: "Telegram reaction added: 😂 by A on msg 1" }, cfg, reg)).toBeUndefined();
    const onlyTelegram = resolveConfig({ reactions: { channels: ["telegram"] } });
    expect(reactionToEvent("k", FIXTURES.slack!.entry, onlyTelegram, reg)).toBeUndefined();
    expect(reactionToEvent("k", FIXTURES.signal!.entry, cfg, reg)).toMatchObject({ kind: "thumbs_up", source: "signal" });
  });
});

describe("ReactionWatcher", () => {
  it("polls seen sessions, emits each reaction once, and waits for an unknown session id", () => {
    const reg = registryWithSession();
    const queues: Record<string, SystemEventEntry[]> = {
      "agent:main:telegram:direct:9": [FIXTURES.telegram!.entry, { id: "n", text: "Exec finished" }],
      "agent:main:discord:channel:1": [FIXTURES.discord!.entry],
    };
    const emit = vi.fn();
    const w = new ReactionWatcher((k) => queues[k], reg, resolveConfig({}), emit, { warn: vi.fn(), info: vi.fn() });
    reg.noteSessionKey("agent:main:discord:channel:1"); // seen, but no session id yet
    expect(w.poll()).toBe(1);
    expect(w.poll()).toBe(0);
    reg.noteSessionKey("agent:main:discord:channel:1", "sid-d");
    expect(w.poll()).toBe(1);
    expect(emit.mock.calls.map(([e]) => [e.source, e.kind, e.session_id])).toEqual([
      ["telegram", "thumbs_up", "sid-9"], ["discord", "thumbs_up", "sid-d"],
    ]);
  });
  it("survives a failing peek", () => {
    const reg = registryWithSession();
    const warn = vi.fn();
    const w = new ReactionWatcher(() => { throw new Error("boom"); }, reg, resolveConfig({}), vi.fn(), { warn, info: vi.fn() });
    expect(w.poll()).toBe(0);
    expect(warn).toHaveBeenCalled();
  });
});
