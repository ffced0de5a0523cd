// One WebSocket to the daemon's /v1/feedback/ws: auth frame, resend of everything unacked after each
// (re)connect, reconnect with capped exponential backoff, status pushes kept for /clawback.
import type { PluginLogger } from "openclaw/plugin-sdk/plugin-entry";
import type { FeedbackEvent, Outbox } from "./outbox.js";
import type { Ack, DaemonFrame, ErrorFrame } from "./wire.js";

export type Logger = PluginLogger;

/** The part of the WHATWG WebSocket the client uses (Node 24's global WebSocket, or a test fake). */
export interface WsLike {
  readonly readyState: number;
  send(data: string): void;
  close(code?: number, reason?: string): void;
  onopen: ((ev: unknown) => void) | null;
  onmessage: ((ev: { data: unknown }) => void) | null;
  onclose: ((ev: { code?: number; reason?: string }) => void) | null;
  onerror: ((ev: unknown) => void) | null;
}
export type WsFactory = (url: string) => WsLike;

export type AckOutcome = { status: Ack["status"] | "orphan"; callId?: string; reason?: string };

export type ClientOptions = {
  url: string;
  apiKey: () => string | undefined;
  outbox: Outbox;
  logger: Logger;
  wsFactory?: WsFactory;
  initialBackoffMs?: number;
  maxBackoffMs?: number;
  retryBusyMs?: number;
  pingIntervalMs?: number;
  random?: () => number;
};

const OPEN = 1;

export class FeedbackClient {
  private ws: WsLike | undefined;
  private ready = false;
  private stopped = true;
  private attempt = 0;
  private reconnectTimer: ReturnType<typeof setTimeout> | undefined;
  private retryTimer: ReturnType<typeof setTimeout> | undefined;
  private pingTimer: ReturnType<typeof setInterval> | undefined;
  private lastFrameAt = 0;
  private inFlight = new Set<string>();
  private waiters = new Map<string, Array<(o: AckOutcome | undefined) => void>>();
  readonly outcomes = new Map<string, AckOutcome>();
  adapterVersion: string | null | undefined = undefined;
  lastPushes: DaemonFrame[] = [];
  connects = 0;

  constructor(private readonly opts: ClientOptions) {}

  get connected(): boolean {
    return this.ready;
  }

  get pending(): number {
    return this.opts.outbox.size;
  }

  start(): void {
    if (!this.stopped) return;
    this.stopped = false;
    this.connect();
  }

  stop(): void {
    this.stopped = true;
    clearTimeout(this.reconnectTimer);
    clearTimeout(this.retryTimer);
    clearInterval(this.pingTimer);
    const ws = this.ws;
    this.ws = undefined;
    this.ready = false;
    this.inFlight.clear();
    try {
      ws?.close(1000, "plugin stopping");
    } catch {
      /* already closed */
    }
    for (const [id, ws] of this.waiters) {
      this.waiters.delete(id);
      for (const w of ws) w(undefined);
    }
  }

  /** Durably queues the event, then sends it if the socket is up. */
  enqueue(event: FeedbackEvent): void {
    this.opts.outbox.add(event);
    this.flush();
  }

  /** Resolves with the daemon's answer, or undefined after timeoutMs (the event stays queued). */
  waitForAck(eventId: string, timeoutMs: number): Promise<AckOutcome | undefined> {
    const known = this.outcomes.get(eventId);
    if (known) return Promise.resolve(known);
    return new Promise((resolve) => {
      const timer = setTimeout(() => finish(undefined), timeoutMs);
      const finish = (o: AckOutcome | undefined) => {
        clearTimeout(timer);
        const list = this.waiters.get(eventId)?.filter((w) => w !== finish) ?? [];
        if (list.length) this.waiters.set(eventId, list);
        else this.waiters.delete(eventId);
        resolve(o);
      };
      this.waiters.set(eventId, [...(this.waiters.get(eventId) ?? []), finish]);
    });
  }

  private factory(): WsFactory {
    if (this.opts.wsFactory) return this.opts.wsFactory;
    const Ctor = (globalThis as { WebSocket?: new (url: string) => WsLike }).WebSocket;
    if (!Ctor) throw new Error("no global WebSocket (Node >= 22 is required)");
    return (url) => new Ctor(url);
  }

  private connect(): void {
    if (this.stopped) return;
    let ws: WsLike;
    try {
      ws = this.factory()(this.opts.url);
    } catch (e) {
      this.opts.logger.warn(`clawback: cannot open ${this.opts.url}: ${String(e)}`);
      this.scheduleReconnect();
      return;
    }
    this.ws = ws;
    this.ready = false;
    this.inFlight.clear();
    ws.onopen = () => {
      this.lastFrameAt = Date.now();
      const key = this.opts.apiKey();
      if (key) ws.send(JSON.stringify({ type: "auth", api_key: key }));
    };
    ws.onmessage = (ev) => {
      if (this.ws !== ws) return;
      this.lastFrameAt = Date.now();
      this.onFrame(typeof ev.data === "string" ? ev.data : String(ev.data));
    };
    ws.onerror = () => {
      /* a close follows; logged there */
    };
    ws.onclose = (ev) => {
      if (this.ws !== ws) return;
      this.ws = undefined;
      const was = this.ready;
      this.ready = false;
      this.inFlight.clear();
      clearInterval(this.pingTimer);
      if (was) this.opts.logger.warn(`clawback: daemon socket closed (${ev?.code ?? "?"}); ${this.pending} event(s) queued`);
      this.scheduleReconnect();
    };
  }

