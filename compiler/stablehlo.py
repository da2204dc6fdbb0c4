"""The neuron target's interchange: one bucket's exported program -> one StableHLO module (torch-mlir).

TorchNeuron (torch-neuronx 2.13+, Neuron SDK 2.33+) and vLLM Neuron's default route compile
Dynamo FX -> torch-mlir -> StableHLO -> neuronx-cc; the SDK ended torch-xla inference on
Trn2/Trn3 with 2.34 (docs/neuron.md). dsneuron takes the same front end
ahead of time, from its own torch 2.13: `lower_program` imports a bucket's ExportedProgram
(compiler/export.py, the neuron lowering and spelling: no float8, no float64) with torch-mlir's
FxImporter and lowers it with torch-mlir's StableHLO pipeline. What it does beyond the library:

- Respellings before the import (`respell`): `aten.__lshift__` / `__rshift__` (which the Torch to
  StableHLO conversion refuses) as `bitwise_left_shift` / `bitwise_right_shift`; `aten.sort.stable`
  (not imported) as `aten.sort`, then every `stablehlo.sort` marked `is_stable` (a stable sort is a
  valid result of any sort, and the model's one tie rule needs stability: graphs/numerics.py
  `stable_topk_indices`); `aten.empty_strided` as zeros (the value is never read).
- Constants as dense elements attributes (`DenseLiterals`): torch-mlir writes tensors of more than
  one element as `dense_resource` blobs, which XLA's StableHLO -> HLO conversion does not take.
- Comparisons of unsigned integers and booleans marked UNSIGNED: torch-mlir writes SIGNED for every
  integer compare, which XLA's verifier refuses on ui8 (the byte caches' compares) and i1.
- The few ops it does not take as torch.export leaves them decomposed where they stand
  (`_LOCAL_DECOMPOSITIONS`: index_copy; integer floor division and remainder in integer ops, which
  torch-mlir lowers through float64 and with the wrong sign rule); torch-mlir decomposes the rest
  itself, so the program is not re-traced (`run_decompositions` would cost as much as the export).
- Dynamic iotas of a static result type as iotas, tensor `arith.constant`s as StableHLO
  constants and converts of constants folded (`_tidy`): the float64 scalars torch-mlir makes of
  Python numbers do not reach the module.
- Each NKI kernel call (`dsneuron::nki_*`, compiler/lower.py KernelCalls) becomes one
  `stablehlo.composite "dsneuron.nki.<kernel>"` whose decomposition is the kernel's torch reference
  in its calling convention (kernels_nki/neuron_adapters.py), lowered the same way, and whose
  attributes name the kernel ("module:function"), the sha256 of its module and its constant
  arguments: any StableHLO consumer runs it through the decomposition (XLA inlines it); a trn host
  replaces it with the kernel (compiler/backend_neuron.py `bind_kernels`). neuronx-cc takes
  StableHLO composites since 2.31 (aws-neuron-sdk about-neuron/whats-new.rst); how it binds an NKI
  kernel from a StableHLO module is NOT verified here (no SDK on this host).

The module's arguments are the bucket's weights then its inputs, in the manifest's order (weights
as stored, after the manifest's load_casts and weight_views); its results are the bucket's
outputs. `artifact` serializes it as a StableHLO portable artifact (versioned VHLO bytecode,
stablehlo `serialize_portable_artifact`) at `TARGET_VERSION`.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import torch

from .export import CompileError

aten = torch.ops.aten

#: the StableHLO version the bundle's portable artifacts are written at: the oldest of torch-mlir's
#: own and that of the StableHLO consumers the tests run (jaxlib's XLA: 1.17.0), so both read them
TARGET_VERSION = "1.17.0"
#: the namespace of the kernels' composites: "dsneuron.nki.<kernel function>"
COMPOSITE_PREFIX = "dsneuron.nki."
#: op names counted in a module's facts (the ones that make or break a static NEFF schedule)
COUNTED_OPS = ("dot_general", "gather", "scatter", "sort", "while", "custom_call", "composite", "reduce",
               "bitcast_convert")
_SHIFTS = {aten.__rshift__.Scalar: aten.bitwise_right_shift.Tensor,
           aten.__rshift__.Tensor: aten.bitwise_right_shift.Tensor,
           aten.__lshift__.Scalar: aten.bitwise_left_shift.Tensor,
           aten.__lshift__.Tensor: aten.bitwise_left_shift.Tensor}
# the StableHLO backend pipeline of torch-mlir (torch-backend-to-stablehlo-backend-pipeline) without
# its contract check, which refuses the kernels' calls that `_make_composites` turns into composites
_STABLEHLO_PIPELINE = ",".join([
    "func.func(convert-torch-to-stablehlo{allow-non-finites=true enable-i32-index=false enable-static-shape=false})",
    "func.func(chlo-legalize-to-stablehlo)", "func.func(convert-torch-to-arith)", "func.func(canonicalize)",
    "func.func(cse)", "torch-func-backend-type-conversion-for-stablehlo", "func.func(canonicalize)",
    "func.func(torch-finalizing-backend-type-conversion-for-stablehlo)", "func.func(stablehlo-canonicalize-dynamism)",
    "func.func(canonicalize)", "stablehlo-refine-shapes", "func.func(canonicalize)",
    "func.func(stablehlo-canonicalize-dynamism)", "func.func(canonicalize)",
    "func.func(stablehlo-legalize-deprecated-ops{fail-on-unused=false})", "canonicalize"])


def require_torch_mlir() -> Any:
    """The torch_mlir module; CompileError naming the package when it is not importable (it is a
    dependency of dsneuron: `pip install -e .` installs it)."""
    try:
        import torch_mlir
        import torch_mlir.fx  # noqa: F401
    except ImportError as e:
        raise CompileError(f"the neuron target needs torch-mlir (pip install torch-mlir==20261001), which is not "
                           f"importable here ({e})") from None
    return torch_mlir


# ------------------------------------------------------------------------------------------ FX passes
def respell(gm: torch.fx.GraphModule) -> None:
    """Rewrite, in place, the aten ops that torch-mlir's StableHLO path refuses (module docstring):
    shifts as bitwise shifts (a Python int amount becomes a scalar tensor of the shifted dtype),
    `sort.stable` as `sort` (made stable again in the module), `empty_strided` as zeros."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _SHIFTS:
            value, amount = node.args
            with graph.inserting_before(node):
                if not isinstance(amount, torch.fx.Node):
                    fake = value.meta["val"]
                    amount = graph.call_function(aten.scalar_tensor.default, (amount,), {"dtype": fake.dtype})
                    with fake.fake_mode:
                        amount.meta["val"] = torch.scalar_tensor(node.args[1], dtype=fake.dtype)
                new = graph.call_function(_SHIFTS[node.target], (value, amount))
        elif node.target is aten.sort.stable:
            with graph.inserting_before(node):
                new = graph.call_function(aten.sort.default, (node.args[0], node.kwargs.get("dim", -1),
                                                              node.kwargs.get("descending", False)))
        elif node.target is aten.empty_strided.default:
            val = node.meta["val"]
            with graph.inserting_before(node):
                new = graph.call_function(aten.full.default, (list(val.shape), 0), {"dtype": val.dtype})
        else:
            continue
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    graph.eliminate_dead_code()
    gm.recompile()


