// Durable JSONL outbox: every feedback event is appended (and fsynced) before it is sent; it leaves
// only when the daemon acks its event_id (or answers orphan with stored:true). Survives restarts.
import { closeSync, existsSync, fsyncSync, mkdirSync, openSync, readFileSync, renameSync, writeSync } from "node:fs";
import { dirname } from "node:path";
import type { FeedbackEvent } from "./wire.js";

export type { FeedbackEvent };
export type FeedbackKind = FeedbackEvent["kind"];

type Line = { op: "add"; event: FeedbackEvent } | { op: "done"; event_id: string; why?: string };

export class Outbox {
  private pending = new Map<string, FeedbackEvent>();
  private doneLines = 0;

  constructor(readonly path: string) {
    mkdirSync(dirname(path), { recursive: true, mode: 0o700 });
    this.load();
  }

  private load(): void {
    if (!existsSync(this.path)) return;
    const text = readFileSync(this.path, "utf8");
    for (const raw of text.split("\n")) {
      if (!raw.trim()) continue;
      let line: Line;
      try {
        line = JSON.parse(raw) as Line;
      } catch {
        continue; // a torn last line after a crash: that event was never reported as queued
      }
      if (line.op === "add" && line.event?.event_id) this.pending.set(line.event.event_id, line.event);
      else if (line.op === "done") {
        this.pending.delete(line.event_id);
        this.doneLines++;
      }
    }
    this.compact();
  }

  private append(line: Line): void {
    const fd = openSync(this.path, "a", 0o600); // corrections are the person's own words: private
    try {
      writeSync(fd, JSON.stringify(line) + "\n");
      fsyncSync(fd);
    } finally {
      closeSync(fd);
    }
  }

  /** Rewrites the file with only pending events (atomic rename). */
  compact(): void {
    const tmp = `${this.path}.tmp`;
    const fd = openSync(tmp, "w", 0o600); // also makes a file left readable by an older version private
    try {
      for (const event of this.pending.values()) writeSync(fd, JSON.stringify({ op: "add", event } satisfies Line) + "\n");
      fsyncSync(fd);
    } finally {
      closeSync(fd);
    }
    renameSync(tmp, this.path);
    this.doneLines = 0;
  }

  add(event: FeedbackEvent): void {
    if (this.pending.has(event.event_id)) return;
    this.append({ op: "add", event });
    this.pending.set(event.event_id, event);
  }

  /** Removes an acked (or stored-orphan) event. Unknown ids are ignored. */
  done(eventId: string, why?: string): boolean {
    if (!this.pending.has(eventId)) return false;
    this.append({ op: "done", event_id: eventId, ...(why ? { why } : {}) });
    this.pending.delete(eventId);
    this.doneLines++;
    if (this.pending.size === 0 || this.doneLines > 256) this.compact();
    return true;
  }

  has(eventId: string): boolean {
    return this.pending.has(eventId);
  }

  /** Pending events in the order they were queued. */
  list(): FeedbackEvent[] {
    return [...this.pending.values()];
  }

  get size(): number {
    return this.pending.size;
  }
}
