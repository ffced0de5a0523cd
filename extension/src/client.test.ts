import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { FeedbackClient, type WsLike } from "./client.js";
import { type FeedbackEvent, Outbox } from "./outbox.js";

class FakeWs implements WsLike {
  static all: FakeWs[] = [];
  readyState = 0;
  sent: any[] = [];
  onopen: WsLike["onopen"] = null;
  onmessage: WsLike["onmessage"] = null;
  onclose: WsLike["onclose"] = null;
  onerror: WsLike["onerror"] = null;
  constructor(readonly url: string) {
    FakeWs.all.push(this);
  }
  send(data: string) {
    if (this.readyState !== 1) throw new Error("not open");
    this.sent.push(JSON.parse(data));
  }
  close(code = 1000) {
    this.drop(code);
  }
  // server side helpers
  open(adapter: string | null = null, needAuth = false) {
    this.readyState = 1;
    this.onopen?.({});
    if (!needAuth) this.push({ type: "hello", protocol: 1, adapter_version: adapter });
  }
  push(frame: object) {
    this.onmessage?.({ data: JSON.stringify(frame) });
  }
  drop(code = 1006) {
    if (this.readyState === 3) return;
    this.readyState = 3;
    this.onclose?.({ code });
  }
  feedbackSent(): FeedbackEvent[] {
    return this.sent.filter((f) => f.type === "feedback");
  }
}

const logger = { info: vi.fn(), warn: vi.fn(), error: vi.fn(), debug: vi.fn() };
const ev = (id: string, kind: FeedbackEvent["kind"] = "thumbs_down"): FeedbackEvent => ({
  type: "feedback", event_id: id, kind, session_id: "s1", target: "last", source: "webchat", ts: 1,
});

function setup(dir = mkdtempSync(join(tmpdir(), "cb-client-")), apiKey?: string) {
  const outbox = new Outbox(join(dir, "outbox.jsonl"));
  const client = new FeedbackClient({
    url: "ws://127.0.0.1:1/v1/feedback/ws", apiKey: () => apiKey, outbox, logger,
    wsFactory: (u) => new FakeWs(u), initialBackoffMs: 100, maxBackoffMs: 1000, retryBusyMs: 50, random: () => 1,
  });
  return { dir, outbox, client };
}

beforeEach(() => {
  FakeWs.all = [];
  vi.useFakeTimers();
});
afterEach(() => {
  vi.useRealTimers();
});

describe("FeedbackClient", () => {
  it("sends the auth frame first and events only after hello; an ack removes the event", async () => {
    const { client, outbox } = setup(undefined, "sekrit");
    client.start();
    client.enqueue(ev("e1"));
    const ws = FakeWs.all[0]!;
    expect(ws.url).toBe("ws://127.0.0.1:1/v1/feedback/ws");
    ws.open(null, true);
    expect(ws.sent).toEqual([{ type: "auth", api_key: "sekrit" }]);
    ws.push({ type: "auth_ok" });
    ws.push({ type: "hello", protocol: 1, adapter_version: "v3" });
    expect(ws.feedbackSent().map((e) => e.event_id)).toEqual(["e1"]);
    expect(client.adapterVersion).toBe("v3");
    const waiting = client.waitForAck("e1", 1000);
    ws.push({ type: "ack", event_id: "e1", status: "applied", call_id: "c9" });
    await expect(waiting).resolves.toEqual({ status: "applied", callId: "c9" });
    expect(outbox.size).toBe(0);
    client.stop();
  });

  it("reconnects with backoff and resends every unacked event exactly once per connection", () => {
    const { client, outbox } = setup();
    client.start();
    FakeWs.all[0]!.drop(); // daemon down at start
    client.enqueue(ev("a"));
    client.enqueue(ev("b"));
    expect(FakeWs.all.length).toBe(1);
    vi.advanceTimersByTime(100); // first retry after the initial backoff
    expect(FakeWs.all.length).toBe(2);
    FakeWs.all[1]!.drop();
    vi.advanceTimersByTime(150);
    expect(FakeWs.all.length).toBe(2); // second backoff is 200 ms
    vi.advanceTimersByTime(60);
    expect(FakeWs.all.length).toBe(3);
    const ws = FakeWs.all[2]!;
    ws.open();
    expect(ws.feedbackSent().map((e) => e.event_id)).toEqual(["a", "b"]);
    ws.push({ type: "ack", event_id: "a", status: "applied" });
    ws.drop(); // b was sent but never acked
    vi.advanceTimersByTime(100); // backoff reset by the hello
    const ws2 = FakeWs.all[3]!;
    ws2.open();
    expect(ws2.feedbackSent().map((e) => e.event_id)).toEqual(["b"]);
    ws2.push({ type: "ack", event_id: "b", status: "duplicate" });
    expect(outbox.size).toBe(0);
    client.stop();
  });

  it("backoff is capped", () => {
    const { client } = setup();
    client.start();
    for (let i = 0; i < 12; i++) {
      FakeWs.all.at(-1)!.drop();
      vi.advanceTimersByTime(1000);
    }
    expect(FakeWs.all.length).toBe(13);
    client.stop();
  });

  it("events survive a gateway restart: a new client over the same outbox resends them", () => {
    const first = setup();
    first.client.start();
    first.client.enqueue(ev("keep"));
    first.client.stop();
    const second = setup(first.dir);
    second.client.start();
    const ws = FakeWs.all.at(-1)!;
    ws.open();
    expect(ws.feedbackSent().map((e) => e.event_id)).toEqual(["keep"]);
    second.client.stop();
  });

  it("a stored orphan leaves the outbox; busy is resent; malformed is dropped with an error", async () => {
    const { client, outbox } = setup();
    client.start();
    const ws = FakeWs.all[0]!;
    ws.open();
    client.enqueue(ev("orph"));
    client.enqueue(ev("busy"));
    client.enqueue(ev("bad"));
    ws.push({ type: "error", code: "orphan", message: "unknown session", event_id: "orph", reason: "unknown_session", stored: true });
    ws.push({ type: "error", code: "busy", message: "queue full", event_id: "busy" });
    ws.push({ type: "error", code: "malformed", message: "nope", event_id: "bad" });
    expect(outbox.list().map((e) => e.event_id)).toEqual(["busy"]);
    expect(logger.error).toHaveBeenCalled();
    await expect(client.waitForAck("orph", 10)).resolves.toEqual({ status: "orphan", reason: "unknown_session" });
    vi.advanceTimersByTime(60);
    expect(ws.feedbackSent().map((e) => e.event_id)).toEqual(["orph", "busy", "bad", "busy"]);
    ws.push({ type: "ack", event_id: "busy", status: "applied" });
    expect(outbox.size).toBe(0);
    client.stop();
  });

  it("keeps status pushes for /clawback", () => {
    const { client } = setup();
    client.start();
    const ws = FakeWs.all[0]!;
    ws.open();
    ws.push({ type: "trained", version: "v2", samples: 16, mean_reward: 0.25 });
    ws.push({ type: "adapter_live", version: "v2" });
    expect(client.adapterVersion).toBe("v2");
    expect(client.lastPushes.map((p) => p.type)).toEqual(["trained", "adapter_live"]);
    client.stop();
  });

  it("waitForAck times out with the event still queued", async () => {
    const { client, outbox } = setup();
    client.start();
    client.enqueue(ev("slow"));
    const p = client.waitForAck("slow", 500);
    vi.advanceTimersByTime(501);
    await expect(p).resolves.toBeUndefined();
    expect(outbox.has("slow")).toBe(true);
    client.stop();
  });
});