def _floor_divide(a: torch.Tensor, b: Any) -> torch.Tensor:
    """Integer floor division from the truncating one (stablehlo.divide of integers): one less
    where the remainder is nonzero and its sign differs from the divisor's."""
    q = aten.div.Tensor_mode(a, b, rounding_mode="trunc")
    r = a - q * b
    if isinstance(b, torch.Tensor):
        off = (r != 0) & ((r < 0) != (b < 0))
    else:
        off = r < 0 if b > 0 else r > 0
    return q - off.to(q.dtype)


def _remainder(a: torch.Tensor, b: Any) -> torch.Tensor:
    return a - _floor_divide(a, b) * b


def _integer_floor(node: torch.fx.Node) -> bool:
    """An integer result computed with floor rounding (a float one is left to torch-mlir)."""
    val = node.meta.get("val")
    return (isinstance(val, torch.Tensor) and not val.dtype.is_floating_point
            and node.kwargs.get("rounding_mode", "floor") == "floor")


def _always(node: torch.fx.Node) -> bool:
    return True


#: the ops of torch.export's IR that torch-mlir's StableHLO path does not take as they are, each
#: replaced where it stands by a decomposition traced at that node's shapes (`_decompose_nodes`),
#: {op: (which nodes, decomposition)}: `index_copy` (not lowered at all); integer floor division
#: (lowered through float64: convert, divide, floor, convert back, which Trainium cannot run) and
#: integer remainder (lowered to stablehlo.remainder, which truncates where torch's floors), in
#: integer ops. Every other op torch-mlir imports and decomposes itself, which avoids re-tracing
#: the whole program (`run_decompositions` costs about as much as the export).
_LOCAL_DECOMPOSITIONS = {
    aten.index_copy.default: (_always, torch._decomp.decomposition_table[aten.index_copy.default]),
    aten.div.Tensor_mode: (_integer_floor, lambda a, b, rounding_mode=None: _floor_divide(a, b)),
    aten.div.Scalar_mode: (_integer_floor, lambda a, b, rounding_mode=None: _floor_divide(a, b)),
    aten.floor_divide.default: (_integer_floor, _floor_divide),
    aten.remainder.Tensor: (_integer_floor, _remainder),
    aten.remainder.Scalar: (_integer_floor, _remainder),
}
#: no-op nodes that torch-mlir does not import (a lifted constant's detach_ and copy)
_IDENTITY = {aten.detach_.default, aten.detach.default, aten.lift_fresh_copy.default, aten.alias.default,
             aten._assert_tensor_metadata.default}


