#!/usr/bin/env bash
# Creates bench/peers/.venv and installs the peer runtimes into it (never into litekv's environment).
# Idempotent: an existing venv is reused and packages that already import are skipped.
#
#   bash bench/peers/setup.sh
#
# llama-cpp-python has no CPU wheel on PyPI, so pip compiles llama.cpp from source (~6 min on 2 cores).
# Build flags: CMAKE_ARGS="-DGGML_NATIVE=ON" (tuned for this CPU: AVX2/FMA/AVX-512 as present), which is
# also llama.cpp's own default when not cross-compiling; override by exporting CMAKE_ARGS before running.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/peer_venv.sh"
LLAMA_CPP_VERSION="${LLAMA_CPP_VERSION:-0.3.36}"

peer_venv "$HERE/.venv"

has() { "$PY" -c "import $1" >/dev/null 2>&1; }

missing=()
for pkg in gguf numpy psutil; do
    has "$pkg" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing ${missing[*]}"
    "$PY" -m pip install --quiet "${missing[@]}"
else
    echo "gguf, numpy, psutil already installed"
fi

if has llama_cpp; then
    echo "llama-cpp-python already installed ($("$PY" -c 'import llama_cpp; print(llama_cpp.__version__)'))"
else
    export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}"
    export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
    echo "building llama-cpp-python==$LLAMA_CPP_VERSION from source with CMAKE_ARGS=$CMAKE_ARGS (several minutes)"
    "$PY" -m pip install --no-cache-dir "llama-cpp-python==$LLAMA_CPP_VERSION"
fi

"$PY" - <<'PY'
import gguf, llama_cpp, numpy, psutil
print("peer venv ready: llama-cpp-python", llama_cpp.__version__, "| numpy", numpy.__version__,
      "| psutil", psutil.__version__)
PY
