// GET /v1/status from the daemon (short timeout; undefined when unreachable).
export type DaemonStatus = {
  adapter_version?: string | null;
  training?: { samples_ready?: number; batch_size?: number; last_step?: number | null };
  // active: injected while the live version serves; retired_by: the version that made it redundant.
  memory?: { enabled?: boolean; notes?: { note_id: number; text: string; active?: boolean; retired_by?: number | null }[] };
  // The candidate gate: the version under review, and the newest version's fate.
  gate?: { reviewing?: number | null; newest?: { version: number; state: string; reason?: string | null } | null };
  [k: string]: unknown;
};

export type FetchLike = (url: string, init?: { headers?: Record<string, string>; signal?: AbortSignal }) => Promise<{ ok: boolean; status: number; json(): Promise<unknown> }>;

export async function fetchDaemonStatus(
  daemonUrl: string,
  apiKey: string | undefined,
  timeoutMs = 2000,
  fetchImpl: FetchLike = globalThis.fetch as unknown as FetchLike,
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