def _decompose_nodes(gm: torch.fx.GraphModule) -> None:
    """Replace each node selected by `_LOCAL_DECOMPOSITIONS` by its decomposition, traced by
    make_fx on the node's fake arguments and inlined (a constant it makes becomes a literal)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = gm.graph
    for node in list(graph.nodes):
        rule = _LOCAL_DECOMPOSITIONS.get(node.target) if node.op == "call_function" else None
        if rule is None or not rule[0](node):
            continue
        flat, spec = torch.utils._pytree.tree_flatten((node.args, node.kwargs))
        slots = [i for i, a in enumerate(flat) if isinstance(a, torch.fx.Node)]

        def call(*tensors: torch.Tensor, flat=flat, spec=spec, slots=slots, fn=rule[1]) -> Any:
            vals = list(flat)
            for i, t in zip(slots, tensors):
                vals[i] = t
            args, kwargs = torch.utils._pytree.tree_unflatten(vals, spec)
            return fn(*args, **kwargs)

        fakes = [flat[i].meta["val"] for i in slots]
        with fakes[0].fake_mode:
            sub = make_fx(call)(*fakes)
        env: dict[torch.fx.Node, Any] = dict(zip((n for n in sub.graph.nodes if n.op == "placeholder"),
                                                 (flat[i] for i in slots)))
        with graph.inserting_before(node):
            for sn in sub.graph.nodes:
                if sn.op == "get_attr":
                    env[sn] = getattr(sub, sn.target)
                elif sn.op == "call_function":
                    env[sn] = graph.node_copy(sn, lambda a: env[a])
                    env[sn].meta = dict(sn.meta)
                elif sn.op == "output":
                    node.replace_all_uses_with(torch.fx.map_arg(sn.args[0], lambda a: env[a]))
        graph.erase_node(node)


def _decomposed(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """`program` as torch-mlir can import it, in place: the no-op nodes it does not import
    removed, `_LOCAL_DECOMPOSITIONS` applied, `respell`, and the values of its non-persistent
    buffers where torch-mlir's frozen import looks for them (the state dict)."""
    graph = program.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _IDENTITY:
            if node.users:
                node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    _decompose_nodes(program.graph_module)
    respell(program.graph_module)
    for name in program.graph_signature.inputs_to_buffers.values():
        if name not in program.state_dict:  # non-persistent buffers (the RoPE tables) are constants
            program.state_dict[name] = program.constants[name]
    return program


def kernel_nodes(program: torch.export.ExportedProgram, kernel_ops: Mapping[str, Any]) -> list[torch.fx.Node]:
    """The nodes of `program` that call a kernel op of `kernel_ops` ({"dsneuron::nki_*": ...})."""
    return [n for n in program.graph.nodes if n.op == "call_function" and _op_name(n.target) in kernel_ops]


def _op_name(target: Any) -> str | None:
    schema = getattr(target, "_schema", None)
    return schema.name if schema is not None else None


# ------------------------------------------------------------------------------------------ import
@dataclass(frozen=True)
class KernelOp:
    """What the lowering needs of one NKI kernel: its custom op (`dsneuron::nki_<kernel>`), the
    kernel as "module:function", the sha256 of the kernel's module (a NEFF depends on it) and the
    torch reference in the kernel's calling convention (the composite's decomposition)."""

    op: str
    kernel: str
    kernel_sha256: str
    reference: Any


