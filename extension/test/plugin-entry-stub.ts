// Vitest stand-in for openclaw/plugin-sdk/plugin-entry (the real one is used by the end-to-end test).
export function definePluginEntry<T extends { register: (api: unknown) => void }>(entry: T): T {
  return entry;
}
