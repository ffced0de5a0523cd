// Plugin config: defaults, validation-light normalisation, and the API key (inline or from a file).
import { readFileSync } from "node:fs";
import { homedir } from "node:os";

export const DEFAULT_DAEMON_URL = "http://127.0.0.1:30000";
export const DEFAULT_REACTION_CHANNELS = ["telegram", "discord", "slack", "signal"] as const;
export const DEFAULT_POSITIVE = ["👍", "❤️", "❤", "🔥", "+1", "thumbsup", "thumbs_up", "heart", "fire"];
export const DEFAULT_NEGATIVE = ["👎", "-1", "thumbsdown", "thumbs_down"];

export type ClawbackConfig = {
  daemonUrl: string;
  apiKey: string | undefined;
  reactions: boolean;
  reactionChannels: string[];
  positiveEmoji: string[];
  negativeEmoji: string[];
  commands: boolean;
  pollIntervalMs: number;
};

export type RawConfig = {
  daemonUrl?: string;
  apiKey?: string;
  apiKeyFile?: string;
  reactions?: { enabled?: boolean; channels?: string[]; positive?: string[]; negative?: string[] };
  commands?: { enabled?: boolean };
  pollIntervalMs?: number;
};

function expandHome(p: string): string {
  return p === "~" || p.startsWith("~/") ? homedir() + p.slice(1) : p;
}

/** Reads the key now: an inline `apiKey` wins, else the first line of `apiKeyFile` (missing file = no key). */
export function readApiKey(raw: RawConfig, read: (p: string) => string = (p) => readFileSync(p, "utf8")): string | undefined {
  if (raw.apiKey && raw.apiKey.trim()) return raw.apiKey.trim();
  if (!raw.apiKeyFile) return undefined;
  try {
    const key = read(expandHome(raw.apiKeyFile)).split(/\r?\n/)[0]?.trim();
    return key || undefined;
  } catch {
    return undefined;
  }
}

export function resolveConfig(input: unknown, read?: (p: string) => string): ClawbackConfig {
  const raw = (input && typeof input === "object" ? input : {}) as RawConfig;
  const url = (raw.daemonUrl ?? DEFAULT_DAEMON_URL).trim().replace(/\/+$/, "").replace(/\/v1$/, "");
  return {
    daemonUrl: url || DEFAULT_DAEMON_URL,
    apiKey: readApiKey(raw, read),
    reactions: raw.reactions?.enabled ?? true,
    reactionChannels: (raw.reactions?.channels ?? [...DEFAULT_REACTION_CHANNELS]).map((c) => c.toLowerCase()),
    positiveEmoji: raw.reactions?.positive ?? DEFAULT_POSITIVE,
    negativeEmoji: raw.reactions?.negative ?? DEFAULT_NEGATIVE,
    commands: raw.commands?.enabled ?? true,
    pollIntervalMs: Math.max(100, raw.pollIntervalMs ?? 1000),
  };
}

/** `http://h:p` → `ws://h:p/v1/feedback/ws` (https → wss). */
export function feedbackWsUrl(daemonUrl: string): string {
  return daemonUrl.replace(/^http/, "ws") + "/v1/feedback/ws";
}