def _importer_classes() -> tuple[type, type]:
    """(hooks, node importer) classes over torch-mlir's FxImporter (defined lazily: torch-mlir is
    imported only by a neuron compile)."""
    import ml_dtypes
    from torch_mlir.extras.fx_importer import TORCH_DTYPE_TO_MLIR_TYPE, FxImporterHooks, GraphNodeImporter
    from torch_mlir.ir import DenseElementsAttr, FlatSymbolRefAttr, Operation, UnitAttr

    class DenseLiterals(FxImporterHooks):
        """Tensor constants as dense elements attributes (see the module docstring)."""

        def resolve_literal(self, gni: Any, literal: Any, info: Any) -> Any:
            if not isinstance(literal, torch.Tensor):
                return None
            t = literal.detach().contiguous()
            arr = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()
            attr = DenseElementsAttr.get(arr, type=TORCH_DTYPE_TO_MLIR_TYPE[t.dtype](), shape=list(t.shape))
            vtype = gni._cc.tensor_to_vtensor_type(t)
            return Operation.create(name="torch.vtensor.literal", results=[vtype], attributes={"value": attr}).result

    class KernelCallImporter(GraphNodeImporter):
        """Imports a kernel node as a call of `callees[node.name]` (its decomposition), marked
        no_inline so that torch-mlir's pipeline keeps the call for `_make_composites`."""

        callees: dict[str, str] = {}

        def _import_torch_op_overload(self, loc: Any, node: torch.fx.Node, concrete_target: Any = None) -> None:
            callee = self.callees.get(node.name)
            if callee is None:
                return super()._import_torch_op_overload(loc, node, concrete_target)
            operands = [self._import_argument(loc, a) for a in node.args if isinstance(a, torch.fx.Node)]
            with loc:
                call = Operation.create("func.call", results=[self._cc.node_val_to_type(node)], operands=operands,
                                        attributes={"callee": FlatSymbolRefAttr.get(callee),
                                                    "no_inline": UnitAttr.get()})
            self.bind_node_value(node, call.result)

    return DenseLiterals, KernelCallImporter


@dataclass
class _Call:
    """One kernel call site: its node, its composite's name, attributes and decomposition function."""

    node: str
    name: str
    attributes: dict[str, Any]
    decomposition: str


def _reference_program(node: torch.fx.Node, kernel: KernelOp) -> torch.export.ExportedProgram:
    """The kernel's reference at this call's shapes and constant arguments, exported (neuron
    spelling: it is what a StableHLO consumer without the kernel runs)."""
    from dsneuron.kernels_nki.formats import neuron_spelling

    tensors = [a for a in node.args if isinstance(a, torch.fx.Node)]
    slots = [isinstance(a, torch.fx.Node) for a in node.args]
    consts = [a for a in node.args if not isinstance(a, torch.fx.Node)]

    class Reference(torch.nn.Module):
        def forward(self, *xs: torch.Tensor) -> torch.Tensor:
            it, ct = iter(xs), iter(consts)
            return kernel.reference(*[next(it) if s else next(ct) for s in slots])

    examples = tuple(torch.zeros(t.meta["val"].shape, dtype=t.meta["val"].dtype) for t in tensors)
    with neuron_spelling(), torch.no_grad():
        return torch.export.export(Reference(), examples, strict=False)


def _composite_attributes(node: torch.fx.Node, kernel: KernelOp) -> dict[str, Any]:
    """The kernel's identity and its call's constant arguments, by schema argument name."""
    names = [a.name for a in node.target._schema.arguments]
    consts = {n: a for n, a in zip(names, node.args) if not isinstance(a, torch.fx.Node)}
    return {"kernel": kernel.kernel, "kernel_sha256": kernel.kernel_sha256, **consts}


