import { readFileSync } from "node:fs";
import { describe, expect, it } from "vitest";
import { readWireSchema, WIRE_TS, wireTypes } from "../scripts/wire-types.js";
import type { ClientFrame, DaemonFrame, DaemonStatus } from "./wire.js";

type Definition = { properties?: Record<string, unknown>; required?: string[]; additionalProperties?: boolean };
const defs = (readWireSchema() as { $defs: Record<string, Definition & { discriminator?: { mapping: Record<string, string> } }> }).$defs;

/** The schema's own check of one object: no field it does not define (unless open), every required one there. */
function fieldsOf(sample: object, name: string): { unknown: string[]; missing: string[] } {
  const def = defs[name]!;
  const keys = Object.keys(sample);
  return {
    unknown: def.additionalProperties === false ? keys.filter((k) => !(k in (def.properties ?? {}))) : [],
    missing: (def.required ?? []).filter((k) => !keys.includes(k)),
  };
}

// Typed by wire.ts: a field renamed in the daemon's models fails `tsc` here, and the schema check below.
const DAEMON_FRAMES: DaemonFrame[] = [
  { type: "hello", protocol: 1, adapter_version: null },
  { type: "auth_ok" },
  { type: "pong", ts: 1795990000.5 },
  { type: "ack", event_id: "6f1c", status: "applied", call_id: "chatcmpl-9a" },
  { type: "error", code: "orphan", message: "stored", event_id: "6f1c", reason: "unknown_session", stored: true },
  { type: "sample_ready", call_id: "c", session_id: "s", reward: -1, reward_source: "explicit", hint: false },
  { type: "trained", version: "v3", samples: 16, mean_reward: 0.25 },
  { type: "adapter_live", version: "v3" },
  { type: "adapter_refused", version: "v4", reason: "fails 3 probes it passed" },
  { type: "adapter_rolled_back", version: "v4", to: "v3", reason: "more 👎 than before" },
];
const CLIENT_FRAMES: ClientFrame[] = [
  { type: "auth", api_key: "k" },
  { type: "ping" },
  { type: "feedback", event_id: "6f1c", kind: "thumbs_down", session_id: "s", target: "last", source: "telegram", ts: 1795990000.1 },
  { type: "feedback", event_id: "77aa", kind: "session_link", from: "a", to: "b" },
  { event_id: "88bb", kind: "outcome", session_id: "s", reward: 1, credit: "step", group: "g", turns: ["t1", "t2"] },
];
const STATUS: DaemonStatus = {
  adapter_version: "v3",
  training: { samples_ready: 3, batch_size: 16, last_step: { step: 7, version: 3, outcome: "committed", samples: 16 } },
  memory: { enabled: true, notes: [{ note_id: 1, text: "Shorter replies.", active: true, retired_by: null }] },
  gate: { reviewing: null, newest: { version: 3, state: "live", reason: null } },
};

describe("wire types", () => {
  it("src/wire.ts is what the schema generates now (npm run wire-types)", async () => {
    expect(readFileSync(WIRE_TS, "utf8")).toBe(await wireTypes());
  });

  it("every daemon frame type has a sample, and each sample has the schema's fields", () => {
    const mapping = defs.DaemonFrame!.discriminator!.mapping;
    expect(DAEMON_FRAMES.map((f) => f.type).sort()).toEqual(Object.keys(mapping).sort());
    for (const f of DAEMON_FRAMES) expect(fieldsOf(f, mapping[f.type]!.split("/").at(-1)!), f.type).toEqual({ unknown: [], missing: [] });
  });

  it("client frames and the status reply have the schema's fields", () => {
    const name = (f: ClientFrame) => (f.type === "auth" ? "Auth" : f.type === "ping" ? "Ping" : "FeedbackEvent");
    for (const f of CLIENT_FRAMES) expect(fieldsOf(f, name(f))).toEqual({ unknown: [], missing: [] });
    expect(fieldsOf(STATUS, "DaemonStatus")).toEqual({ unknown: [], missing: [] });
    expect(fieldsOf(STATUS.training, "StatusTraining")).toEqual({ unknown: [], missing: [] });
    expect(fieldsOf(STATUS.memory.notes[0]!, "MemoryNote")).toEqual({ unknown: [], missing: [] });
    expect(fieldsOf(STATUS.gate, "StatusGate")).toEqual({ unknown: [], missing: [] });
  });
});
