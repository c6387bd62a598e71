"""LITEKV_MAX_ISA caps the instruction sets litekv's kernels use (kernels/cpu_isa.c), as oneDNN's
ONEDNN_MAX_CPU_ISA does: "avx2" makes an AVX-512 machine take every AVX2 path, so their tests run here
instead of skipping; "baseline" leaves the portable code. The library reads it once, as it loads, so
each case runs in a process of its own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpu_flags import cpu_flags
from litekv import native_attention

ROOT = Path(__file__).resolve().parent.parent
# The tests of the AVX2 paths, which skip on a CPU with AVX-512 (decode and prefill attention, key
# blocks), and the linears', whose integer path is VNNI's there.
AVX2_TEST_FILES = ("tests/test_decode_attention_kernel.py", "tests/test_key_blocks.py",
                   "tests/test_prefill_attention_kernel.py", "tests/test_onnx_decode_attention.py",
                   "tests/test_decode_linears.py", "tests/test_onnx_linears.py")


FLAGS = cpu_flags(capped=False)  # the CPU's own
kernels = pytest.mark.skipif(not native_attention.available(), reason="the cap is on litekv's kernels")
avx512 = pytest.mark.skipif("avx512f" not in FLAGS, reason="no AVX-512 on this CPU: the kernel tests take its AVX2 "
                            "paths natively there (where it has AVX2), without LITEKV_MAX_ISA")
avx2 = pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= FLAGS, reason="this CPU has no AVX2 + FMA + F16C paths")


def run(code: str, max_isa: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`code` in a Python of its own with LITEKV_MAX_ISA=max_isa."""
    env = {**os.environ, "LITEKV_MAX_ISA": max_isa}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


# The paths a process reports; the cap is read as the library loads, so changing it after does nothing.
PATHS = """
import json, os
from litekv import native_attention
assert native_attention.available()
os.environ["LITEKV_MAX_ISA"] = "avx512"
print(json.dumps([native_attention.cpu_paths(), native_attention.int8_dot_available()]))
"""


@kernels
@avx2
def test_an_avx2_cap_reports_the_avx2_paths():
    done = run(PATHS, "avx2")
    assert done.returncode == 0, done.stderr
    paths, int8_dot = json.loads(done.stdout)
    assert paths == {"linears": "avx2", "decode_attention": "avx2", "prefill_attention": "avx2"}
    assert int8_dot  # vpmaddwd


@kernels
def test_a_baseline_cap_reports_the_portable_code():
    """The linears' portable loops, and the attention's portable code ("vector": GCC vector
    extensions, whose target clones still follow the CPU itself)."""
    done = run(PATHS, " Baseline ")  # case and blanks do not matter
    assert done.returncode == 0, done.stderr
    paths, int8_dot = json.loads(done.stdout)
    assert paths == {"linears": "portable", "decode_attention": "vector", "prefill_attention": "vector"}
    assert not int8_dot


def test_an_unknown_cap_is_a_config_error_naming_the_accepted_values():
    """Checked before the library loads (which would ignore it), so a typo cannot pass for the default."""
    done = run("from litekv import native_attention\n"
               "from litekv.errors import ConfigError\n"
               "try:\n"
               "    native_attention.available()\n"
               "except ConfigError as e:\n"
               "    print(native_attention._library is None, e)\n", "sse9")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("True LITEKV_MAX_ISA='sse9' is not an instruction set cap")
    assert "avx512, avx2, baseline" in done.stdout


@pytest.mark.slow
@kernels
@avx512
def test_the_avx2_paths_tests_pass_under_an_avx2_cap():
    """The AVX2 paths' tests, every one of which skips on this CPU without the cap, in a pytest of
    their own with LITEKV_MAX_ISA=avx2: nothing fails, and nothing skips for want of an AVX2 path."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *AVX2_TEST_FILES],
                          cwd=ROOT, env={**os.environ, "LITEKV_MAX_ISA": "avx2"}, capture_output=True, text=True,
                          timeout=900)
    summary = done.stdout[-3000:]
    assert done.returncode == 0, summary + done.stderr[-2000:]
    skips = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert not [line for line in skips if "avx2" in line.lower()], summary
    assert " passed" in summary.splitlines()[-1]
