import { appendFileSync, chmodSync, mkdtempSync, readFileSync, statSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describe, expect, it } from "vitest";
import { type FeedbackEvent, Outbox } from "./outbox.js";

const ev = (id: string, kind: FeedbackEvent["kind"] = "thumbs_up"): FeedbackEvent => ({
  type: "feedback", event_id: id, kind, session_id: "s1", target: "last", source: "webchat", ts: 1,
});

describe("Outbox", () => {
  it("persists pending events across a simulated restart and drops acked ones", () => {
    const path = join(mkdtempSync(join(tmpdir(), "cb-outbox-")), "state", "outbox.jsonl");
    const a = new Outbox(path);
    a.add(ev("e1"));
    a.add(ev("e2", "thumbs_down"));
    a.add(ev("e3", "session_end"));
    expect(a.done("e2")).toBe(true);
    expect(a.done("nope")).toBe(false);
    // "Restart": a new instance over the same file.
    const b = new Outbox(path);
    expect(b.list().map((e) => e.event_id)).toEqual(["e1", "e3"]);
    expect(b.list()[0]).toEqual(ev("e1"));
    b.done("e1");
    b.done("e3");
    expect(new Outbox(path).size).toBe(0);
    expect(readFileSync(path, "utf8")).toBe(""); // compacted once empty
  });

  it("keeps the file private, also one an older version left readable", () => {
    const dir = mkdtempSync(join(tmpdir(), "cb-outbox-"));
    const fresh = new Outbox(join(dir, "new", "o.jsonl"));
    fresh.add(ev("p1", "correction"));
    expect(statSync(fresh.path).mode & 0o077).toBe(0);
    const old = join(dir, "old.jsonl");
    writeFileSync(old, JSON.stringify({ op: "add", event: ev("p2") }) + "\n");
    chmodSync(old, 0o644);
    new Outbox(old);
    expect(statSync(old).mode & 0o077).toBe(0);
  });

  it("adding the same event id twice keeps one copy", () => {
    const path = join(mkdtempSync(join(tmpdir(), "cb-outbox-")), "o.jsonl");
    const a = new Outbox(path);
    a.add(ev("x"));
    a.add(ev("x"));
    expect(new Outbox(path).size).toBe(1);
  });

  it("ignores a torn last line left by a crash", () => {
    const path = join(mkdtempSync(join(tmpdir(), "cb-outbox-")), "o.jsonl");
    const a = new Outbox(path);
    a.add(ev("ok"));
    appendFileSync(path, '{"op":"add","event":{"type":"feedb');
    expect(new Outbox(path).list().map((e) => e.event_id)).toEqual(["ok"]);
  });
});
