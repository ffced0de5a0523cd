// Provider stream wrappers: add X-Session-Id / X-Turn-Type / X-Turn-Id / X-Request-Id to requests of
// the clawback provider only (other providers are never wrapped, so nothing leaks to other hosts).
import type { ProviderWrapStreamFnContext } from "openclaw/plugin-sdk/plugin-entry";
import { classifyRun, parseRequestId, type RunRegistry, type TurnType } from "./runs.js";

export const PROVIDER_ID = "clawback";
/** The session `clawback openclaw install` sends its test turn in (daemon/openclaw.py CHECK_SESSION):
 * its replies are capped at a few tokens, so the check takes seconds on a CPU rather than a whole
 * reply budget. */
export const CHECK_SESSION_KEY = "agent:main:clawback-install-check";
export const CHECK_MAX_TOKENS = 16;

export type WrapCtx = ProviderWrapStreamFnContext;
/** OpenClaw's StreamFn: (model, context, options) => stream. */
export type StreamFn = NonNullable<WrapCtx["streamFn"]>;
export type StreamOptions = NonNullable<Parameters<StreamFn>[2]>;

export type Tags = { sessionId?: string; turnType: TurnType; turnId?: string; requestId?: string };

/** Decide the tags for one agent/compaction call from its options and the per-run registry. */
export function tagsForCall(registry: RunRegistry, options: StreamOptions | undefined): Tags {
  const requestId = options?.requestId || undefined;
  const { runId, compaction } = parseRequestId(requestId);
  const info = registry.get(runId);
  const turnType: TurnType = compaction ? "side" : classifyRun(info);
  const sessionId = options?.sessionId || info?.sessionId || registry.sessionIdForRun(runId);
  return { sessionId, turnType, turnId: runId, requestId };
}

export function headersFor(tags: Tags): Record<string, string> {
  const h: Record<string, string> = { "X-Turn-Type": tags.turnType };
  if (tags.sessionId) h["X-Session-Id"] = tags.sessionId;
  if (tags.turnId) h["X-Turn-Id"] = tags.turnId;
  if (tags.requestId) h["X-Request-Id"] = tags.requestId;
  return h;
}

function withHeaders(options: StreamOptions | undefined, extra: Record<string, string>): StreamOptions {
  return { ...(options ?? {}), headers: { ...(options?.headers ?? {}), ...extra } };
}

/** `wrapStreamFn`: agent turns, tool-loop iterations, compaction summaries. */
export function makeWrapStreamFn(registry: RunRegistry) {
  return (ctx: WrapCtx): StreamFn | undefined => {
    const inner = ctx.streamFn;
    if (!inner || ctx.provider !== PROVIDER_ID) return inner;
    return (model, context, options) => {
      const tags = tagsForCall(registry, options);
      const tagged = withHeaders(options, headersFor(tags));
      if (registry.get(tags.turnId)?.sessionKey === CHECK_SESSION_KEY) {
        tagged.maxTokens = Math.min(Number(options?.maxTokens) || CHECK_MAX_TOKENS, CHECK_MAX_TOKENS);
      }
      return inner(model, context, tagged);
    };
  };
}

/** `wrapSimpleCompletionStreamFn`: titles, recaps, narration — always side. */
export function makeWrapSimpleCompletionStreamFn(registry: RunRegistry) {
  return (ctx: WrapCtx): StreamFn | undefined => {
    const inner = ctx.streamFn;
    if (!inner || ctx.provider !== PROVIDER_ID) return inner;
    return (model, context, options) => {
      const { runId } = parseRequestId(options?.requestId);
      const sessionId = options?.sessionId || registry.sessionIdForRun(runId);
      const tags: Tags = { sessionId, turnType: "side", turnId: runId, requestId: options?.requestId || undefined };
      return inner(model, context, withHeaders(options, headersFor(tags)));
    };
  };
}
