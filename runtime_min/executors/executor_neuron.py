"""neuron executor: run one bucket's NEFF with the shared weights, behind the cpu executor's interface.

NOT RUN ON HARDWARE. The loading calls follow torch-neuronx's own module for traced models
(torch_neuronx/xla_impl/trace.py `NeuronModule`: `torch.classes.neuron.Model(neff, metaneff)` and
`torch.ops.neuron.forward_v2(tensors, model)`), which transformers-neuronx's test utilities use the
same way; they have never been executed here.

Before the SDK touches any file (`NeuronExecutor`, at session load):
- the host's torch-neuronx and neuronx-cc releases equal the compiling ones: a NEFF's feature bits
  and the runtime must come from one SDK release (aws-neuron-sdk issue 820; runtime_min/executors/neff.py);
- every bucket has its `NeffRecord` in the manifest, and every NEFF's 1024-byte header passes
  runtime_min/executors/neff.py `verify_neff` (sizes, feature bits, lnc_size against this host's LNC).
Loading is lazy per bucket, as on cpu.

The NEFF's interface is rebuilt from the manifest: inputs `input0..` = the bucket's weights then its
data+state inputs, outputs `output0..` = `Bucket.outputs`, in the MetaNeff message torch-neuronx
builds from the HLO at trace time (trace.py `hlo_metaneff`; the compiler checked that the traced
interface equals the bucket's). Weights are passed from host memory on every call, so each step
copies them to the device: correct, not fast (torch_neuronx.move_trace_to_device is the SDK's way
to keep them resident, left for when this runs on hardware).
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any, Mapping

import torch

from ..bundle.bundle import NEURON_INDEX
from ..bundle.schema import Bucket, BundleError, Manifest
from .neff import NeffHeader, NeffRecord, host_lnc, verify_neff

# manifest toolchain key -> pip distribution of the Neuron SDK.
SDK_DISTRIBUTIONS = {"torch_neuronx": "torch-neuronx", "neuronx_cc": "neuronx-cc",
                     "nki": "nki"}
# Versions that must be equal on the compiling and the running host.
MATCHING = ("torch_neuronx", "neuronx_cc")
_META_DTYPES = {torch.float32: "FLOAT", torch.float64: "DOUBLE", torch.bfloat16: "BFLOAT16", torch.float16: "FLOAT16",
                torch.uint8: "UINT8", torch.int8: "INT8", torch.int16: "INT16", torch.int32: "INT32",
                torch.int64: "INT64", torch.bool: "BOOL"}


def sdk_versions() -> dict[str, str | None]:
    """Installed versions of the Neuron SDK wheels ({toolchain key: version or None})."""
    out: dict[str, str | None] = {}
    for key, dist in SDK_DISTRIBUTIONS.items():
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = None
    return out


def check_sdk_versions(recorded: Mapping[str, Any], host: Mapping[str, Any] | None = None) -> None:
    """Raise BundleError unless `host` (default: this host) has the recorded torch-neuronx release
    and, where neuronx-cc is installed at all, its recorded release (a host that only runs bundles
    needs no compiler)."""
    host = sdk_versions() if host is None else host
    for key in MATCHING:
        if key == "neuronx_cc" and host.get(key) is None:
            continue
        if recorded.get(key) != host.get(key):
            raise BundleError(f"bundle was compiled with {SDK_DISTRIBUTIONS[key]} {recorded.get(key)}, this host has "
                              f"{host.get(key)}; a NEFF runs only with the SDK release that compiled it: "
                              "recompile the bundle here")


def neff_records(manifest: Manifest) -> dict[str, NeffRecord]:
    """{bucket file: its NeffRecord} from `manifest.compiler["neff"]`; BundleError naming a bucket
    without one or a malformed record."""
    raw = manifest.compiler.get("neff")
    if not isinstance(raw, dict):
        raise BundleError("manifest compiler.neff: missing (a neuron bundle records every NEFF's flags and header)")
    out = {}
    for b in manifest.buckets:
        if b.file not in raw:
            raise BundleError(f"manifest compiler.neff: no record for {b.file}")
        out[b.file] = NeffRecord.from_dict(raw[b.file], f"compiler.neff[{b.file!r}]")
    return out


class NeuronExecutor:
    """Checks a neuron bundle for this host (module docstring) and makes its executables:
    `executor(path, bucket, weights)` -> NeuronExecutable, like `CpuExecutable(path, bucket, weights)`.

    environ / product_name: for the host LNC (runtime_min/executors/neff.py `host_lnc`); sdk: host SDK
    versions (default: installed). Raises BundleError / NeffError naming the first problem.
    """

    def __init__(self, root: Path, manifest: Manifest, environ: Mapping[str, str] | None = None,
                 product_name: str | None = None, sdk: Mapping[str, Any] | None = None):
        check_sdk_versions(manifest.toolchain, sdk)
        records = neff_records(manifest)
        lnc, source = host_lnc(environ, product_name)
        self.headers = {f: verify_neff(Path(root) / f, r, lnc, source) for f, r in records.items()}

    def __call__(self, path: Path, bucket: Bucket, weights: list[torch.Tensor]) -> "NeuronExecutable":
        return NeuronExecutable(path, bucket, weights, self.headers[bucket.file])


class NeuronExecutable:
    """One loaded bucket (a runtime_min/core/runner.py Executable); `run(inputs)` as
    `CpuExecutable.run` (weights bound here, inputs = the data+state tensors of `bucket.inputs`,
    returns the tensors of `bucket.outputs`).

    header: the NEFF's header, already verified (NeuronExecutor). Raises BundleError when
    torch-neuronx is missing or refuses the NEFF.
    """

    def __init__(self, path: Path, bucket: Bucket, weights: list[torch.Tensor], header: NeffHeader):
        self.bucket, self.weights, self.header = bucket, weights, header
        self._model = _load(Path(path).read_bytes(), bucket, weights)

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """inputs: contiguous tensors matching `bucket.inputs` (shape, dtype); ValueError otherwise,
        since the NEFF's buffers have static sizes."""
        self.bucket.check_inputs(inputs)
        return list(torch.ops.neuron.forward_v2([*self.weights, *inputs], self._model))


