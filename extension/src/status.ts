// GET /v1/status from the daemon (short timeout; undefined when unreachable).
import type { DaemonStatus } from "./wire.js";

export type { DaemonStatus };

export type FetchLike = (url: string, init?: { headers?: Record<string, string>; signal?: AbortSignal }) => Promise<{ ok: boolean; status: number; json(): Promise<unknown> }>;

export async function fetchDaemonStatus(
  daemonUrl: string,
  apiKey: string | undefined,
  timeoutMs = 2000,
  fetchImpl: FetchLike = globalThis.fetch,
): Promise<DaemonStatus | undefined> {
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), timeoutMs);
  try {
    const res = await fetchImpl(`${daemonUrl}/v1/status`, {
      headers: apiKey ? { Authorization: `Bearer ${apiKey}` } : {},
      signal: ctl.signal,
    });
    if (!res.ok) return undefined;
    return (await res.json()) as DaemonStatus;
  } catch {
    return undefined;
  } finally {
    clearTimeout(timer);
  }
}
