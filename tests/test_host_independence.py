"""The golden model's bit-for-bit invariances hold whatever kernels the host's libraries pick.

tests/test_model.py requires padded == unpadded, prefill + decode == a longer prefill and a batch ==
its rows run alone, bit for bit. Those hold by construction: every GEMM of the golden sums exact
products in float64 (graphs/quant.py `exact_linear`, `block_scaled_matmul`; the references of
sparse_attn and mqa_logits_bf16), so no result depends on the BLAS's summation order, which changes
with the row count, the batch count and the ISA. Here the same tests re-run in a child process
with MKL's code path switched: `MKL_CBWR=COMPATIBLE` made 7 of them fail on this host while the
golden's GEMMs were fp32 (and they failed on a host with AVX512-BF16/AMX with the defaults);
`ATEN_CPU_CAPABILITY=default` also takes torch's own vectorised kernels down to their scalar form.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
INVARIANCES = "prefill_then_decode or long_decode or right_padding or batch_of_mixed or routed_moe"


def _run_model_tests(env_overrides: dict[str, str], marks: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_overrides}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marks,
                           "-k", INVARIANCES, str(TESTS / "test_model.py")],
                          env=env, cwd=TESTS.parent, capture_output=True, text=True, timeout=1800)


def test_invariances_hold_with_mkl_compatible_kernels():
    r = _run_model_tests({"MKL_CBWR": "COMPATIBLE"}, "not slow")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("env", [{"MKL_CBWR": "SSE4_2"}, {"MKL_CBWR": "AVX2,STRICT"},
                                 {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default"},
                                 {"MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1"}],
                         ids=["sse42", "avx2-strict", "compatible-scalar-aten", "compatible-1-thread"])
def test_invariances_hold_on_other_kernel_paths(env):
    r = _run_model_tests(env, "")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