def lower_program(program: torch.export.ExportedProgram, kernels: Mapping[str, KernelOp] | None = None,
                  what: str = "bucket") -> "StableHlo":
    """`program` (a bucket exported with the neuron lowering, compiler/export.py) as a StableHLO
    module: see the module docstring. kernels: {"dsneuron::nki_*": KernelOp} of the kernel calls
    to carry as composites. Raises CompileError naming `what` when torch-mlir cannot import or
    lower a node, or when the program still calls a custom op that is not a kernel."""
    require_torch_mlir()
    from torch_mlir.compiler_utils import run_pipeline_with_repro_report
    from torch_mlir.dialects import torch as torch_d
    from torch_mlir.extras.fx_importer import FxImporter
    from torch_mlir.ir import Context

    kernels = dict(kernels or {})
    program = _decomposed(program)
    stray = sorted({name for n in program.graph.nodes if n.op == "call_function"
                    for name in [_op_name(n.target)] if name and not name.startswith(("aten::", "prims::"))
                    and name not in kernels})
    if stray:
        raise CompileError(f"{what}: the graph still calls {', '.join(stray)}, which has no NKI kernel binding and was "
                           "not inlined; torch-mlir cannot lower it")
    context = Context()
    torch_d.register_dialect(context)
    dense, importer_cls = _importer_classes()
    importer = FxImporter(context=context, hooks=dense(), graph_node_importer_cls=importer_cls)
    calls: list[_Call] = []
    decompositions: dict[tuple, str] = {}
    for node in kernel_nodes(program, kernels):
        kernel = kernels[_op_name(node.target)]
        attrs = _composite_attributes(node, kernel)
        key = (kernel.op, tuple(tuple(a.meta["val"].shape) for a in node.args if isinstance(a, torch.fx.Node)),
               tuple(sorted((k, repr(v)) for k, v in attrs.items())))
        if key not in decompositions:  # one decomposition per distinct signature
            decompositions[key] = f"{kernel.op.split('::')[1]}_impl_{len(decompositions)}"
            importer.import_frozen_program(_decomposed(_reference_program(node, kernel)), func_name=decompositions[key],
                                           func_visibility="private")
        calls.append(_Call(node.name, COMPOSITE_PREFIX + kernel.kernel.split(":")[1], attrs, decompositions[key]))
    importer_cls.callees = {c.node: c.decomposition for c in calls}
    try:
        importer.import_frozen_program(program, func_name="main")
    except Exception as e:  # torch-mlir raises plain exceptions naming the node
        raise CompileError(f"{what}: torch-mlir could not import the graph: {str(e).splitlines()[0][:300]}") from None
    _run(run_pipeline_with_repro_report, importer.module, what)
    with context:
        _make_composites(importer.module, calls)
        _fix_sorts_and_compares(importer.module)
        _tidy(importer.module, what)
        if not importer.module.operation.verify():
            raise CompileError(f"{what}: the StableHLO module does not verify")
    return StableHlo(importer.module, context)


def _run(run_pipeline: Any, module: Any, what: str) -> None:
    from torch_mlir._mlir_libs import _stablehlo

    _stablehlo.register_stablehlo_passes()  # the pipeline's passes by name (chlo-legalize-to-stablehlo, ...)
    try:
        run_pipeline(module, "builtin.module(torchdynamo-export-to-torch-backend-pipeline{ extra-library=})",
                     "Lowering TorchFX IR -> Torch Backend IR")
        run_pipeline(module, f"builtin.module({_STABLEHLO_PIPELINE})", "Lowering Torch Backend IR -> StableHLO")
    except Exception as e:
        lines = [ln.strip() for ln in str(e).splitlines() if "error" in ln]
        raise CompileError(f"{what}: torch-mlir could not lower the graph to StableHLO: "
                           f"{(lines or [str(e)])[0][:400]}") from None


