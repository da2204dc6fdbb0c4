"""dsneuron: ahead-of-time compiler for DeepSeek-V4.x-family models on AWS Neuron, with a cpu target.

Subpackages: `compiler` (CLI, buckets, export, backends, bundle), `graphs` (model, number formats,
checkpoint), `kernels_nki` (custom ops, torch references, NKI kernels), `runtime_min` (bundle loading
and generation).
"""

__version__ = "0.1.0"


class UserError(Exception):
    """Bad input from the user (config, checkpoint, bundle, prompt): the message names the problem
    and the limit. The CLI prints it and exits with code 2; every module's user-facing error
    derives from it so that one `except` serves them all."""
