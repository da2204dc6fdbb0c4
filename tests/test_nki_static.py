"""Static source checks of the NKI kernels (kernels_nki/static_check.py): the kernels pass, and each
rule fires on a small counter-example (aws-neuron-sdk:nki/migration/index.rst, NKI 0.3.0 rules)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import textwrap

import pytest

from dsneuron.kernels_nki.static_check import KERNEL_MODULES, check_file, check_kernels, check_source

GOOD = """
import nki
import nki.language as nl

@nki.jit
def kernel(x, shape=(1, 2)):
    out = nl.ndarray((4, 4), dtype=x.dtype, buffer=nl.shared_hbm)
    other = nl.ndarray(shape=(4, 4), dtype=x.dtype, buffer=nl.shared_hbm)
    if x.dtype == nl.float32:
        return out, other
    return out

def host(x):
    return kernel(x, (3, 4))
"""


def test_the_kernel_modules_pass_every_rule():
    assert check_kernels() == []
    assert set(KERNEL_MODULES) == {"sparse_attn_nki.py", "mqa_logits_nki.py"}


def test_a_clean_snippet_passes():
    assert check_source(GOOD) == []


BAD = [
    ("x = 1\nif x is None:\n    pass\n", "no-is", 2),
    ("x = 1\nok = x is not None\n", "no-is", 2),
    ("import neuronxcc.nki as nki\n", "no-neuronxcc", 1),
    ("from neuronxcc.nki import language\n", "no-neuronxcc", 1),
    ("def helper(a, *, b=1):\n    return a\n", "no-star", 1),
    ("def helper(*args):\n    return args\n", "no-star", 1),
    ("def helper(**kw):\n    return kw\n", "no-star", 1),
    ("import nki\nimport nki.language as nl\n@nki.jit\ndef k(x, perm=[0, 1]):\n"
     "    out = nl.ndarray((1, 1), dtype=x.dtype, buffer=nl.shared_hbm)\n    return out\n", "tuple-args", 4),
    ("import nki\nimport nki.language as nl\n@nki.jit\ndef k(x, perm):\n"
     "    out = nl.ndarray((1, 1), dtype=x.dtype, buffer=nl.shared_hbm)\n    return out\n"
     "def host(x):\n    return k(x, [0, 1])\n", "tuple-args", 8),
    ("import nki.language as nl\nt = nl.ndarray([4, 4], dtype=nl.float32)\n", "tuple-args", 2),
    ("import nki\nimport nki.language as nl\n@nki.jit\ndef k(x):\n"
     "    out = nl.ndarray((1, 1), dtype=x.dtype, buffer=nl.hbm)\n    return out\n", "shared-hbm-out", 6),
    ("import nki\nimport nki.language as nl\n@nki.jit\ndef k(x):\n"
     "    out = nl.ndarray((1, 1), dtype=x.dtype, buffer=nl.shared_hbm)\n"
     "    tmp = nl.ndarray((1, 1), dtype=x.dtype, buffer=nl.sbuf)\n    return out, tmp\n", "shared-hbm-out", 7),
    ("import nki\n@nki.jit\ndef k(x):\n    return\n", "shared-hbm-out", 4),
]


@pytest.mark.parametrize("source, rule, line", BAD, ids=[f"{r}-{i}" for i, (_, r, _) in enumerate(BAD)])
def test_each_rule_fires_with_its_line(source, rule, line):
    findings = check_source(source, "snippet.py")
    assert [(f.rule, f.line) for f in findings] == [(rule, line)], findings
    assert str(findings[0]).startswith(f"snippet.py:{line}: [{rule}]")


def test_check_file_reports_the_path(tmp_path):
    path = tmp_path / "k.py"
    path.write_text(textwrap.dedent("""
        import nki
        @nki.jit
        def k(x, *rest):
            return x
    """))
    rules = sorted(f.rule for f in check_file(path))
    assert rules == ["no-star", "shared-hbm-out"]
    assert all(f.path == str(path) for f in check_file(path))


def test_syntax_errors_are_not_swallowed():
    with pytest.raises(SyntaxError):
        check_source("def broken(:\n")


def test_the_package_imports_without_nki_and_the_kernel_modules_ask_for_it():
    """`import dsneuron.kernels_nki` never needs nki; a kernel module does, and a failed import
    leaves nothing behind in sys.modules."""
    importlib.import_module("dsneuron.kernels_nki")
    if importlib.util.find_spec("nki") is not None:
        pytest.skip("an `nki` package is importable here; the failure path cannot be exercised")
    for name in ("dsneuron.kernels_nki.sparse_attn_nki", "dsneuron.kernels_nki.mqa_logits_nki"):
        with pytest.raises(ModuleNotFoundError, match="nki"):
            importlib.import_module(name)
        assert name not in sys.modules
