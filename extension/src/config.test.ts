import { describe, expect, it } from "vitest";
import { feedbackWsUrl, readApiKey, resolveConfig } from "./config.js";

describe("config", () => {
  it("has sensible defaults", () => {
    const c = resolveConfig(undefined);
    expect(c.daemonUrl).toBe("http://127.0.0.1:30000");
    expect(c.apiKey).toBeUndefined();
    expect(c.reactions).toBe(true);
    expect(c.commands).toBe(true);
    expect(c.reactionChannels).toEqual(["telegram", "discord", "slack", "signal"]);
  });
  it("normalises the URL (trailing slash, /v1 suffix) and builds the socket URL", () => {
    const c = resolveConfig({ daemonUrl: "https://box:9/v1/" });
    expect(c.daemonUrl).toBe("https://box:9");
    expect(feedbackWsUrl(c.daemonUrl)).toBe("wss://box:9/v1/feedback/ws");
    expect(feedbackWsUrl("http://127.0.0.1:1")).toBe("ws://127.0.0.1:1/v1/feedback/ws");
  });
  it("reads the API key inline or from a file", () => {
    expect(readApiKey({ apiKey: " k1 " })).toBe("k1");
    expect(readApiKey({ apiKeyFile: "/x" }, () => "fromfile\nrest")).toBe("fromfile");
    expect(readApiKey({ apiKeyFile: "/missing" }, () => { throw new Error("ENOENT"); })).toBeUndefined();
    expect(readApiKey({ apiKey: "inline", apiKeyFile: "/x" }, () => "file")).toBe("inline");
  });
  it("honours switches", () => {
    const c = resolveConfig({ reactions: { enabled: false, channels: ["Telegram"] }, commands: { enabled: false } });
    expect(c.reactions).toBe(false);
    expect(c.commands).toBe(false);
    expect(c.reactionChannels).toEqual(["telegram"]);
  });
});
