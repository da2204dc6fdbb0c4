"""dsneuron.kernels_nki: the custom-op contracts, their torch references, and the kernel codecs.

Importing the package registers the `torch.ops.dsneuron.*` custom ops (see `ops`).
"""

from dsneuron.kernels_nki import ops  # noqa: F401  (registration side effect)
