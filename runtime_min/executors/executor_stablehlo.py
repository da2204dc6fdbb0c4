"""StableHLO executor: run a `--stablehlo-only` neuron bundle's modules on this CPU with XLA (jaxlib).

A check, not a deployment target: it proves on a host without Trainium that each bucket's
StableHLO module (compiler/stablehlo.py) computes what the model's torch graph computes, through
the same `Session` (run, compare) as every other bundle. The NKI kernels' composites run through
their decompositions (the kernels' torch references), so what runs here is the module a trn host
would hand to neuronx-cc minus the kernel binding; nothing of Trainium's arithmetic.

Why XLA's CPU client rather than IREE: it compiled every micro bucket where IREE 3.13's llvm-cpu
backend stopped at the sort of topk's int64 indices (docs/neuron.md), in
about a third of IREE's time, and it reads the portable artifacts directly (jaxlib's PJRT CPU
client deserializes the VHLO bytecode). jax/jaxlib come with the `test` extra; without them this
executor raises BundleError naming the packages.

Calling convention (the manifest's `compiler.stablehlo`): the module takes the bucket's weights
then its inputs, and returns its outputs, in the manifest's order. bf16 crosses as ml_dtypes
bfloat16 arrays; int64 as int64 (jax's x64 mode).

XLA runs with `--xla_allow_excess_precision=false`: by default its simplifier drops a convert pair
f32 -> bf16 -> f32 (keeping the fp32 value), which skips the very bf16 roundings the reference
makes (each hyper-connection collapse, every norm input): a quarter of one micro attention
half's input elements came out one bf16 step off with it, none without.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..bundle.schema import Bucket, BundleError


def _xla() -> tuple[Any, Any, Any]:
    """(jax, the CPU client, its first device); BundleError naming the packages without them."""
    flag = "--xla_allow_excess_precision=false"
    added = flag not in os.environ.get("XLA_FLAGS", "")
    if added:  # read when the CPU client is made (its first use in the process)
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    try:
        import jax
        from jax._src import xla_bridge
    except ImportError as e:
        raise BundleError(f"running a StableHLO bundle here needs jax and jaxlib (pip install -e '.[test]'), which "
                          f"are not importable ({e})") from None
    if added and xla_bridge.backends_are_initialized():
        raise BundleError("XLA's CPU client was made in this process before dsneuron's StableHLO executor could set "
                          f"XLA_FLAGS={flag}; set it in the environment before jax makes its client")
    jax.config.update("jax_enable_x64", True)  # int64 inputs (tokens, positions) stay int64
    client = xla_bridge.get_backend("cpu")
    return jax, client, client.local_devices()[0]


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A host tensor as a numpy array of the same bytes (bf16 as ml_dtypes.bfloat16)."""
    import ml_dtypes

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def to_torch(a: Any) -> torch.Tensor:
    """An XLA result as a torch tensor (a copy)."""
    import ml_dtypes

    arr = np.array(a)
    if arr.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def compile_module(artifact: bytes, what: str) -> Any:
    """A StableHLO module (portable artifact or text) compiled by XLA's CPU client; BundleError
    naming `what` when XLA refuses it."""
    _, client, device = _xla()
    from jax._src import compiler
    from jax._src.lib import xla_client

    try:
        return client.compile_and_load(artifact, xla_client.DeviceList((device,)),
                                       compiler.get_compile_options(num_replicas=1, num_partitions=1))
    except Exception as e:  # jaxlib raises its own runtime error type
        raise BundleError(f"{what}: XLA:CPU could not compile the StableHLO module: {str(e).splitlines()[0][:300]}") from None


class StableHloExecutable:
    """One bucket's module compiled by XLA:CPU, with its weights placed once; a runtime_min/core/runner.py
    Executable: `run(inputs)` takes the tensors of `bucket.inputs` and returns
    those of `bucket.outputs`. Construction raises BundleError without jax/jaxlib or when XLA
    refuses the module."""

    def __init__(self, path: Path, bucket: Bucket, weights: list[torch.Tensor]):
        jax, _, self._device = _xla()
        self.bucket = bucket
        self._exe = compile_module(path.read_bytes(), bucket.file)
        self._weights = [jax.device_put(to_numpy(w), self._device) for w in weights]

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """inputs: tensors matching `bucket.inputs` exactly (shape, dtype); raises ValueError otherwise."""
        import jax

        self.bucket.check_inputs(inputs)
        args = [*self._weights, *[jax.device_put(to_numpy(t), self._device) for t in inputs]]
        return [to_torch(o) for o in self._exe.execute(args)]
