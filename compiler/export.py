"""torch.export of one bucket's step module, with the weights turned into ordinary graph inputs.

Calling convention (runtime_min/bundle/schema.py): the executable takes the weights it uses first, named
as in the bundle's weights.safetensors, then the step's data and state inputs. Weights are never
baked into an executable, so one weights file serves every bucket and a weight change needs no
recompile. The step module's parameters (and any buffer that is also a weight) are matched to the
`weights` dict by storage identity and swapped in with `torch.func.functional_call`; buffers that
are not weights (e.g. RoPE tables) stay graph constants and are embedded in the executable.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import torch
from torch import nn
from torch.fx.experimental import _config as fx_config
from torch.overrides import TorchFunctionMode

from dsneuron.kernels_nki.formats import neuron_spelling as _neuron_spelling
from dsneuron.kernels_nki.prepare import Prepare
from dsneuron.runtime_min.bundle.schema import TensorSpec, dtype_name

#: dtypes a float8-free graph (the neuron lowering, `export_step(neuron_spelling=True)`) may not hold
FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz,
                 torch.float8_e8m0fnu, torch.float4_e2m1fn_x2)


class CompileError(Exception):
    """The compiler cannot build a bucket from what the model side handed it (a wiring bug, not bad
    user input): the message names the bucket and the offending parameter, output or op."""


@dataclass(frozen=True)
class StepGraph:
    """One step module at one bucket, as the model side hands it to the compiler.

    module: an nn.Module whose parameters are the shared weight tensors;
    inputs: ((name, example tensor), ...) in call order: the data inputs ("tokens", then "valid_len"
        for prefill or "pos" for decode, then "engram_ids"), then any state inputs by state name;
        the examples fix the bucket's static shapes and dtypes;
    outputs: ("logits", *state names in state-layout order), naming what forward returns.
    """

    module: nn.Module
    inputs: tuple[tuple[str, torch.Tensor], ...]
    outputs: tuple[str, ...]
    #: dynamic dimensions: {input or weight name: {dim: symbol}}, and each symbol's (min, max,
    #: step): the dimension takes the multiples of step in min..max; empty for a static graph
    dynamic: dict[str, dict[int, str]] = field(default_factory=dict)
    bounds: dict[str, tuple[int, int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class StageGraph:
    """One stage of a staged bucket (runtime_min/bundle/schema.py): `graph` names its inputs and outputs
    by wiring name; stages of one `kind` in one bucket trace to the same graph and share one
    executable (graphs/stages.py). per_token: the graph takes any token count up to the compile's
    largest (dim 1 of its token-major inputs and outputs), and every bucket of its batch size
    shares its executable."""

    name: str
    kind: str
    graph: StepGraph
    per_token: bool = False
    #: (shape, dtype) of each output at this bucket's shapes, in graph.outputs order
    output_specs: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()


class StepFactory(Protocol):
    """What the compiler needs from a model: step graphs per bucket and the initial state.

    init_state(batch, capacity) -> {state name: tensor}, ordered as the state layout; each tensor
    must be one constant value (the runtime re-creates it from the manifest's fill values).
    Optional: fingerprint() -> str, a digest that changes whenever the step graphs could (model
    source files, config); with it an unchanged bucket skips torch.export on a warm compile
    (compiler/cache.py `pre_key`). Optional: stages(kind, batch, seq_len, capacity, min_seq_len)
    -> list[StageGraph], the bucket as a sequence of stages (used by backends that compile staged
    buckets; min_seq_len > 0 asks for a dynamic token dimension in min_seq_len..seq_len).
    Optional: chunk(batch, seq_len, capacity) -> StepGraph, a single-graph chunk bucket (a prefill
    continuing a state; with it, a single-graph compile plans chunk buckets as a staged one does).
    """

    def prefill(self, batch: int, seq_len: int, capacity: int) -> StepGraph: ...

    def decode(self, batch: int, capacity: int) -> StepGraph: ...

    def init_state(self, batch: int, capacity: int) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class ExportedStep:
    """program: the exported graph (inputs: weights, then data+state); weights: weight names in input
    order; inputs: specs of the data+state inputs; outputs: specs of the outputs ("logits", state...);
    views: {weight name: dtype} of weights passed reinterpreted (see `export_step`)."""

    program: torch.export.ExportedProgram
    weights: tuple[str, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    views: dict[str, torch.dtype]


class _WeightsAsInputs(nn.Module):
    """forward(*weights, *inputs) = step(*inputs) with the step's weight tensors replaced by the
    leading arguments (`groups[i]` lists the step's attribute paths bound to weight i; an argument
    passed as a bitcast view is viewed back to `dtypes[i]` first)."""

    def __init__(self, step: nn.Module, groups: list[list[str]], dtypes: list[torch.dtype | None]):
        super().__init__()
        self.step, self.groups, self.dtypes = step, groups, dtypes

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = len(self.groups)
        w = [a if d is None else a.view(d) for a, d in zip(args[:n], self.dtypes)]
        bound = {path: w[i] for i, paths in enumerate(self.groups) for path in paths}
        out = torch.func.functional_call(self.step, bound, args[n:], tie_weights=False, strict=False)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def bind_weights(step: nn.Module, weights: dict[str, torch.Tensor], what: str,
                 module_order: bool = False) -> tuple[tuple[str, ...], list[list[str]]]:
    """Match the step's parameters and buffers to `weights` by storage.

    Returns (weight names in input order, attribute paths per weight). The order is that of
    `weights`, or with `module_order` that of the module's parameters and buffers, so that two
    modules of the same structure (the stages of one kind) bind their weights in the same order.
    Raises CompileError naming the first parameter that is not one of the weights.
    """
    by_storage = {_storage_key(t): name for name, t in weights.items()}
    paths: dict[str, list[str]] = {}
    for path, p in step.named_parameters(remove_duplicate=False):
        name = by_storage.get(_storage_key(p))
        if name is None:
            raise CompileError(f"{what}: parameter {path!r} {tuple(p.shape)} {dtype_name(p.dtype)} is not one of the "
                               "weights passed to the compiler (step modules must hold the weight tensors themselves)")
        paths.setdefault(name, []).append(path)
    for path, b in step.named_buffers(remove_duplicate=False):
        name = by_storage.get(_storage_key(b))
        if name is not None:
            paths.setdefault(name, []).append(path)
    order = tuple(paths) if module_order else tuple(n for n in weights if n in paths)
    return order, [paths[n] for n in order]


#: torch 2.13's pytree deprecation that fires from copy/copyreg whenever an exported graph's treespecs
#: are deep-copied (aoti_compile_and_package does, once per bucket); it concerns torch's own code
TREESPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


@contextlib.contextmanager
def quiet_treespec_warning():
    """Hide exactly TREESPEC_WARNING (a FutureWarning) inside the block; every other warning,
    and this one outside the block, still shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TREESPEC_WARNING, category=FutureWarning)
        yield


