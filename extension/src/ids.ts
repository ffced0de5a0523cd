// Event ids: random UUIDs, or deterministic ones (same input → same id) so a re-seen reaction dedupes.
import { createHash, randomUUID } from "node:crypto";

export function newEventId(): string {
  return randomUUID();
}

/** A UUID-shaped (version 5 style) id derived from a string. */
export function stableEventId(key: string): string {
  const h = createHash("sha1").update("clawback:" + key).digest();
  h[6] = (h[6]! & 0x0f) | 0x50;
  h[8] = (h[8]! & 0x3f) | 0x80;
  const x = h.subarray(0, 16).toString("hex");
  return `${x.slice(0, 8)}-${x.slice(8, 12)}-${x.slice(12, 16)}-${x.slice(16, 20)}-${x.slice(20, 32)}`;
}
