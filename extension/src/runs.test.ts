import { describe, expect, it } from "vitest";
import { classifyRun, parseRequestId, RunRegistry } from "./runs.js";

// Every row of the reference's main/side table (openclaw-plugin-api.md §2).
const TABLE: Array<[string, Parameters<typeof classifyRun>[0], "main" | "side"]> = [
  ["user turn on a channel", { trigger: "user", sessionKey: "agent:main:telegram:direct:42", inputProvenance: { kind: "external_user" } }, "main"],
  ["user turn, WebChat chat.send (no provenance)", { trigger: "user", sessionKey: "agent:main:dashboard:t1" }, "main"],
  ["user turn, OpenAI HTTP", { trigger: "user", sessionKey: "agent:main:openai-user:bob" }, "main"],
  ["user turn, openclaw agent CLI", { trigger: "user", sessionKey: "agent:main:main" }, "main"],
  ["memory flush before compaction", { trigger: "memory", sessionKey: "agent:main:main" }, "side"],
  ["heartbeat", { trigger: "heartbeat", sessionKey: "agent:main:main" }, "side"],
  ["cron turn", { trigger: "cron", sessionKey: "cron:nightly" }, "side"],
  ["cron session key even with trigger user", { trigger: "user", sessionKey: "agent:main:cron:nightly" }, "side"],
  ["active-memory recall sub-query", { trigger: "manual", sessionKey: "agent:main:main:active-memory:ab12" }, "side"],
  ["active-memory key even with trigger user", { trigger: "user", sessionKey: "agent:main:main:active-memory:ab12" }, "side"],
  ["subagent run (trigger hard-coded user)", { trigger: "user", sessionKey: "agent:main:subagent:x1" }, "side"],
  ["inter-session provenance", { trigger: "user", sessionKey: "agent:main:main", inputProvenance: { kind: "inter_session", sourceRole: "subagent" } }, "side"],
  ["internal system provenance", { trigger: "user", sessionKey: "agent:main:main", inputProvenance: { kind: "internal_system" } }, "side"],
  ["unknown run (no before_prompt_build, e.g. /btw or compaction)", undefined, "side"],
];

describe("classifyRun", () => {
  it.each(TABLE)("%s", (_name, info, expected) => {
    expect(classifyRun(info)).toBe(expected);
  });
});

describe("parseRequestId", () => {
  it("splits run id off agent and compaction request ids", () => {
    expect(parseRequestId("run-1:model:3")).toEqual({ runId: "run-1", compaction: false });
    expect(parseRequestId("chatcmpl_abc:model:1")).toEqual({ runId: "chatcmpl_abc", compaction: false });
    expect(parseRequestId("run-2:compaction:d9:model:1")).toEqual({ runId: "run-2", compaction: true });
    expect(parseRequestId(undefined)).toEqual({ compaction: false });
    expect(parseRequestId("plain")).toEqual({ runId: "plain", compaction: false });
  });
});

describe("RunRegistry", () => {
  it("records runs by id, makes main runs the session's last reply on agent_end, and forgets the run", () => {
    const r = new RunRegistry();
    r.start({ runId: "a", trigger: "user", sessionKey: "agent:main:x", sessionId: "s1" });
    r.start({ runId: "h", trigger: "heartbeat", sessionKey: "agent:main:x", sessionId: "s1" });
    expect(r.activeRunCount()).toBe(2);
    r.end("a", true, 10);
    r.end("h", true, 20);
    expect(r.lastReply("s1")).toEqual({ runId: "a", at: 10 });
    expect(r.get("a")).toBeUndefined();
    expect(r.activeRunCount()).toBe(0);
    expect(r.sessionIdForRun("a")).toBe("s1");
    expect(r.sessionIdForKey("agent:main:x")).toBe("s1");
    expect([...r.seenSessionKeys]).toEqual(["agent:main:x"]);
  });
  it("failed runs are not a reply", () => {
    const r = new RunRegistry();
    r.start({ runId: "a", trigger: "user", sessionKey: "k", sessionId: "s" });
    r.end("a", false);
    expect(r.lastReply("s")).toBeUndefined();
  });
  it("maps message ids to runs per channel and carries the last reply across a rotation", () => {
    const r = new RunRegistry();
    r.noteMessage("Telegram", "42", "run-9");
    expect(r.runForMessage("telegram", "42")).toBe("run-9");
    expect(r.runForMessage("discord", "42")).toBeUndefined();
    r.start({ runId: "a", trigger: "user", sessionKey: "k", sessionId: "old" });
    r.end("a", true, 5);
    r.rotateSession("old", "new");
    expect(r.lastReply("new")).toEqual({ runId: "a", at: 5 });
    expect(r.sessionIdForKey("k")).toBe("new");
  });
});
