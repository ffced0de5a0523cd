#!/usr/bin/env bash
# Install the clawback extension into an existing OpenClaw and point a `clawback` provider at the daemon.
# Every step is printed; nothing already configured is replaced without saying so.
#
#   extension/scripts/install-into-openclaw.sh [--daemon-url URL] [--api-key-file PATH]
#       [--make-default | --no-default] [--slim | --no-slim] [--yes] [--openclaw "CMD"]
#
# --openclaw    how to run the OpenClaw CLI (default: `openclaw`; e.g. "node /path/openclaw.mjs")
# --daemon-url  the clawback daemon (default http://127.0.0.1:30000)
# --api-key-file  the daemon's key file (default ~/.clawback/api_key; skipped when absent: --no-auth daemon)
# --make-default  make clawback/<model> the default agent model (asked when interactive)
# --slim        the small-context profile (offered when the daemon's model has < 16K context)
# --model-id ID --context-window N  used only when the daemon is not running (normally both come
#               from its /v1/models)
# --max-tokens  the reply length cap for the model entry (default: context/8, 256..4096)
# --yes         non-interactive: take the defaults (no default-model change; slim profile on when needed)
set -euo pipefail

EXT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OPENCLAW="${OPENCLAW:-openclaw}"
DAEMON_URL="${CLAWBACK_URL:-http://127.0.0.1:30000}"
KEY_FILE="${CLAWBACK_API_KEY_FILE:-$HOME/.clawback/api_key}"
MAKE_DEFAULT=""
SLIM=""
MAX_TOKENS=0
FALLBACK_ID=""
FALLBACK_CTX=""
YES=0

while [ $# -gt 0 ]; do
  case "$1" in
    --openclaw) OPENCLAW="$2"; shift 2 ;;
    --daemon-url) DAEMON_URL="$2"; shift 2 ;;
    --api-key-file) KEY_FILE="$2"; shift 2 ;;
    --make-default) MAKE_DEFAULT=yes; shift ;;
    --no-default) MAKE_DEFAULT=no; shift ;;
    --slim) SLIM=yes; shift ;;
    --no-slim) SLIM=no; shift ;;
    --max-tokens) MAX_TOKENS="$2"; shift 2 ;;
    --model-id) FALLBACK_ID="$2"; shift 2 ;;
    --context-window) FALLBACK_CTX="$2"; shift 2 ;;
    --yes|-y) YES=1; shift ;;
    -h|--help) sed -n 2,19p "$0"; exit 0 ;;
    *) echo "unknown option: $1" >&2; exit 2 ;;
  esac
done
DAEMON_URL="${DAEMON_URL%/}"; DAEMON_URL="${DAEMON_URL%/v1}"

say() { printf '[clawback] %s\n' "$*"; }
oc() { $OPENCLAW "$@"; }
ask() { # ask "question" default(y|n) -> 0 for yes
  local q="$1" def="$2" a
  if [ "$YES" = 1 ] || [ ! -t 0 ]; then [ "$def" = y ]; return; fi
  read -r -p "[clawback] $q [$([ "$def" = y ] && echo Y/n || echo y/N)] " a || true
  a="${a:-$def}"; [[ "$a" =~ ^[Yy] ]]
}

say "step 1/5: checking the OpenClaw CLI ($OPENCLAW)"
if ! oc --version >/dev/null 2>&1; then
  say "the OpenClaw CLI is not runnable; install OpenClaw (Node >= 24.16) first, or pass --openclaw \"node /path/to/openclaw.mjs\""
  exit 1
fi
say "  $(oc --version 2>/dev/null | tail -n 1)"

say "step 2/5: asking the daemon at $DAEMON_URL which model it serves"
API_KEY=""
if [ -f "$KEY_FILE" ]; then API_KEY="$(head -n 1 "$KEY_FILE" | tr -d '[:space:]')"; else say "  no key file at $KEY_FILE: assuming a --no-auth daemon"; KEY_FILE=""; fi
MODELS_JSON="$(python3 - "$DAEMON_URL" "$API_KEY" <<'PY'
import json, sys, urllib.request
url, key = sys.argv[1], sys.argv[2]
req = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
try:
    data = json.load(urllib.request.urlopen(req, timeout=10))["data"][0]
except Exception as e:  # noqa: BLE001
    print(f"ERROR {e}")
    sys.exit(0)