def _make_composites(module: Any, calls: list[_Call]) -> None:
    """Replace every call of a kernel's decomposition in main by a `stablehlo.composite` over the
    same operands, named for the kernel, with the call's attributes."""
    from torch_mlir.ir import (BoolAttr, DictAttr, FlatSymbolRefAttr, FloatAttr, F32Type, InsertionPoint, IntegerAttr,
                               IntegerType, Operation, StringAttr)

    def attr(v: Any) -> Any:
        if isinstance(v, bool):
            return BoolAttr.get(v)
        if isinstance(v, int):
            return IntegerAttr.get(IntegerType.get_signless(64), v)
        if isinstance(v, float):
            return FloatAttr.get(F32Type.get(), v)
        return StringAttr.get(str(v))

    main = next(op.operation for op in module.body.operations
                if op.operation.name == "func.func" and StringAttr(op.operation.attributes["sym_name"]).value == "main")
    # the calls in main are in the graph's order, as `calls` is
    sites = [op.operation for op in main.regions[0].blocks[0].operations if op.operation.name == "func.call"]
    if len(sites) != len(calls):
        raise CompileError(f"the lowered module has {len(sites)} kernel calls, the graph {len(calls)}")
    for op, call in zip(sites, calls):
        if FlatSymbolRefAttr(op.attributes["callee"]).value != call.decomposition:
            raise CompileError(f"kernel call {call.name} lowered out of order")
        with InsertionPoint(op), op.location:
            comp = Operation.create("stablehlo.composite", results=[r.type for r in op.results],
                                    operands=list(op.operands),
                                    attributes={"name": StringAttr.get(call.name),
                                                "composite_attributes": DictAttr.get({k: attr(v) for k, v in call.attributes.items()}),
                                                "decomposition": FlatSymbolRefAttr.get(call.decomposition),
                                                "version": IntegerAttr.get(IntegerType.get_signless(32), 1)})
        for old, new in zip(op.results, comp.results):
            old.replace_all_uses_with(new)
        op.erase()


def _tidy(module: Any, what: str) -> None:
    """A `stablehlo.dynamic_iota` of static result type as an iota, tensor `arith.constant`s (which
    torch-mlir's pipeline leaves, and which a portable artifact cannot hold) as `stablehlo.constant`s, and each `stablehlo.convert` of a constant folded into
    a constant of the converted type (numpy's cast: round to nearest even, as the convert): the
    float64 / int64 scalars torch-mlir makes of Python numbers and converts on the spot. Then
    canonicalize drops the constants left unused."""
    import ml_dtypes
    import numpy as np
    from torch_mlir.compiler_utils import run_pipeline_with_repro_report
    from torch_mlir.ir import DenseElementsAttr, InsertionPoint, Operation, RankedTensorType

    for op in list(_walk(module.operation)):
        if op.name == "stablehlo.dynamic_iota" and RankedTensorType(op.results[0].type).has_static_shape:
            # torch-mlir's arange: the length is computed in float64 from constants that no registered
            # pass folds, but the result type already holds it
            with InsertionPoint(op), op.location:
                new = Operation.create("stablehlo.iota", results=[op.results[0].type],
                                       attributes={"iota_dimension": op.attributes["iota_dimension"]})
            op.results[0].replace_all_uses_with(new.results[0])
            op.erase()
    for op in list(_walk(module.operation)):
        if op.name == "arith.constant" and isinstance(op.results[0].type, RankedTensorType):
            with InsertionPoint(op), op.location:
                new = Operation.create("stablehlo.constant", results=[op.results[0].type],
                                       attributes={"value": op.attributes["value"]})
            op.results[0].replace_all_uses_with(new.results[0])
            op.erase()
    numpy_of = {"f64": np.float64, "f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "i64": np.int64,
                "i32": np.int32, "i16": np.int16, "i8": np.int8, "ui8": np.uint8, "i1": np.bool_}
    for op in list(_walk(module.operation)):  # in order, so that a chain of them folds link by link
        if op.name not in ("stablehlo.convert", "stablehlo.reshape", "stablehlo.broadcast_in_dim"):
            continue
        source = op.operands[0].owner
        if getattr(source, "name", None) != "stablehlo.constant":
            continue
        src_t, dst_t = RankedTensorType(op.operands[0].type), RankedTensorType(op.results[0].type)
        src_np, dst_np = numpy_of.get(str(src_t.element_type)), numpy_of.get(str(dst_t.element_type))
        value = DenseElementsAttr(source.attributes["value"])
        if src_np is None or dst_np is None or not value.is_splat and (op.name == "stablehlo.broadcast_in_dim"
                                                                      or np.prod(dst_t.shape) > 4096):
            continue
        with InsertionPoint(op), op.location:
            if value.is_splat:
                scalar = np.array(value.get_splat_value().value, dtype=src_np).astype(dst_np)
                folded = DenseElementsAttr.get_splat(dst_t, _scalar_attr(scalar, dst_t))
            else:
                data = np.asarray(value).astype(dst_np).reshape(dst_t.shape)
                folded = DenseElementsAttr.get(data, type=dst_t.element_type, shape=list(dst_t.shape))
            new = Operation.create("stablehlo.constant", results=[dst_t], attributes={"value": folded})
        op.results[0].replace_all_uses_with(new.results[0])
        op.erase()
    try:
        run_pipeline_with_repro_report(module, "builtin.module(func.func(canonicalize),func.func(cse))",
                                       "Folding StableHLO constants")
    except Exception as e:
        raise CompileError(f"{what}: folding the StableHLO module failed: {str(e).splitlines()[0][:300]}") from None


