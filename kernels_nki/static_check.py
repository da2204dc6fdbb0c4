"""Source checks of the NKI kernel modules: the nki >= 0.3 language rules that running a kernel cannot show.

Rules (aws-neuron-sdk:nki/migration/index.rst, "Migrating from NKI 0.2.0 to NKI 0.3.0"):
  no-is           `is` / `is not` are not supported: use == / != ("Replace is / is not").
  no-star         no `*` keyword-only separator, *args or **kwargs in a signature ("Remove keyword-only
                  argument separator"); checked on every function, since helpers are traced too.
  tuple-args      no list as a kernel parameter default or as an argument of a kernel call, nor as the
                  shape of nl.ndarray / nl.zeros ("Replace list kernel arguments with tuples").
                  Access patterns (`.ap(pattern=[[stride, count], ...])`) are lists by the API's design.
  shared-hbm-out  every tensor a kernel returns is a name bound to nl.ndarray(..., buffer=nl.shared_hbm)
                  ("Output tensors must use nl.shared_hbm").
  no-neuronxcc    no `neuronxcc` import: `neuronxcc.nki.*` inside a kernel is a compile error from
                  NKI 0.4.0 (nki/migration/index.rst, 0.3.0 -> 0.4.0).
A kernel is a function decorated with `nki.jit` (or `jit`).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

#: The kernel modules of this package that the suite checks.
KERNEL_MODULES = ("sparse_attn_nki.py", "mqa_logits_nki.py")


@dataclass(frozen=True)
class Finding:
    """One rule violation: file, 1-based line, rule name (see the module docstring), message."""

    path: str
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.rule}] {self.message}"


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    if isinstance(target, ast.Attribute):
        return target.attr == "jit" and isinstance(target.value, ast.Name) and target.value.id == "nki"
    return isinstance(target, ast.Name) and target.id == "jit"


def _call_name(call: ast.Call) -> str:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        return f"{f.value.id}.{f.attr}"
    return ""


def _is_list(node: ast.expr | None) -> bool:
    return isinstance(node, (ast.List, ast.ListComp))


def _shared_hbm_names(fn: ast.FunctionDef) -> set[str]:
    names = set()
    for node in ast.walk(fn):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        if _call_name(node.value) not in ("nl.ndarray", "nl.zeros"):
            continue
        buffers = [k.value for k in node.value.keywords if k.arg == "buffer"]
        if len(node.value.args) >= 3:
            buffers.append(node.value.args[2])
        if any(isinstance(b, ast.Attribute) and b.attr == "shared_hbm" for b in buffers):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def check_source(source: str, path: str = "<string>") -> list[Finding]:
    """All findings of `source` (a kernel module's text), in line order. Raises SyntaxError on bad Python."""
    tree = ast.parse(source, filename=path)
    found: list[Finding] = []

    def add(node: ast.AST, rule: str, message: str) -> None:
        found.append(Finding(path, getattr(node, "lineno", 0), rule, message))

    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    kernels = {f.name: f for f in functions if any(_is_jit(d) for d in f.decorator_list)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            add(node, "no-is", "`is` / `is not` is not supported by the NKI compiler; use == / !=")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "neuronxcc":
                    add(node, "no-neuronxcc", f"import {alias.name}: kernels use the `nki` package (nki >= 0.3)")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "neuronxcc":
            add(node, "no-neuronxcc", f"from {node.module} import ...: kernels use the `nki` package (nki >= 0.3)")
        elif isinstance(node, ast.Call):
            name = _call_name(node)
            if name in kernels and (any(_is_list(a) for a in node.args) or any(_is_list(k.value) for k in node.keywords)):
                add(node, "tuple-args", f"list passed to kernel {name}(); pass a tuple")
            if name in ("nl.ndarray", "nl.zeros"):
                shapes = node.args[:1] + [k.value for k in node.keywords if k.arg == "shape"]
                if any(_is_list(s) for s in shapes):
                    add(node, "tuple-args", f"{name}() shape given as a list; use a tuple")
    for fn in functions:
        args = fn.args
        if args.vararg or args.kwarg or args.kwonlyargs:
            add(fn, "no-star", f"{fn.name}(): no `*`, *args or **kwargs in signatures (NKI 0.3.0)")
        if fn.name in kernels and any(_is_list(d) for d in args.defaults + args.kw_defaults):
            add(fn, "tuple-args", f"kernel {fn.name}() has a list default; use a tuple")
    for name, fn in kernels.items():
        outputs = _shared_hbm_names(fn)
        for node in ast.walk(fn):
            if not isinstance(node, ast.Return):
                continue
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            for v in values:
                if not (isinstance(v, ast.Name) and v.id in outputs):
                    add(node, "shared-hbm-out",
                        f"kernel {name}() returns {ast.unparse(v) if v else 'None'}, which is not a tensor "
                        "allocated with buffer=nl.shared_hbm in the kernel")
    return sorted(found, key=lambda f: (f.line, f.rule))


def check_file(path: str | Path) -> list[Finding]:
    """check_source of a file (UTF-8)."""
    path = Path(path)
    return check_source(path.read_text(encoding="utf-8"), str(path))


def check_kernels() -> list[Finding]:
    """Findings of every module in KERNEL_MODULES (an empty list when all rules hold)."""
    here = Path(__file__).parent
    return [f for name in KERNEL_MODULES for f in check_file(here / name)]
