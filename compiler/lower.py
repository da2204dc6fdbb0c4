"""Lowering: bind the custom ops of an exported step graph for a target.

cpu: every custom op defined with `torch.library.custom_op` (kernels_nki/ops.py) is inlined: its
torch reference implementation is traced into aten ops in place of the op node
(`ExportedProgram.run_decompositions` with a table mapping the op to that function), so Inductor
fuses it with its neighbours and the executable needs no Python at run time.

Why inline rather than call: an AOTInductor package on this torch 2.13 CPU build CAN call a
Python-registered custom op at run time (its proxy executor dispatches to the registered kernel;
checked by compiling a graph with such an op and comparing outputs), but only when the module that
registers the op was imported before the package runs, and every call goes back through the Python
interpreter and blocks fusion. An op whose reference cannot be traced (data-dependent Python control
flow) falls back to that "call" path; the manifest records the mode per op (`compiler.custom_ops`)
and runtime_min imports `dsneuron.kernels_nki` for "call" ops of the `dsneuron` namespace.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch._library.custom_ops import OPDEFS

from .export import CompileError

_BUILTIN_NAMESPACES = {"aten", "prims", "quantized_decomposed", "higher_order"}


def custom_ops_in(program: torch.export.ExportedProgram) -> list[torch._ops.OpOverload]:
    """Custom op overloads called by the graph (anything outside the aten/prims namespaces), in
    first-use order."""
    seen: dict[str, torch._ops.OpOverload] = {}
    for node in program.graph.nodes:
        t = node.target
        if node.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t.namespace not in _BUILTIN_NAMESPACES:
            seen.setdefault(t.name(), t)
    return list(seen.values())


def reference_of(op: torch._ops.OpOverload) -> Callable | None:
    """The torch reference of a `torch.library.custom_op` (the function it was defined with), or
    None for ops registered another way (those can only be called)."""
    opdef = OPDEFS.get(op._schema.name)
    return getattr(opdef, "_init_fn", None)


def lower(program: torch.export.ExportedProgram, target: str, what: str) -> tuple[torch.export.ExportedProgram, dict[str, str]]:
    """Bind the custom ops of `program` for `target`; returns (lowered program, {op name: mode}).

    cpu: "inline" where the reference traces, else "call" (module docstring). Raises CompileError
    for a target without a lowering here (neuron lowering is the NKI backend's job).
    """
    if target != "cpu":
        raise CompileError(f"{what}: no lowering for target {target!r} in this build (cpu only)")
    modes: dict[str, str] = {}
    table = {}
    for op in custom_ops_in(program):
        ref = reference_of(op)
        if ref is None:
            modes[op.name()] = "call"
        else:
            table[op] = ref
            modes[op.name()] = "inline"
    while table:
        try:
            lowered = program.run_decompositions(table)
        except Exception:  # a reference that does not trace: find which, keep it as a call
            bad = next((op for op in table if not _traces(program, op, table[op])), None)
            if bad is None:
                raise
            del table[bad]
            modes[bad.name()] = "call"
            continue
        left = {op.name() for op in custom_ops_in(lowered)} & {op.name() for op in table}
        if left:
            raise CompileError(f"{what}: custom op {sorted(left)[0]} is still in the graph after inlining its reference")
        return lowered, modes
    return program, modes


def _traces(program: torch.export.ExportedProgram, op: torch._ops.OpOverload, ref: Callable) -> bool:
    try:
        program.run_decompositions({op: ref})
        return True
    except Exception:
        return False
