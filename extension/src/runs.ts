// Per-run state (keyed by run id, never a module-global "current"), main/side classification,
// and the per-session "last reply" pointers that feedback targets.

export type TurnType = "main" | "side";

export type InputProvenance = { kind?: string; sourceRole?: string } | undefined;

export type RunInfo = {
  runId: string;
  trigger?: string;
  sessionKey?: string;
  sessionId?: string;
  inputProvenance?: InputProvenance;
  channel?: string;
  startedAt: number;
};

/** The reference's rule: main only for a user-triggered run in a user session with external (or no) provenance. */
export function classifyRun(info: Pick<RunInfo, "trigger" | "sessionKey" | "inputProvenance"> | undefined): TurnType {
  if (!info) return "side";
  if (info.trigger !== "user") return "side";
  const key = info.sessionKey ?? "";
  if (key.includes(":subagent:") || key.includes(":active-memory:") || key.includes("cron:")) return "side";
  const kind = info.inputProvenance?.kind;
  if (kind !== undefined && kind !== "external_user") return "side";
  return "main";
}

/** `<runId>:model:<n>` → runId; `<runId>:compaction:<diag>:model:<n>` → runId (compaction flagged). */
export function parseRequestId(requestId: string | undefined): { runId?: string; compaction: boolean } {
  if (!requestId) return { compaction: false };
  const compaction = requestId.includes(":compaction:");
  let runId = requestId;
  const c = requestId.indexOf(":compaction:");
  const m = requestId.indexOf(":model:");
  if (c >= 0) runId = requestId.slice(0, c);
  else if (m >= 0) runId = requestId.slice(0, m);
  return { runId: runId || undefined, compaction };
}

export type LastReply = { runId: string; at: number };

/** Bounded maps: a long-lived gateway must not grow without limit. */
const MAX_RUNS = 2048;
const MAX_SESSIONS = 4096;
const MAX_MESSAGES = 8192;

function trim<K, V>(m: Map<K, V>, max: number): void {
  while (m.size > max) {
    const first = m.keys().next();
    if (first.done) break;
    m.delete(first.value);
  }
}

export class RunRegistry {
  private runs = new Map<string, RunInfo>();
  /** sessionId → last main run whose reply the person saw. */
  private lastReplyBySession = new Map<string, LastReply>();
  /** sessionKey → sessionId seen most recently for it. */
  private sessionIdByKey = new Map<string, string>();
  /** `${channel}:${messageId}` → run id of the reply that carried the message. */
  private runByMessage = new Map<string, string>();
  /** runId → sessionId, kept after agent_end so late hooks (message_sent) can still map. */
  private sessionByRun = new Map<string, string>();
  /** Session keys whose system-event queue the reaction poller watches. */
  readonly seenSessionKeys = new Set<string>();

  start(info: Omit<RunInfo, "startedAt">, now = Date.now()): RunInfo {
    const prev = this.runs.get(info.runId);
    const merged: RunInfo = { ...prev, ...stripUndefined(info), startedAt: prev?.startedAt ?? now } as RunInfo;
    this.runs.set(info.runId, merged);
    trim(this.runs, MAX_RUNS);
    if (merged.sessionId) {
      this.sessionByRun.set(info.runId, merged.sessionId);
      trim(this.sessionByRun, MAX_RUNS);
    }
    if (merged.sessionKey) {
      this.noteSessionKey(merged.sessionKey, merged.sessionId);
    }
    return merged;
  }

  get(runId: string | undefined): RunInfo | undefined {
    return runId ? this.runs.get(runId) : undefined;
  }

  /** agent_end: a successful main run becomes the session's last reply; the run's state is dropped. */
  end(runId: string | undefined, ok = true, now = Date.now()): RunInfo | undefined {
    if (!runId) return undefined;
    const info = this.runs.get(runId);
    this.runs.delete(runId);
    if (info && ok && info.sessionId && classifyRun(info) === "main") {
      this.lastReplyBySession.delete(info.sessionId);
      this.lastReplyBySession.set(info.sessionId, { runId, at: now });
      trim(this.lastReplyBySession, MAX_SESSIONS);
    }
    return info;
  }

  activeRunCount(): number {
    return this.runs.size;
  }

  lastReply(sessionId: string | undefined): LastReply | undefined {
    return sessionId ? this.lastReplyBySession.get(sessionId) : undefined;
  }

  noteSessionKey(sessionKey: string, sessionId?: string): void {
    this.seenSessionKeys.add(sessionKey);
    if (sessionId) {
      this.sessionIdByKey.delete(sessionKey);
      this.sessionIdByKey.set(sessionKey, sessionId);
      trim(this.sessionIdByKey, MAX_SESSIONS);
    }
  }

  sessionIdForKey(sessionKey: string | undefined): string | undefined {
    return sessionKey ? this.sessionIdByKey.get(sessionKey) : undefined;
  }

  sessionIdForRun(runId: string | undefined): string | undefined {
    return runId ? this.sessionByRun.get(runId) ?? this.runs.get(runId)?.sessionId : undefined;
  }

  noteMessage(channel: string | undefined, messageId: string | undefined, runId: string | undefined): void {
    if (!messageId || !runId) return;
    this.runByMessage.set(`${(channel ?? "").toLowerCase()}:${messageId}`, runId);
    trim(this.runByMessage, MAX_MESSAGES);
  }

  runForMessage(channel: string | undefined, messageId: string | undefined): string | undefined {
    if (!messageId) return undefined;
    return this.runByMessage.get(`${(channel ?? "").toLowerCase()}:${messageId}`);
  }

  /** After a compaction rotation the conversation continues under the new id. */
  rotateSession(from: string, to: string): void {
    const last = this.lastReplyBySession.get(from);
    if (last && !this.lastReplyBySession.has(to)) this.lastReplyBySession.set(to, last);
    for (const [k, v] of this.sessionIdByKey) if (v === from) this.sessionIdByKey.set(k, to);
  }
}

function stripUndefined<T extends object>(o: T): Partial<T> {
  return Object.fromEntries(Object.entries(o).filter(([, v]) => v !== undefined)) as Partial<T>;
}
