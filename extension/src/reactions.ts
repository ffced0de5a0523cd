// Reactions arrive as session system events (no typed hook in 2026.9.6): parse each channel's text /
// contextKey, map the emoji to 👍/👎, and poll the sessions we have seen for new entries.
import type { ClawbackConfig } from "./config.js";
import { stableEventId } from "./ids.js";
import type { FeedbackEvent } from "./outbox.js";
import type { RunRegistry } from "./runs.js";

export type SystemEventEntry = { id?: string | number; text?: string; ts?: number; contextKey?: string };

export type Reaction = {
  channel: string;
  action: "added" | "removed";
  emoji: string;
  messageId?: string;
};

const TEXT_RE = /^(?:System:\s*\[[^\]]*\]\s*)?([A-Za-z][A-Za-z-]*) reaction (added|removed|add|remove)\s*:\s*(\S+)\s+by\b(.*)$/su;
const MSG_RE = /\bmsg\s+(\S+)/u;
const KEY_RE = /^([a-z][a-z0-9-]*):reaction:(add|added|remove|removed)(?::|$)/u;

function normAction(a: string): "added" | "removed" {
  return a.startsWith("add") ? "added" : "removed";
}

/** Strips Slack colons, variation selectors and skin tones so 👍🏽 and :+1: compare equal to 👍 and +1. */
export function normalizeEmoji(e: string): string {
  return e.trim().replace(/^:(.+):$/u, "$1").replace(/[\u{FE0E}\u{FE0F}\u{1F3FB}-\u{1F3FF}]/gu, "").toLowerCase();
}

/** Parses Telegram / Discord / Slack / Signal (and same-shaped Matrix, Mattermost, iMessage, ...) reaction events. */
export function parseReaction(entry: SystemEventEntry): Reaction | undefined {
  const text = (entry.text ?? "").trim();
  const key = entry.contextKey ?? "";
  const t = TEXT_RE.exec(text);
  const k = KEY_RE.exec(key);
  if (!t && !k) return undefined;
  const channel = (k?.[1] ?? t![1]!).toLowerCase();
  const action = normAction(k?.[2] ?? t![2]!);
  let emoji = t?.[3];
  let messageId = t ? MSG_RE.exec(t[4]!)?.[1] : undefined;
  if (k) {
    const parts = key.split(":");
    emoji ??= parts.at(-1);
    if (!messageId) {
      // telegram:reaction:add:<chat>:<msg>:<user>:<emoji>; discord:reaction:<a>:<msg>:<user>:<emoji>;
      // slack:reaction:<a>:<channel>:<ts>:<user>:<emoji>
      if (channel === "discord") messageId = parts[3];
      else if (channel === "telegram" || channel === "slack") messageId = parts[4];
    }
  }
  if (!emoji) return undefined;
  return { channel, action, emoji, ...(messageId ? { messageId } : {}) };
}

export function reactionKind(emoji: string, cfg: Pick<ClawbackConfig, "positiveEmoji" | "negativeEmoji">): "thumbs_up" | "thumbs_down" | undefined {
  const e = normalizeEmoji(emoji);
  if (cfg.negativeEmoji.some((x) => normalizeEmoji(x) === e)) return "thumbs_down";
  if (cfg.positiveEmoji.some((x) => normalizeEmoji(x) === e)) return "thumbs_up";
  return undefined;
}

/** Turns one system-event entry of a session into a feedback event, or undefined when it is not a counted reaction. */
export function reactionToEvent(
  sessionKey: string,
  entry: SystemEventEntry,
  cfg: Pick<ClawbackConfig, "positiveEmoji" | "negativeEmoji" | "reactionChannels">,
  registry: RunRegistry,
): FeedbackEvent | undefined {
  const r = parseReaction(entry);
  if (!r || r.action !== "added" || !cfg.reactionChannels.includes(r.channel)) return undefined;
  const kind = reactionKind(r.emoji, cfg);
  if (!kind) return undefined;
  const sessionId = registry.sessionIdForKey(sessionKey);
  if (!sessionId) return undefined;
  const target = registry.runForMessage(r.channel, r.messageId) ?? registry.lastReply(sessionId)?.runId ?? "last";
  const entryKey = entry.id !== undefined ? String(entry.id) : `${entry.contextKey ?? ""}|${entry.ts ?? ""}|${entry.text ?? ""}`;
  return {
    type: "feedback",
    event_id: stableEventId(`reaction:${sessionKey}:${entryKey}`),
    kind,
    session_id: sessionId,
    target,
    source: r.channel,
    ts: typeof entry.ts === "number" ? (entry.ts > 1e12 ? entry.ts / 1000 : entry.ts) : Date.now() / 1000,
  };
}

export type Peek = (sessionKey: string) => SystemEventEntry[] | undefined;

/** Polls `peekSystemEventEntries` (non-destructive) for every session seen so far; dedupes by entry. */
export class ReactionWatcher {
  private seen = new Set<string>();
  private timer: ReturnType<typeof setInterval> | undefined;

  constructor(
    private readonly peek: Peek,
    private readonly registry: RunRegistry,
    private readonly cfg: ClawbackConfig,
    private readonly emit: (e: FeedbackEvent) => void,
    private readonly logger: { warn: (m: string) => void; info: (m: string) => void },
  ) {}

  /** One pass; returns how many feedback events were emitted. */
  poll(): number {
    let n = 0;
    for (const sessionKey of this.registry.seenSessionKeys) {
      let entries: SystemEventEntry[] | undefined;
      try {
        entries = this.peek(sessionKey);
      } catch (e) {
        this.logger.warn(`clawback: cannot read system events of ${sessionKey}: ${String(e)}`);
        continue;
      }
      for (const entry of entries ?? []) {
        const dedupe = `${sessionKey}|${entry.id ?? `${entry.contextKey}|${entry.ts}|${entry.text}`}`;
        if (this.seen.has(dedupe)) continue;
        const event = reactionToEvent(sessionKey, entry, this.cfg, this.registry);
        if (!event && parseReaction(entry) && !this.registry.sessionIdForKey(sessionKey)) continue; // retry once the session id is known
        this.seen.add(dedupe);
        if (this.seen.size > 20_000) this.seen.delete(this.seen.values().next().value as string);
        if (event) {
          this.logger.info(`clawback: ${event.source} reaction → ${event.kind} (session ${event.session_id}, target ${event.target})`);
          this.emit(event);
          n++;
        }
      }
    }
    return n;
  }

  start(): void {
    if (this.timer) return;
    this.timer = setInterval(() => this.poll(), this.cfg.pollIntervalMs);
    (this.timer as { unref?: () => void }).unref?.();
  }

  stop(): void {
    clearInterval(this.timer);
    this.timer = undefined;
  }
}
