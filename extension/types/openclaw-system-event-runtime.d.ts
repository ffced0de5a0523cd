// openclaw@2026.9.6 ships no .d.ts for this subpath; the shape below was verified against its dist.
declare module "openclaw/plugin-sdk/system-event-runtime" {
  export type SystemEventEntry = { id?: string | number; text?: string; ts?: number; contextKey?: string; sessionStorePath?: string };
  export function peekSystemEventEntries(sessionKey: string, agentId?: string): SystemEventEntry[];
}
