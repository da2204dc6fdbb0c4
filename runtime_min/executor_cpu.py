"""cpu executor: run one bucket's AOTInductor package (`.pt2`) with the shared weights.

The package is opened with the C++ loader `torch._C._aoti.AOTIModelPackageLoader`, not
`torch._inductor.aoti_load_package`: the Python wrapper also deserialises any exported programs and
weights a `.pt2` may carry (with torch.load), while the C++ loader only extracts and dlopens the
compiled model. Before loading, the archive's member list is checked to hold nothing but the
AOTInductor model and archive metadata, so no pickle can ride along.

Custom ops lowered as "call" (compiler/lower.py) are dispatched through the registered op at run
time; the ops of the `dsneuron` namespace are registered by importing `dsneuron.kernels_nki`.
"""

from __future__ import annotations

import importlib
import json
import zipfile
from pathlib import Path

import torch

from .schema import Bucket, BundleError

_ARCHIVE_META = {"archive_format", "archive_version", ".data/version", "byteorder", ".data/serialization_id"}
_OP_MODULES = {"dsneuron": "dsneuron.kernels_nki"}


def check_archive(path: Path) -> None:
    """Raise BundleError unless `path` is a zip holding only an AOTInductor model and metadata."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except zipfile.BadZipFile:
        raise BundleError(f"{path.name}: not an AOTInductor package (not a zip archive)") from None
    for name in names:
        _, _, inner = name.partition("/")
        if name.endswith("/"):
            continue
        if inner in _ARCHIVE_META or inner.startswith("data/aotinductor/"):
            if not name.endswith((".pkl", ".pt")):
                continue
        raise BundleError(f"{path.name}: unexpected archive member {name!r} (only AOTInductor models are loaded)")


def _argument_count(in_spec: str) -> int | None:
    """Positional arguments of an AOTInductor model from its serialised input pytree spec
    (`[version, {"type": "builtins.tuple", "children_spec": [args tuple, kwargs dict]}]`); None when
    the spec has another form, since it is torch's internal format and only a cross-check here."""
    try:
        args = json.loads(in_spec)[1]["children_spec"][0]
        return len(args["children_spec"]) if args["type"] == "builtins.tuple" else None
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def register_custom_ops(custom_ops: dict[str, str]) -> None:
    """Make every op lowered as "call" dispatchable; raises BundleError naming an op that is not."""
    for op, mode in custom_ops.items():
        if mode != "call":
            continue
        ns, _, rest = op.partition("::")
        if ns in _OP_MODULES:
            importlib.import_module(_OP_MODULES[ns])
        name = rest.split(".")[0]
        if not hasattr(getattr(torch.ops, ns), name):
            raise BundleError(f"the bundle's executables call custom op {op} at run time, but no loaded module "
                              "registers it")


class CpuExecutable:
    """One loaded bucket. `run(inputs)` takes the data+state inputs of `bucket.inputs` (the weights
    are bound at construction) and returns the outputs of `bucket.outputs`. Construction raises
    BundleError when the archive holds more than a model (`check_archive`), the loader refuses it,
    or the model takes another number of arguments than the manifest's weights + inputs."""

    def __init__(self, path: Path, bucket: Bucket, weights: list[torch.Tensor]):
        check_archive(path)
        self.bucket = bucket
        self.weights = weights
        try:
            self._loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        except RuntimeError as e:
            raise BundleError(f"{bucket.file}: the AOTInductor loader refused it ({e})") from None
        takes = _argument_count(self._loader.get_call_spec()[0])
        if takes is not None and takes != len(weights) + len(bucket.inputs):
            raise BundleError(f"{bucket.file}: the executable takes {takes} arguments, the manifest gives it "
                              f"{len(weights)} weights + {len(bucket.inputs)} inputs")

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """inputs: tensors matching `bucket.inputs` exactly (shape, dtype); raises ValueError otherwise,
        since the compiled code indexes memory by the static shapes."""
        self.bucket.check_inputs(inputs)
        return self._loader.boxed_run([*self.weights, *inputs])
