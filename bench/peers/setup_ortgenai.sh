#!/usr/bin/env bash
# Creates bench/peers/.venv-ortgenai and installs onnxruntime-genai plus its model builder's
# dependencies into it (never into litekv's environment, nor into the llama.cpp peer venv).
# Idempotent: an existing venv is reused and packages already at the pinned version are skipped.
#
#   bash bench/peers/setup_ortgenai.sh
#
# A venv of its own because the model builder (python -m onnxruntime_genai.models.builder) imports
# torch, transformers, onnx and onnx_ir, and because onnxruntime-genai pins the onnxruntime it loads;
# keeping it apart means neither the main interpreter's onnxruntime nor llama-cpp-python's numpy is touched.
# torch is the CPU wheel (~40 s to install from the local wheel); the rest are pure-Python or small wheels.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/peer_venv.sh"
ORTGENAI_VERSION="${ORTGENAI_VERSION:-0.18.0}"

peer_venv "$HERE/.venv-ortgenai"

# Pins: the runtime, and the builder's dependencies at the versions this peer was built and checked with
# (torch/transformers match the main interpreter's, so the HF export is read by the same transformers).
REQUIREMENTS=(
    "onnxruntime-genai==$ORTGENAI_VERSION"
    "torch==2.13.0"
    "transformers==5.23.0"
    "onnx==1.23.2"
    "onnx-ir==1.1.0"
    "safetensors"
    "tqdm"
    "numpy"
    "psutil"
)

# pip's own resolver decides what is missing; with everything present it only checks (a few seconds).
if "$PY" - "${REQUIREMENTS[@]}" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
missing = []
for spec in sys.argv[1:]:
    name, _, pinned = spec.partition("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        missing.append(spec)
        continue
    if pinned and have.split("+")[0] != pinned:
        missing.append(spec)
sys.exit(1 if missing else 0)
PY
then
    echo "all packages already installed"
else
    echo "installing ${REQUIREMENTS[*]}"
    "$PY" -m pip install --quiet "${REQUIREMENTS[@]}"
fi

"$PY" - <<'PY'
import numpy, onnx, onnxruntime, onnxruntime_genai, psutil, torch, transformers
import onnxruntime_genai.models.builder  # noqa: F401  (the builder's imports all resolve)
print("ortgenai venv ready: onnxruntime-genai", onnxruntime_genai.__version__, "| onnxruntime", onnxruntime.__version__,
      "| torch", torch.__version__, "| transformers", transformers.__version__, "| onnx", onnx.__version__,
      "| numpy", numpy.__version__)
PY
