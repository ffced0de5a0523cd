#!/usr/bin/env bash
# Lint (ruff) and type-check (pyright, standard mode) the Python code; run by `install.sh --test`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m ruff check .
"$PY" -m pyright
