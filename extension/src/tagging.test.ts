import { describe, expect, it, vi } from "vitest";
import { RunRegistry } from "./runs.js";
import {
  CHECK_MAX_TOKENS, CHECK_SESSION_KEY, makeWrapSimpleCompletionStreamFn, makeWrapStreamFn, type StreamFn, type StreamOptions,
} from "./tagging.js";

// Stand-ins the wrappers pass through untouched.
const MODEL = {} as Parameters<StreamFn>[0];
const CONTEXT = {} as Parameters<StreamFn>[1];
const STREAM = {} as Awaited<ReturnType<StreamFn>>;

function recorder() {
  const calls: StreamOptions[] = [];
  const streamFn = vi.fn<StreamFn>((_m, _c, o) => {
    calls.push(o ?? {});
    return STREAM;
  });
  return { calls, streamFn };
}

describe("wrapStreamFn", () => {
  it("tags a main call with session, turn and request ids and keeps existing headers", () => {
    const reg = new RunRegistry();
    reg.start({ runId: "r1", trigger: "user", sessionKey: "agent:main:a", sessionId: "sid-a" });
    const { calls, streamFn } = recorder();
    const wrapped = makeWrapStreamFn(reg)({ provider: "clawback", modelId: "m", streamFn })!;
    expect(wrapped(MODEL, CONTEXT, { sessionId: "sid-a", requestId: "r1:model:2", headers: { "x-keep": "1" } })).toBe(STREAM);
    expect(calls[0]!.headers).toEqual({
      "x-keep": "1", "X-Session-Id": "sid-a", "X-Turn-Type": "main", "X-Turn-Id": "r1", "X-Request-Id": "r1:model:2",
    });
  });

  it("two concurrent runs keep their own headers (no module-global current run)", async () => {
    const reg = new RunRegistry();
    const { calls, streamFn } = recorder();
    const wrapped = makeWrapStreamFn(reg)({ provider: "clawback", modelId: "m", streamFn })!;
    reg.start({ runId: "A", trigger: "user", sessionKey: "agent:main:alice", sessionId: "sA" });
    reg.start({ runId: "B", trigger: "heartbeat", sessionKey: "agent:main:bob", sessionId: "sB" });
    // Interleave: B starts after A, A's later tool-loop call comes after B's.
    await Promise.all([
      (async () => { wrapped(MODEL, CONTEXT, { sessionId: "sA", requestId: "A:model:1" }); await Promise.resolve(); wrapped(MODEL, CONTEXT, { sessionId: "sA", requestId: "A:model:2" }); })(),
      (async () => { wrapped(MODEL, CONTEXT, { sessionId: "sB", requestId: "B:model:1" }); })(),
    ]);
    const byReq = Object.fromEntries(calls.map((o) => [o.requestId, o.headers]));
    expect(byReq["A:model:1"]).toMatchObject({ "X-Session-Id": "sA", "X-Turn-Type": "main", "X-Turn-Id": "A" });
    expect(byReq["A:model:2"]).toMatchObject({ "X-Session-Id": "sA", "X-Turn-Type": "main", "X-Turn-Id": "A" });
    expect(byReq["B:model:1"]).toMatchObject({ "X-Session-Id": "sB", "X-Turn-Type": "side", "X-Turn-Id": "B" });
    reg.end("A");
    wrapped(MODEL, CONTEXT, { sessionId: "sB", requestId: "B:model:2" });
    expect(calls.at(-1)!.headers).toMatchObject({ "X-Session-Id": "sB", "X-Turn-Type": "side" });
  });

  it("caps the replies of the install check's session at a few tokens, and only those", () => {
    const reg = new RunRegistry();
    reg.start({ runId: "check", trigger: "user", sessionKey: CHECK_SESSION_KEY, sessionId: "s-check" });
    reg.start({ runId: "chat", trigger: "user", sessionKey: "agent:main:main", sessionId: "s-chat" });
    const { calls, streamFn } = recorder();
    const wrapped = makeWrapStreamFn(reg)({ provider: "clawback", modelId: "m", streamFn })!;
    wrapped(MODEL, CONTEXT, { sessionId: "s-check", requestId: "check:model:1", maxTokens: 1024 });
    wrapped(MODEL, CONTEXT, { sessionId: "s-chat", requestId: "chat:model:1", maxTokens: 1024 });
    wrapped(MODEL, CONTEXT, { sessionId: "s-check", requestId: "check:model:2", maxTokens: 4 });
    expect(calls.map((c) => c.maxTokens)).toEqual([CHECK_MAX_TOKENS, 1024, 4]);
    expect(calls[0]!.headers).toMatchObject({ "X-Turn-Type": "main", "X-Turn-Id": "check" });
  });

  it("never wraps other providers", () => {
    const reg = new RunRegistry();
    reg.start({ runId: "r1", trigger: "user", sessionKey: "k", sessionId: "s" });
    const { calls, streamFn } = recorder();
    for (const provider of ["openai", "anthropic", "vllm", "clawback-other"]) {
      const w = makeWrapStreamFn(reg)({ provider, modelId: "m", streamFn });
      expect(w).toBe(streamFn);
      w!(MODEL, CONTEXT, { sessionId: "s", requestId: "r1:model:1" });
      const s = makeWrapSimpleCompletionStreamFn(reg)({ provider, modelId: "m", streamFn });
      expect(s).toBe(streamFn);
    }
    for (const c of calls) expect(c.headers).toBeUndefined();
  });

  it("compaction calls are side and borrow the run's session id when options lack it", () => {
    const reg = new RunRegistry();
    reg.start({ runId: "r1", trigger: "user", sessionKey: "k", sessionId: "s1" });
    const { calls, streamFn } = recorder();
    makeWrapStreamFn(reg)({ provider: "clawback", modelId: "m", streamFn })!(MODEL, CONTEXT, { sessionId: "", requestId: "r1:compaction:d1:model:1" });
    expect(calls[0]!.headers).toEqual({ "X-Session-Id": "s1", "X-Turn-Type": "side", "X-Turn-Id": "r1", "X-Request-Id": "r1:compaction:d1:model:1" });
  });

  it("a call from an unknown run is side", () => {
    const { calls, streamFn } = recorder();
    makeWrapStreamFn(new RunRegistry())({ provider: "clawback", modelId: "m", streamFn })!(MODEL, CONTEXT, { sessionId: "s", requestId: "zz:model:1" });
    expect(calls[0]!.headers).toMatchObject({ "X-Turn-Type": "side", "X-Session-Id": "s" });
  });
});

describe("wrapSimpleCompletionStreamFn", () => {
  it("always tags side, even when ids are missing", () => {
    const { calls, streamFn } = recorder();
    makeWrapSimpleCompletionStreamFn(new RunRegistry())({ provider: "clawback", modelId: "m", streamFn })!(MODEL, CONTEXT, {});
    expect(calls[0]!.headers).toEqual({ "X-Turn-Type": "side" });
  });
});
