#!/usr/bin/env bash
# Creates bench/peers/.venv-litertlm for the LiteRT-LM peer (never touches litekv's environment).
# Idempotent: an existing venv is reused and nothing is installed when everything already imports.
#
#   bash bench/peers/setup_litertlm.sh
#
# One venv holds both halves (pip resolves them together without conflict):
#   * the runtime:  litert-lm-api (Python bindings + liblitert-lm.so, CPU backend)
#   * the exporter: litert-torch (ex ai-edge-torch) with torch==2.13.0 (the CPU wheel already on this
#     machine's disk, the same torch as litekv's environment) and tensorflow-cpu, which litert-torch's
#     converter imports. It pulls ai-edge-litert, ai-edge-quantizer, litert-lm-builder, transformers.
# Versions are pinned to the ones measured (override with LITERT_LM_VERSION=..., LITERT_TORCH_VERSION=...).
# First install: ~1.5 min and ~2.5 GB (TensorFlow, jax, torch).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/peer_venv.sh"
LITERT_LM_VERSION="${LITERT_LM_VERSION:-0.18.1}"
LITERT_TORCH_VERSION="${LITERT_TORCH_VERSION:-0.10.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TENSORFLOW_VERSION="${TENSORFLOW_VERSION:-2.21.0}"

peer_venv "$HERE/.venv-litertlm" --upgrade-pip

# Every module the runner and the exporter import; if all are installed, there is nothing to do
# (find_spec instead of import: importing TensorFlow alone takes ~15 s).
MODULES="litert_lm litert_lm_builder litert_torch tensorflow torch transformers tokenizers psutil"
if "$PY" -c "import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))" \
        $MODULES; then
    echo "litert-lm-api, litert-torch, tensorflow-cpu, torch already installed"
else
    echo "installing litert-lm-api==$LITERT_LM_VERSION litert-torch==$LITERT_TORCH_VERSION" \
         "torch==$TORCH_VERSION tensorflow-cpu==$TENSORFLOW_VERSION psutil"
    "$PY" -m pip install --quiet \
        "torch==$TORCH_VERSION" \
        "litert-lm-api==$LITERT_LM_VERSION" \
        "litert-torch==$LITERT_TORCH_VERSION" \
        "tensorflow-cpu==$TENSORFLOW_VERSION" \
        psutil
fi

"$PY" - <<'PY'
from importlib.metadata import version
names = ["litert-lm-api", "litert-lm-builder", "litert-torch", "ai-edge-litert", "ai-edge-quantizer",
         "tensorflow-cpu", "torch", "transformers", "tokenizers", "psutil"]
print("litertlm venv ready: " + " | ".join(f"{n} {version(n)}" for n in names))
PY