@contextlib.contextmanager
def size_oblivious():
    """Trace and compile sizes size-obliviously (torch.fx.experimental._config.backed_size_oblivious),
    so that a dynamic dimension declared with min=1 stays valid at 1: a per-token stage's decode call
    has one token. Without it torch assumes every dynamic size is >= 2 (its 0/1 specialisation) and
    silently compiles a branch or broadcast taken for sizes > 1; with it, an export whose semantics
    differ at 1 fails (torch's constraint violation naming the dimension). Used by the export and
    by the backend's compile, which traces the program again."""
    with fx_config.patch(backed_size_oblivious=True):
        yield


def _hint(d: int | torch.SymInt) -> int:
    """A dimension's example value without a guard: int() of a symbolic size would pin the
    program's shape environment to it, and the backend then compiles a static graph."""
    return d if isinstance(d, int) else int(d.node.hint)


def float8_nodes(program: torch.export.ExportedProgram, dtypes: tuple[torch.dtype, ...] = FLOAT8_DTYPES) -> list[str]:
    """Nodes of `program` whose value, or a dtype argument, is one of `dtypes` (default
    FLOAT8_DTYPES), as "name (target, dtype)" in graph order; unused placeholders are not counted."""
    out = []
    for node in program.graph.nodes:
        if node.op == "placeholder" and not node.users:  # the step's own parameters, swapped out by functional_call
            continue
        vals = node.meta.get("val")
        vals = vals if isinstance(vals, (tuple, list)) else (vals,)
        found = [v.dtype for v in vals if isinstance(v, torch.Tensor)]
        found += [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, torch.dtype)]
        bad = [d for d in found if d in dtypes]
        if bad:
            out.append(f"{node.name} ({node.target}, {bad[0]})")
    return out