def _scalar_attr(value: Any, tensor_type: Any) -> Any:
    """An MLIR float / integer attribute of `tensor_type`'s element type holding `value`."""
    from torch_mlir.ir import FloatAttr, IntegerAttr, IntegerType

    elem = tensor_type.element_type
    if isinstance(elem, IntegerType):
        return IntegerAttr.get(elem, int(value))
    return FloatAttr.get(elem, float(value))


def rebind_composites(module: "StableHlo", prefix: str, target: str, lnc: int, config: Any) -> int:
    """Replace every `stablehlo.composite` whose name starts with `prefix` by a
    `stablehlo.custom_call @target` over its operands, with backend_config = config(kernel,
    operand types, result types, attributes, lnc) (the composite's `kernel` attribute and the
    others as Python values); the decompositions left unused are removed. Returns how many."""
    from torch_mlir.ir import DictAttr, InsertionPoint, Operation, StringAttr

    count = 0
    with module.context:
        for op in list(_walk(module.module.operation)):
            if op.name != "stablehlo.composite" or not StringAttr(op.attributes["name"]).value.startswith(prefix):
                continue
            attrs = {a.name: _python_value(a.attr) for a in DictAttr(op.attributes["composite_attributes"])}
            kernel = attrs.pop("kernel")
            backend_config = config(kernel, [str(v.type) for v in op.operands], [str(r.type) for r in op.results],
                                    attrs, lnc)
            with InsertionPoint(op), op.location:
                call = Operation.create("stablehlo.custom_call", results=[r.type for r in op.results],
                                        operands=list(op.operands),
                                        attributes={"call_target_name": StringAttr.get(target),
                                                    "backend_config": StringAttr.get(backend_config)})
            for old, new in zip(op.results, call.results):
                old.replace_all_uses_with(new)
            op.erase()
            count += 1
        used = {str(op.attributes["decomposition"]).strip("@") for op in _walk(module.module.operation)
                if op.name == "stablehlo.composite"}
        for op in [o.operation for o in module.module.body.operations]:
            name = StringAttr(op.attributes["sym_name"]).value
            if op.name == "func.func" and name != "main" and "_impl_" in name and name not in used:
                op.erase()
    return count


def _python_value(attr: Any) -> Any:
    """An MLIR attribute of a composite's attributes as a Python value (str, int, float, bool)."""
    from torch_mlir.ir import BoolAttr, FloatAttr, IntegerAttr, StringAttr

    for kind, get in ((BoolAttr, lambda a: a.value), (IntegerAttr, lambda a: a.value), (FloatAttr, lambda a: a.value),
                      (StringAttr, lambda a: a.value)):
        if isinstance(attr, kind):
            return get(attr)
    return str(attr)


def _fix_sorts_and_compares(module: Any) -> None:
    """Every `stablehlo.sort` stable; every compare of unsigned or boolean operands UNSIGNED (XLA's
    verifier requires it; torch-mlir writes SIGNED)."""
    from torch_mlir.ir import Attribute, BoolAttr, RankedTensorType

    unsigned = Attribute.parse("#stablehlo<comparison_type UNSIGNED>")

    def walk(op: Any) -> None:
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    name = inner.operation.name
                    if name == "stablehlo.sort":
                        inner.operation.attributes["is_stable"] = BoolAttr.get(True)
                    elif name == "stablehlo.compare":
                        elem = RankedTensorType(inner.operation.operands[0].type).element_type
                        if (str(elem) == "i1" or str(elem).startswith("ui")) and "compare_type" in inner.operation.attributes:
                            inner.operation.attributes["compare_type"] = unsigned
                    walk(inner.operation)

    walk(module.operation)


