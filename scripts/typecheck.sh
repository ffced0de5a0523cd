#!/usr/bin/env bash
# Lint (ruff) and type-check (pyright, standard mode) the Python code; run by `install.sh --test`.
# pyright cannot follow setuptools' package-dir mapping (clawback.daemon lives in daemon/), so
# imports resolve through build/typecheck: the installed layout as symlinks, remade on every run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
tree=build/typecheck/clawback
rm -rf build/typecheck && mkdir -p "$tree"
for f in clawback/*.py; do ln -s "../../../$f" "$tree/"; done
for d in daemon trainer judge sim; do ln -s "../../../$d" "$tree/$d"; done
"$PY" -m ruff check .
"$PY" -m pyright
