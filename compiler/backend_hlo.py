"""neuron target, HLO only (`dsneuron compile --target neuron --hlo-only`): each bucket to an XLA HLO module.

Where torch-xla imports but the Neuron SDK does not (this host: torch 2.9 + torch-xla 2.9 on
XLA:CPU), a neuron compile stops at the HLO that neuronx-cc takes. Per bucket, the program the
neuron backend would compile (its lowering, the XLA spelling, compiler/compile.py
`_export`) runs on the XLA device under backend_neuron.NkiDispatch and the HLO module of its
outputs is written as a serialized HloModuleProto, the input of `neuronx-cc compile --framework
XLA` (aws-neuron-sdk:compiler/neuronx-cc/how-to-generate-neff.rst). With the `nki` package
importable, each NKI op is its kernel's custom-call, as on a trn host; without it, each op is its
torch reference (compiler/xla_check.py REFERENCE_KERNELS), and the manifest says which (`compiler.nki_ops`).

The HLO's parameters are the device tensors the trace read, in the order torch-xla numbers them:
the bucket's inputs (weights, data, state) and values the graph holds (tables, scalars).
`compiler.hlo[file]["parameters"]` maps parameter i to {"input": j}, position j in the bucket's
calling convention (its `weights`, then its `inputs`, as the manifest lists them; weights as
stored, after the manifest's `load_casts` and `weight_views`), or to {"value": key} of the
bucket's side file `<stem>.values.safetensors`, so a runner can feed a NEFF built from it.
Nothing here runs a bundle: `dsneuron run` refuses an HLO-only bundle (runtime_min/bundle.py).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dsneuron.runtime_min.bundle import HLO_BACKEND, host_toolchain
from dsneuron.runtime_min.schema import BundleError

from .backend_neuron import INPUT_VIEWS, NKI_KERNELS, kernel_sources, lowering
from .export import CompileError
from .lower import InlineCustomOps
from .xla_check import REFERENCE_KERNELS, require_torch_xla, trace_bucket

BACKEND = HLO_BACKEND
VALUES_SUFFIX = ".values.safetensors"


def check_hlo_only(target: str) -> Any:
    """Raise BundleError unless an `--hlo-only` compile of `target` can run here (target neuron,
    torch-xla importable); returns the torch_xla module."""
    if target != "neuron":
        raise BundleError(f"--hlo-only goes with --target neuron (got --target {target})")
    return require_torch_xla()


def values_file(hlo_file: Path) -> Path:
    """The side file of the values an HLO module reads besides the bucket's inputs."""
    return hlo_file.with_name(hlo_file.name.removesuffix(".hlo.pb") + VALUES_SUFFIX)


class HloBackend:
    """`compile_bundle`'s Backend for `--target neuron --hlo-only` (see the module docstring).
    Raises BundleError at construction when torch-xla is not importable. Not cached: an HLO
    module comes with its side file of values, which the compile cache does not hold."""

    target = "neuron"
    name = BACKEND
    input_views = INPUT_VIEWS
    xla_spelling = True
    cacheable = False

    def __init__(self) -> None:
        torch_xla = require_torch_xla()
        self.kernel_ops = "kernel" if importlib.util.find_spec("nki") is not None else "torch reference"
        self.bindings = dict(NKI_KERNELS) if self.kernel_ops == "kernel" else dict(REFERENCE_KERNELS)
        self.kernels = kernel_sources()
        self.toolchain = {**host_toolchain(), "cpu_isa": [], "torch_xla": torch_xla.__version__}
        self._facts: dict[str, dict[str, Any]] = {}

    def lowering(self) -> InlineCustomOps:
        return lowering(self.kernels)

    def key_ingredients(self, stem: str) -> tuple[list[str], dict[str, Any]]:
        return ["--hlo-only", f"nki_ops={self.kernel_ops}"], {"torch": torch.__version__,
                                                              "torch_xla": self.toolchain["torch_xla"]}

    def compile(self, program: torch.export.ExportedProgram, out: Path, stem: str) -> None:
        """Trace `program` on the XLA device and write its HloModuleProto to `out` and the values it
        reads besides its inputs to `values_file(out)` (both written whole, then renamed)."""
        torch_xla = require_torch_xla()
        dev = torch_xla.device()
        sig = program.graph_signature
        user = set(sig.user_inputs)
        specs = [(n.name, n.meta["val"]) for n in program.graph.nodes if n.op == "placeholder" and n.name in user]
        args = [torch.zeros(v.shape, dtype=v.dtype).to(dev) for _, v in specs]
        ids = {torch_xla._XLAC._xla_get_tensor_id(a): i for i, a in enumerate(args)}
        outs, fallbacks = trace_bucket(program, args, self.bindings)
        if fallbacks:
            raise CompileError(f"{stem}: torch-xla ran {', '.join(fallbacks)} on the host, which cuts the graph: "
                               "no single HLO module; spell it for XLA (kernels_nki/formats.py xla_spelling)")
        if len(outs) != len(sig.user_outputs):
            raise CompileError(f"{stem}: the trace gave {len(outs)} outputs, the program has {len(sig.user_outputs)}")
        proto = torch_xla._XLAC._get_xla_tensors_hlo_proto(outs)
        data_ids, data = torch_xla._XLAC._get_tensors_xla_device_data_node(outs)
        parameters, values = [], {}
        for k, (tid, t) in enumerate(zip(data_ids, data)):
            if tid in ids:
                parameters.append({"input": ids[tid]})
            else:
                key = f"p{k}"
                values[key] = t.cpu().contiguous()
                parameters.append({"value": key})
        with tempfile.TemporaryDirectory(prefix=f".{out.stem}.", dir=out.parent) as tmp:
            hlo, side = Path(tmp) / out.name, Path(tmp) / values_file(out).name
            hlo.write_bytes(proto)
            save_file(values, str(side))
            os.chmod(side, 0o644)  # as every other bundle file (a private temp file otherwise)
            os.replace(side, values_file(out))
            os.replace(hlo, out)
        self._facts[stem] = {"format": "HloModuleProto", "parameters": parameters,
                             "values_file": values_file(out).name}

    def bucket_facts(self, path: Path, stem: str) -> dict[str, Any]:
        """The bucket's HLO record; the input indexes become the program's input positions."""
        return self._facts[stem]

    def compiler_record(self, custom_ops: dict[str, str], facts: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return {"backend": BACKEND, "flags": ["--hlo-only"], "custom_ops": custom_ops, "nki_ops": self.kernel_ops,
                "nki_kernels": {op: entry["kernel"] for op, entry in self.kernels.items()}, "hlo": facts}
