"""Lowering: bind the custom ops of a step graph for a target, and tidy the graph for the backend.

cpu: every custom op defined with `torch.library.custom_op` (kernels_nki/ops.py) is inlined: while
torch.export traces the step, `InlineCustomOps` (a TorchFunctionMode) answers each call of such an
op by running its torch reference implementation, so the graph holds the reference's aten ops in
place of the op node; Inductor fuses them with their neighbours and the executable needs no Python at
run time. Inlining during the trace costs nothing extra, where `ExportedProgram.run_decompositions`
with a table {op: reference} re-traces the whole graph (measured 70 s for the micro decode step).

Why inline rather than call: an AOTInductor package on this torch 2.13 CPU build CAN call a
Python-registered custom op at run time (its proxy executor dispatches to the registered kernel;
checked by compiling a graph with such an op and comparing outputs), but only when the module that
registers the op was imported before the package runs, and every call goes back through the Python
interpreter and blocks fusion. An op whose reference cannot be traced (data-dependent Python control
flow), or that was registered without `custom_op`, stays a call; the manifest records the mode per
op (`compiler.custom_ops`) and runtime_min imports `dsneuron.kernels_nki` for "call" ops of the
`dsneuron` namespace.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch._library.custom_ops import OPDEFS
from torch.overrides import TorchFunctionMode

from .export import CompileError

_BUILTIN_NAMESPACES = {"aten", "prims", "quantized_decomposed", "higher_order"}


class InlineCustomOps(TorchFunctionMode):
    """Within this mode, calls of custom ops that have a torch reference run the reference instead.

    `inlined` / `called` collect the qualified names ("ns::op") of the ops answered each way.
    """

    def __init__(self) -> None:
        super().__init__()
        self.inlined: set[str] = set()
        self.called: dict[str, str] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = _custom_name(func)
        ref = _reference(name) if name else None
        if ref is None or name in self.called:
            return func(*args, **kwargs)
        try:
            out = ref(*args, **kwargs)
        except Exception as e:  # not traceable (e.g. data-dependent control flow): keep the call
            self.called[name] = f"{type(e).__name__}: {e}"[:200]
            return func(*args, **kwargs)
        self.inlined.add(name)
        return out


class KernelCalls(InlineCustomOps):
    """The neuron target's lowering: within this mode a call of an op of `bindings` ({op: binding},
    kernels_nki/neuron_adapters.py NkiBinding) runs its adapter around the kernel's own custom op
    (`binding.op`, which stays one graph node: the kernel call), every other custom op with a
    reference is inlined as in `InlineCustomOps`. `kernels` collects the ops answered by a kernel."""

    def __init__(self, bindings: dict[str, Any]):
        super().__init__()
        self.bindings = dict(bindings)
        self.kernels: set[str] = set()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = _custom_name(func)
        binding = self.bindings.get(name) if name else None
        if binding is None:
            return super().__torch_function__(func, types, args, kwargs)
        self.kernels.add(name)
        ns, op = binding.op.split("::")
        return binding.call(getattr(getattr(torch.ops, ns), op), *args, **(kwargs or {}))


def _custom_name(func: Any) -> str | None:
    if isinstance(func, torch._ops.OpOverloadPacket):
        ns, name = func._qualified_op_name.split("::")
        return None if ns in _BUILTIN_NAMESPACES else f"{ns}::{name}"
    if isinstance(func, torch._ops.OpOverload):
        return None if func.namespace in _BUILTIN_NAMESPACES else func._schema.name
    return None


def _reference(name: str) -> Callable | None:
    """The torch reference of a `torch.library.custom_op` (the function it was defined with), or
    None for ops registered another way (those can only be called)."""
    return getattr(OPDEFS.get(name), "_init_fn", None)


def inline_mode(target: str) -> InlineCustomOps | None:
    """The export-time lowering of the cpu target (every custom op inlined from its reference);
    raises CompileError for any other target (neuron lowers through backend_neuron.lowering,
    which keeps the ops that have NKI kernels)."""
    if target != "cpu":
        raise CompileError(f"no lowering for target {target!r} in this build (cpu only)")
    return InlineCustomOps()


def custom_ops_in(program: torch.export.ExportedProgram) -> list[str]:
    """Qualified names of the custom ops the graph still calls, in first-use order."""
    seen: dict[str, None] = {}
    for node in program.graph.nodes:
        name = _custom_name(node.target) if node.op == "call_function" else None
        if name:
            seen.setdefault(name)
    return list(seen)


def finish(program: torch.export.ExportedProgram, mode: InlineCustomOps, what: str) -> dict[str, str]:
    """After export under `mode`: drop the no-op `_assert_tensor_metadata` nodes non-strict export
    leaves behind (a tenth of the nodes of the V4 steps, and Inductor re-traces every node), and
    return {op: "inline" | "call" | "kernel"} for every custom op the step used ("kernel": answered
    by its NKI kernel's op under `KernelCalls`, which is then a "call")."""
    graph = program.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default and not node.users:
            graph.erase_node(node)
    program.graph_module.recompile()
    calls = custom_ops_in(program)
    modes = {name: "inline" for name in mode.inlined}
    modes.update({name: "kernel" for name in getattr(mode, "kernels", ())})
    for name in calls:
        if name in mode.inlined and name not in mode.called:
            raise CompileError(f"{what}: custom op {name} is still in the graph after inlining its reference")
        modes[name] = "call"
    return dict(sorted(modes.items()))