  private scheduleReconnect(): void {
    if (this.stopped) return;
    clearTimeout(this.reconnectTimer);
    const base = this.opts.initialBackoffMs ?? 500;
    const max = this.opts.maxBackoffMs ?? 30_000;
    const exp = Math.min(max, base * 2 ** Math.min(this.attempt, 16));
    const delay = Math.round(exp * (0.5 + 0.5 * (this.opts.random ?? Math.random)()));
    this.attempt++;
    this.reconnectTimer = setTimeout(() => this.connect(), delay);
  }

  private onFrame(text: string): void {
    let f: DaemonFrame;
    try {
      f = JSON.parse(text) as DaemonFrame; // as the daemon's models (wire.ts) say; tests/test_wire_schema.py holds it to that
    } catch {
      this.opts.logger.warn(`clawback: unreadable frame from daemon: ${text.slice(0, 200)}`);
      return;
    }
    switch (f.type) {
      case "hello":
        this.ready = true;
        this.attempt = 0;
        this.connects++;
        this.adapterVersion = f.adapter_version ?? null;
        this.opts.logger.info(`clawback: connected to daemon (adapter ${this.adapterVersion ?? "base"}); resending ${this.pending} queued event(s)`);
        this.startPing();
        this.flush();
        return;
      case "auth_ok":
      case "pong":
        return;
      case "ack":
        this.settle(f.event_id, { status: f.status, callId: f.call_id });
        return;
      case "error":
        this.onError(f);
        return;
      case "adapter_live":
        this.adapterVersion = f.version ?? null;
        this.opts.logger.info(`clawback: adapter ${this.adapterVersion ?? "base"} is live`);
        this.remember(f);
        return;
      case "trained":
        this.opts.logger.info(`clawback: trained adapter ${f.version} on ${f.samples} samples (mean reward ${f.mean_reward})`);
        this.remember(f);
        return;
      case "sample_ready":
        this.opts.logger.debug?.(`clawback: sample ready for ${f.call_id} (reward ${f.reward})`);
        this.remember(f);
        return;
      default:
        this.remember(f);
    }
  }

  private remember(f: DaemonFrame): void {
    this.lastPushes.push(f);
    if (this.lastPushes.length > 20) this.lastPushes.shift();
  }

  private onError(f: ErrorFrame): void {
    const id = f.event_id;
    const code = f.code;
    if (code === "orphan" && f.stored === true && id) {
      this.settle(id, { status: "orphan", reason: f.reason });
      return;
    }
    if (code === "unauthorized") {
      this.opts.logger.error(`clawback: the daemon refused the API key (${f.message}); set plugins.entries.clawback.config.apiKey or apiKeyFile`);
      return; // the daemon closes the socket; we retry with backoff (the key file may be fixed meanwhile)
    }
    if (!id) {
      this.opts.logger.warn(`clawback: daemon error ${code}: ${f.message}`);
      return;
    }
    if (code === "malformed") {
      // Nothing was stored and resending cannot help: drop it rather than block the queue forever.
      this.opts.logger.error(`clawback: daemon rejected event ${id} as malformed: ${f.message}`);
      this.opts.outbox.done(id, "malformed");
      this.inFlight.delete(id);
      this.wake(id, undefined);
      return;
    }
    // busy / store_error: not stored; send again later.
    this.inFlight.delete(id);
    clearTimeout(this.retryTimer);
    this.retryTimer = setTimeout(() => this.flush(), this.opts.retryBusyMs ?? 1000);
  }

  private settle(id: string, outcome: AckOutcome): void {
    this.inFlight.delete(id);
    this.opts.outbox.done(id, outcome.status);
    this.outcomes.set(id, outcome);
    if (this.outcomes.size > 1000) this.outcomes.delete(this.outcomes.keys().next().value as string);
    this.wake(id, outcome);
  }

  private wake(id: string, outcome: AckOutcome | undefined): void {
    for (const w of this.waiters.get(id) ?? []) w(outcome);
  }

  private flush(): void {
    const ws = this.ws;
    if (!ws || !this.ready || ws.readyState !== OPEN) return;
    for (const event of this.opts.outbox.list()) {
      if (this.inFlight.has(event.event_id)) continue;
      try {
        ws.send(JSON.stringify(event));
        this.inFlight.add(event.event_id);
      } catch (e) {
        this.opts.logger.warn(`clawback: send failed (${String(e)}); will resend after reconnect`);
        return;
      }
    }
  }

  private startPing(): void {
    clearInterval(this.pingTimer);
    const every = this.opts.pingIntervalMs ?? 25_000;
    this.pingTimer = setInterval(() => {
      const ws = this.ws;
      if (!ws || ws.readyState !== OPEN) return;
      if (Date.now() - this.lastFrameAt > every * 3) {
        this.opts.logger.warn("clawback: daemon socket silent; reconnecting");
        try {
          ws.close(4000, "silent");
        } catch {
          /* ignore */
        }
        return;
      }
      try {
        ws.send(JSON.stringify({ type: "ping" }));
      } catch {
        /* the close handler reconnects */
      }
    }, every);
    (this.pingTimer as { unref?: () => void }).unref?.();
  }
}