# ------------------------------------------------------------------------------------------ the module
@dataclass
class ModuleFacts:
    """What a bucket's StableHLO module holds (`facts_of`): ops {name: count} of COUNTED_OPS (over
    every function, decompositions included), instructions (all ops), arguments and results of
    main, float8_types (f8/f4 element types: must be none), f64_ops / i64_ops (ops with a
    float64 / int64 result), largest_constant (elements of the largest constant that is not a splat;
    weights are arguments, so it stays small),
    composites {name: count}, text_bytes."""

    ops: dict[str, int]
    instructions: int
    arguments: int
    results: int
    float8_types: list[str]
    f64_ops: int
    i64_ops: int
    largest_constant: int
    composites: dict[str, int] = field(default_factory=dict)
    text_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _walk(op: Any):
    """Every operation nested in `op`, in order."""
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield inner.operation
                yield from _walk(inner.operation)


def facts_of(module: Any) -> ModuleFacts:
    """ModuleFacts of a StableHLO module (an MLIR module of torch-mlir's context)."""
    from torch_mlir.ir import DenseElementsAttr, RankedTensorType, StringAttr

    ops: Counter = Counter()
    composites: Counter = Counter()
    f64 = i64 = largest = 0
    main = None
    for op in _walk(module.operation):
        dialect, _, name = op.name.partition(".")
        if dialect == "func" and name == "func" and StringAttr(op.attributes["sym_name"]).value == "main":
            main = op
        if dialect not in ("stablehlo", "chlo", "arith"):
            continue
        ops[name] += 1
        if name == "composite":
            composites[StringAttr(op.attributes["name"]).value] += 1
        for r in op.results:
            if not isinstance(r.type, RankedTensorType):
                continue
            t = RankedTensorType(r.type)
            f64 += str(t.element_type) == "f64"
            i64 += str(t.element_type) in ("i64", "ui64")
            if name == "constant" and not DenseElementsAttr(op.attributes["value"]).is_splat:
                n = 1
                for d in t.shape:
                    n *= d
                largest = max(largest, n)
    text = str(module)
    ftype = main.attributes["function_type"].value if main is not None else None
    return ModuleFacts(ops={op: ops.get(op, 0) for op in COUNTED_OPS}, instructions=sum(ops.values()),
                       arguments=len(ftype.inputs) if ftype else 0, results=len(ftype.results) if ftype else 0,
                       float8_types=sorted(set(re.findall(r"\b(f8E\w+|f4E\w+)", text))), f64_ops=f64, i64_ops=i64,
                       largest_constant=largest, composites=dict(composites), text_bytes=len(text))


def parse_module(text: str) -> "StableHlo":
    """A StableHLO module from its text, in a fresh torch-mlir context with the StableHLO dialect.
    Raises CompileError when the text does not parse."""
    require_torch_mlir()
    from torch_mlir._mlir_libs import _stablehlo
    from torch_mlir.ir import Context, Module

    context = Context()
    _stablehlo.register_dialect(context)
    try:
        with context:
            return StableHlo(Module.parse(text), context)
    except Exception as e:
        raise CompileError(f"not a StableHLO module: {str(e).splitlines()[0][:300]}") from None


class StableHlo:
    """One lowered module (in its torch-mlir MLIR context): `text` (pretty form), `artifact()` (a
    portable artifact at TARGET_VERSION) and `facts()`."""

    def __init__(self, module: Any, context: Any):
        self.module, self.context = module, context

    @property
    def text(self) -> str:
        return str(self.module)

    def facts(self) -> ModuleFacts:
        with self.context:
            return facts_of(self.module)

    def artifact(self, version: str = TARGET_VERSION) -> bytes:
        """The module as a StableHLO portable artifact (VHLO bytecode at `version`). Raises
        CompileError when the module uses an op or attribute `version` does not have."""
        from torch_mlir._mlir_libs import _stablehlo

        try:
            return _stablehlo.serialize_portable_artifact_str(self.text, version)
        except Exception as e:
            raise CompileError(f"StableHLO module not serializable at version {version}: {str(e)[:300]}") from None


def artifact_text(artifact: bytes) -> str:
    """The module of a portable artifact, as text (deserialized to the current StableHLO)."""
    require_torch_mlir()
    from torch_mlir._mlir_libs import _stablehlo

    return _stablehlo.deserialize_portable_artifact_str(artifact)


def stablehlo_versions() -> dict[str, str]:
    """{"current": ..., "minimum": ...} StableHLO versions of the torch-mlir here."""
    require_torch_mlir()
    from torch_mlir._mlir_libs import _stablehlo

    return {"current": _stablehlo.get_current_version(), "minimum": _stablehlo.get_minimum_version()}