def _load(neff: bytes, bucket: Bucket, weights: list[torch.Tensor]) -> Any:
    """torch-neuronx's model object for `neff` with the bucket's interface (module docstring)."""
    try:
        import torch_neuronx  # noqa: F401  registers torch.classes.neuron and torch.ops.neuron
        from torch_neuronx.proto import metaneff_pb2
    except ImportError as e:
        raise BundleError(f"{bucket.file}: running a NEFF needs torch-neuronx ({e}); it comes from the AWS Neuron "
                          f"pip index ({NEURON_INDEX})") from None
    meta = metaneff_pb2.MetaNeff()
    specs = [(tuple(w.shape), w.dtype) for w in weights] + [(s.shape, s.torch_dtype) for s in bucket.inputs]
    for i, (shape, dtype) in enumerate(specs):
        _describe(meta.input_tensors.add(), f"input{i}", shape, dtype, metaneff_pb2, bucket)
    for i, s in enumerate(bucket.outputs):
        _describe(meta.output_tensors.add(), f"output{i}", s.shape, s.torch_dtype, metaneff_pb2, bucket)
    try:
        return torch.classes.neuron.Model(neff, meta.SerializeToString())
    except RuntimeError as e:
        raise BundleError(f"{bucket.file}: the Neuron runtime refused it ({e})") from None


def _describe(tensor: Any, name: str, shape: tuple[int, ...], dtype: torch.dtype, pb: Any, bucket: Bucket) -> None:
    kind = _META_DTYPES.get(dtype)
    if kind is None:
        raise BundleError(f"{bucket.file}: {name} has dtype {dtype}, which a NEFF interface cannot describe")
    tensor.name = name.encode()
    tensor.shape[:] = list(shape)
    tensor.data_type = getattr(pb.MetaTensor.DataType, kind)
