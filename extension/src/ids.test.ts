import { describe, expect, it } from "vitest";
import { newEventId, stableEventId } from "./ids.js";

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/;

describe("ids", () => {
  it("random ids are UUIDs and differ", () => {
    expect(newEventId()).toMatch(UUID);
    expect(newEventId()).not.toBe(newEventId());
  });
  it("stable ids are UUIDs and deterministic", () => {
    expect(stableEventId("a")).toMatch(UUID);
    expect(stableEventId("a")).toBe(stableEventId("a"));
    expect(stableEventId("a")).not.toBe(stableEventId("b"));
  });
});