print(json.dumps({"id": data["id"], "context_length": int(data.get("context_length") or 0)}))
PY
)"
case "$MODELS_JSON" in
  ERROR*)
    if [ -n "$FALLBACK_ID" ] && [ -n "$FALLBACK_CTX" ]; then
      say "  the daemon is not running (${MODELS_JSON#ERROR }); using --model-id $FALLBACK_ID --context-window $FALLBACK_CTX"
      MODELS_JSON="{\"id\": \"$FALLBACK_ID\", \"context_length\": $FALLBACK_CTX}"
    else
      say "  the daemon did not answer (${MODELS_JSON#ERROR }); start it with \`clawback serve\` (or pass --model-id and --context-window) and run this again"
      exit 1
    fi ;;
esac
MODEL_ID="$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["id"])' "$MODELS_JSON")"
CTX="$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["context_length"])' "$MODELS_JSON")"
say "  model $MODEL_ID, context window $CTX tokens"

say "step 3/5: linking the plugin: openclaw plugins install --link $EXT_DIR --force --accept-capabilities"
oc plugins install --link "$EXT_DIR" --force --accept-capabilities

say "step 4/5: configuring plugins.entries.clawback and models.providers.clawback"
existing="$(oc config get models.providers.clawback --json 2>/dev/null || true)"
if printf '%s' "$existing" | grep -q baseUrl; then say "  replacing the existing models.providers.clawback entry"; fi
if [ -z "$MAKE_DEFAULT" ]; then
  if ask "make clawback/$MODEL_ID the default model for your agents?" n; then MAKE_DEFAULT=yes; else MAKE_DEFAULT=no; fi
fi
if [ -z "$SLIM" ]; then
  SLIM=no
  if [ "$CTX" -gt 0 ] && [ "$CTX" -lt 16384 ]; then
    say "  this model has $CTX tokens of context; a default OpenClaw main request is about 13K tokens."
    say "  the slim profile turns off: all skills (agents.defaults.skills: []), all tools (tools.deny: [\"*\"]),"
    say "  and trims workspace bootstrap files to 500 chars each / 1000 in total."
    if ask "apply the slim profile?" y; then SLIM=yes; fi
  fi
fi
PATCH="$(python3 - "$DAEMON_URL" "$API_KEY" "$KEY_FILE" "$MODEL_ID" "$CTX" "$MAKE_DEFAULT" "$SLIM" "$MAX_TOKENS" <<'PY'
import json, sys
url, key, key_file, model, ctx, make_default, slim, max_tokens = sys.argv[1:9]
ctx = int(ctx) or 8192
max_tokens = int(max_tokens) or min(4096, max(256, ctx // 8))
provider = {
    "baseUrl": url + "/v1", "api": "openai-completions", "apiKey": key or "no-auth",
    "models": [{"id": model, "name": f"clawback {model}", "reasoning": False, "input": ["text"],
                "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                "contextWindow": ctx, "maxTokens": max_tokens}],
}
cfg = {"daemonUrl": url}
if key_file:
    cfg["apiKeyFile"] = key_file
patch = {
    "plugins": {"entries": {"clawback": {"enabled": True, "hooks": {"allowConversationAccess": True}, "config": cfg}}},
    "models": {"providers": {"clawback": provider}},
}
if make_default == "yes":
    patch.setdefault("agents", {}).setdefault("defaults", {})["model"] = {"primary": f"clawback/{model}"}
if slim == "yes":
    d = patch.setdefault("agents", {}).setdefault("defaults", {})
    d.update({"skills": [], "bootstrapMaxChars": 500, "bootstrapTotalMaxChars": 1000})
    patch["tools"] = {"deny": ["*"]}
print(json.dumps(patch))
PY
)"
if [ "$MAKE_DEFAULT" = yes ]; then
  prev="$(oc config get agents.defaults.model.primary 2>/dev/null | tail -n 1 || true)"
  say "  default model → clawback/$MODEL_ID (was: ${prev:-unset})"
fi
[ "$SLIM" = yes ] && say "  applying the slim profile (skills, tools off; bootstrap 500/1000 chars)"
printf '%s' "$PATCH" | oc config patch --stdin

say "step 5/5: validating"
oc config validate
say "done. Restart the gateway (openclaw gateway restart) to load clawback; then /clawback in any chat shows its status."