def export_step(graph: StepGraph, weights: dict[str, torch.Tensor], what: str,
                input_views: dict[torch.dtype, torch.dtype] | None = None,
                mode: TorchFunctionMode | None = None, module_order: bool = False,
                neuron_spelling: bool = False) -> ExportedStep:
    """Export `graph.module` at the static shapes of `graph.inputs` (non-strict torch.export).

    what: a label for messages, e.g. "prefill b1 s128".
    input_views: {dtype: same-width dtype} for weight dtypes the backend cannot take as inputs
        (Inductor's cpu codegen has no float8_e8m0fnu): such a weight is passed as a bitcast view
        (zero-copy) and viewed back inside the graph.
    mode: a TorchFunctionMode active while tracing (the target's lowering, compiler/lower.py).
    neuron_spelling: trace under kernels_nki.formats.neuron_spelling and leave viewed weights as
        their bytes (not viewed back), so FP8 data is decoded and rounded with int32/fp32 ops; the
        program is then checked to hold no float8 dtype (`float8_nodes`).
    Raises CompileError when a parameter is not a weight, the outputs do not match `graph.outputs`
    or, with neuron_spelling, a node still has a float8 or float64 dtype (naming it).
    """
    input_views = input_views or {}
    names, groups = bind_weights(graph.module, weights, what, module_order)
    originals = [weights[n].dtype for n in names]
    dtypes = [d if d in input_views and not neuron_spelling else None for d in originals]
    wrapper = _WeightsAsInputs(graph.module, groups, dtypes).eval()
    # a weight with a dynamic dimension is passed as a fresh tensor of its shape: the very tensor the
    # module holds would tie the symbolic size to its static one (export guards storage sizes)
    args = tuple((torch.empty_like(weights[n]) if n in graph.dynamic else weights[n]) for n in names)
    args = tuple(a.view(input_views[d]) if d in input_views else a for a, d in zip(args, originals))
    args += tuple(t for _, t in graph.inputs)
    # a stepped dimension is step * (a dimension of its own): floor divisions by a compress ratio
    # then vanish, which torch.export's constraint solver could not prove things about
    dims = {sym: (torch.export.Dim(sym, min=lo, max=hi) if step == 1 else
                  step * torch.export.Dim(f"{sym}_over_{step}", min=lo // step, max=hi // step))
            for sym, (lo, hi, step) in graph.bounds.items()}
    named = list(names) + [n for n, _ in graph.inputs]
    dynamic_shapes = None
    if graph.dynamic:
        dynamic_shapes = (tuple({d: dims[sym] for d, sym in graph.dynamic[n].items()} if n in graph.dynamic else None
                                for n in named),)
    # the model's higher-order ops (the Sinkhorn rounds' while_loop) are traced by Dynamo, which
    # would check the entries an earlier export left in its cache against this export's symbolic
    # sizes and so add guards (T != 1) to it
    torch._dynamo.reset()
    with torch.no_grad(), (mode if mode is not None else contextlib.nullcontext()), quiet_treespec_warning(), \
            size_oblivious(), (_neuron_spelling() if neuron_spelling else contextlib.nullcontext()):
        program = torch.export.export(wrapper, args, dynamic_shapes=dynamic_shapes, strict=False)
    if neuron_spelling:
        left = float8_nodes(program)
        if left:
            raise CompileError(f"{what}: the float8-free lowering left {len(left)} node(s) with a float8 dtype, first "
                               f"{left[0]}; spell that cast with kernels_nki.formats e4m3_to_float / e4m3_round")
        wide = float8_nodes(program, (torch.float64,))
        if wide:
            raise CompileError(f"{what}: the neuron lowering left {len(wide)} node(s) with a float64 dtype, first "
                               f"{wide[0]}; Trainium computes no float64: sum in fp32 under "
                               "kernels_nki.formats.neuron_spelling")
    out_node = next(n for n in program.graph.nodes if n.op == "output")
    vals = [a.meta["val"] for a in out_node.args[0]]
    if len(vals) != len(graph.outputs):
        raise CompileError(f"{what}: the step returns {len(vals)} tensors but names {len(graph.outputs)} outputs")
    inputs = tuple(TensorSpec(n, tuple(t.shape), dtype_name(t.dtype)) for n, t in graph.inputs)
    outputs = tuple(TensorSpec(n, tuple(_hint(d) for d in v.shape), dtype_name(v.dtype)) for n, v in zip(graph.outputs, vals))
    views = {n: input_views[d] for n, d in zip(names, originals) if d in input_views}
    return ExportedStep(program, names, inputs, outputs, views)


@dataclass(frozen=True)
class ModelParts:
    """Everything the pipeline needs from the model side.

    steps: builds the step graph of each bucket (graphs.steps for the real model);
    weights: {name: tensor} stored in weights.safetensors; the steps' parameters must be these tensors;
    tokenizer_files: files copied into the bundle's tokenizer/ (tokenizer.json first);
    host_params: JSON-serialisable host-side preprocessing data, e.g. {"engram": params or None};
    stored_dtypes: {weight name: dtype} to store narrower than the model holds it (a bf16 checkpoint
        tensor promoted to fp32 at load, graphs.weights.load_casts); the cast back must be exact,
        and the runtime re-applies the promotion (Manifest.load_casts).
    prepare: load-time recipes (kernels_nki/prepare.py `Prepare`): their inputs are stored in the
        bundle, their outputs (also in `weights`) are what the executables take and are not stored.
    sources: {weight name: weight source (graphs/lazy.py)}: where the stored bytes of a weight come
        from when they are not to be read from its tensor in `weights` (which may then be a
        placeholder of the model's shape and dtype, never read): a checkpoint file region, a
        deferred computation. Its shape is the weight's, its dtype the stored one (stored_dtypes,
        else the weight's); a narrowing source gives the bytes the model's tensor was cast from.
    host_weights: names in `weights` that no executable takes, stored for the runtime's host-side
        code alone (the DSpark drafter's mtp.* tensors, which the runtime runs eagerly); they leave
        the executables' cache keys as they are.
    """

    steps: StepFactory
    weights: dict[str, torch.Tensor]
    tokenizer_files: Sequence[Path]
    host_params: dict[str, Any]
    stored_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    prepare: tuple[Prepare, ...] = ()
    sources: Mapping[str, Any] = field(default_factory=dict)
    host_weights: tuple[str, ...] = ()
