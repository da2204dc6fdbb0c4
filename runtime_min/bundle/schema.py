"""The bundle format: THE one definition that the compiler's writer and runtime_min's loader share.

A bundle is a folder:

    manifest.json         this module's `Manifest`, as JSON (written last: a folder without it is not a bundle)
    weights.safetensors   every weight tensor once; each bucket executable takes the ones it names as inputs
    tokenizer/            tokenizer.json (+ config files) copied from the compiling host
    buckets/<kind>_b<batch>_s<len>.<ext>   one executable per bucket (`.pt2` AOTInductor package on cpu), or
    buckets/<kind>_b<batch>_s<len>/<stage kind>.<ext>   a staged bucket: one executable per stage kind

Evolution rules (ExecuTorch schema/README style): add fields at the end with a default, never remove or
re-purpose a field, never change a default's meaning. A change an old runtime would misread bumps
`SCHEMA_VERSION`; the loader checks the version before reading any other field.

Seal: manifest.json ends with `manifest_sha256`, the sha256 of the manifest's canonical content
(`content_sha256`: every other field, as compact JSON with sorted keys), and the loader refuses a
manifest whose content does not match it, naming the file as edited. Why a seal rather than a
cross-check of the buckets against the executables: the AOTInductor package loader exposes no input
or output shapes (only the argument count, which runtime_min/executors/executor_cpu.py does cross-check, and
platform metadata), the NEFF header runtime_min/executors/neff.py reads holds none either, and most of what a
hand edit breaks is not a shape at all: a decode bucket's `capacity` decides which positions the
runtime hands that executable, and the state fills, weight names, engram hashing parameters and
token ids must be the ones the code was compiled with and the weights were written for. None of
these can be changed without recompiling, so any edit is refused up front instead of failing deep
inside an executable (a C++ index error) or silently computing garbage.
The seal guards against mistakes, not attacks: whoever can rewrite the manifest can recompute it
(`content_sha256`), as they can the files' checksums. The field is appended at the end (an old
runtime ignores it) and required by this loader; the schema version is unchanged.

Calling convention of every bucket (both targets):
    inputs  = [weights named in `Bucket.weights`, in that order] + `Bucket.inputs` (data, then state)
    outputs = `Bucket.outputs` = [logits [B, V] float32] + new state, in the order of `Manifest.state`
A single-executable bucket is one executable with exactly that convention. A staged bucket
(`Bucket.stages` not empty; schema version 2) runs its stages in order instead: each `Stage` is an
executable called as [its weights] + [the values it names as inputs] -> the values it names as
outputs, where a value is a bucket input (by name), an output of an earlier stage, or one of the
columns `engram_ids.e` = engram_ids[:, :, e] of the engram_ids input; the bucket's outputs are the
values of those names after the last stage. Stages of one kind share one executable file (the
model's layers of one kind: graphs/stages.py). A prefill bucket with `min_seq_len` > 0 takes every
multiple of `seq_len_step` from min_seq_len to seq_len tokens: its executables have a dynamic token
dimension, and the runtime pads a prompt only up to the next such count (`Bucket.padded_len`).
Prefill data inputs: tokens [B, S] int64 (right-padded), valid_len [B] int64, engram_ids [B, S, E, C]
int64. A single-graph prefill of a speculative compile (schema version 7) returns after its logits
`main_hidden` [B, W, T*D] bfloat16 (W = min(window_size, S)): each row's last W prompt positions
from max(0, valid_len - W) (graphs/steps.py prefill_seed), what seeds the drafter's rings. Decode data inputs: tokens [B, 1] int64, pos [B] int64, engram_ids [B, 1, E, C] int64.
Chunk buckets (schema version 4; a prefill continuing from state, graphs/steps.py prefill_chunk):
tokens [B, S] int64 (right-padded), pos [B] int64 (each row's first position), valid_len [B]
int64, engram_ids [B, S, E, C] int64, then the state at `capacity`, like a decode bucket's; the
file name's length is the capacity, and min_seq_len may give it a range of token counts as a
prefill's.
Verify buckets (schema version 7; a speculative decoding verify, graphs/steps.py verify_chunk): a
chunk bucket's inputs and state, whose outputs are the logits [B, S, V] float32 at every position,
then `main_hidden` [B, S, T*D] bfloat16 (the stream entering each DSpark target layer's attention,
averaged over its hc copies, in target order), then the new state. A staged verify bucket (the cpu
target's: the chunk bucket's stages and token range, the head at every position) returns the
logits and the state only; the runtime reads main_hidden from the inputs of its target layers'
attention stages, as it does from a staged chunk bucket, which a bundle without verify buckets
verifies on.
Draft buckets (schema version 7; the DSpark drafter's step, graphs/dspark.py DraftStep; seq_len is
its block K, capacity the context it drafts within): inputs token [B] int64, pos [B] int64,
main_hidden [B, S, T*D] bfloat16 (a verify's, S = 1 + K), seed_pos [B] and seed_count [B] int64
(the positions of main_hidden to write into the rings), gumbel [B, K, V] float32 and temperature
[B] float32 (the draw), then one ring per drafter stage `mtp.<s>.ring` [B, W, head_dim] bfloat16;
outputs draft_tokens [B, K] int64, draft_logits [B, K, V] float32, confidence [B, K] float32, then
the rings. The rings are the drafter's state, not the model's: the runtime keeps them per request.

State across capacities: a state tensor whose shape depends on the context capacity differs from its
shape at another capacity in exactly one dimension; rows along it are indexed by position (or by a
function of position that is monotone), so a state grows to a larger capacity by appending rows filled
with the tensor's `fill`. Every state tensor starts as `fill` everywhere (`StateEntry.fill`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from dsneuron import UserError
from dsneuron.kernels_nki.prepare import PREPARE_FORMATS, Prepare

SCHEMA_VERSION = 2
#: versions this runtime reads: 1 has single-executable buckets only, 2 adds staged buckets and
#: min_seq_len (fields appended with defaults, so a version-1 manifest reads unchanged), 3 weight_files,
#: 4 chunk buckets, 5 numerics "fast", 6 state written in place, 7 verify and draft buckets
SUPPORTED_SCHEMA_VERSIONS = (1, 2, 3, 4, 5, 6, 7)
#: the version of a manifest whose staged buckets write state in place (`written_in_place`): an
#: older runtime would hand the stages the caller's own state tensors
IN_PLACE_SCHEMA_VERSION = 6
#: the version of a manifest with numerics "fast": its executables call the fast GEMM ops, which an
#: older runtime neither registers nor knows to be another numerics (an exact manifest keeps its version)
NUMERICS_SCHEMA_VERSION = 5
#: the cpu kernels' numerics a manifest may declare (graphs.config.NUMERICS_MODES), the first the default
MANIFEST_NUMERICS = ("exact", "fast")
#: the version of a manifest with `weight_files` (weights in several shards): an older runtime
#: would look for every tensor in weights_file
WEIGHT_FILES_SCHEMA_VERSION = 3
#: the most bytes of tensors one weights shard holds (Hugging Face's default max_shard_size, 5GB)
WEIGHT_SHARD_BYTES = 5 * 10**9
FORMAT = "dsneuron-bundle"
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
TOKENIZER_DIR = "tokenizer"
BUCKETS_DIR = "buckets"
KINDS = ("prefill", "decode", "chunk", "verify", "draft")
#: the data inputs of each kind, in order, before the state inputs (module docstring)
DATA_INPUTS = {"prefill": ("tokens", "valid_len", "engram_ids"), "decode": ("tokens", "pos", "engram_ids"),
               "chunk": ("tokens", "pos", "valid_len", "engram_ids"),
               "verify": ("tokens", "pos", "valid_len", "engram_ids"),
               "draft": ("token", "pos", "main_hidden", "seed_pos", "seed_count", "gumbel", "temperature")}
#: the version of a manifest with chunk buckets: an older runtime does not know the kind
CHUNK_SCHEMA_VERSION = 4
#: the version of a manifest with verify buckets (a speculative verify's chunk returning the logits
#: fp32 [B, S, V] and MAIN_HIDDEN bf16 [B, S, T*D] at every position) or draft buckets (the DSpark
#: drafter's step): an older runtime does not know the kinds
SPECULATIVE_SCHEMA_VERSION = 7
#: a verify bucket's second output: the stream entering each DSpark target layer, hc-averaged
MAIN_HIDDEN = "main_hidden"
#: a draft bucket's outputs before its rings (module docstring)
DRAFT_OUTPUTS = ("draft_tokens", "draft_logits", "confidence")
#: wiring values of a staged bucket the runtime derives from its data inputs: "engram_ids.e" (column e
#: of engram_ids, [B, S, C]) and "last" (int64 [B], the position the head reads: valid_len - 1 in a
#: prefill, 0 in a decode step)
DERIVED_INPUTS = ("engram_ids.e", "last")


def engram_columns(engram_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """engram_ids int64 [B, S, E, C] -> {"engram_ids.e": [B, S, C]} per engram layer e (the e-th entry
    of engram_layer_ids), each a fresh copy with the canonical strides: contiguous() of the slice
    would keep its strides along a size-1 dimension (a decode step's one token), and an executable
    takes exactly the strides it was compiled for."""
    return {f"engram_ids.{e}": engram_ids[:, :, e].clone(memory_format=torch.contiguous_format)
            for e in range(engram_ids.shape[2])}
# Executable file extension per target.
# "neuron-stablehlo": the StableHLO portable artifacts of `dsneuron compile --target neuron --stablehlo-only`
EXECUTABLE_EXT = {"cpu": "pt2", "neuron": "neff", "neuron-stablehlo": "mlirbc"}
# Custom-op lowering modes recorded in `Compiler.custom_ops`: "inline" = the op's torch reference was
# traced into aten ops before the backend compile (no Python at run time); "call" = the executable
# calls the registered op through the dispatcher, so the op's module must be imported before loading
# (on neuron: a kernel's op, a StableHLO composite); "kernel" = answered by an NKI kernel's op (neuron).
LOWERING_MODES = ("inline", "call", "kernel")


#: the manifest field holding `content_sha256` of the rest of the manifest (module docstring, Seal)
SEAL = "manifest_sha256"

#: outputs named "probe.<stage>" are stage tensors of a probe bundle (`dsneuron compile --probes`),
#: returned for the golden comparison and never carried as state
PROBE_PREFIX = "probe."

class BundleError(UserError):
    """A bundle cannot be used: missing or tampered file, unknown schema version, unavailable target,
    incompatible toolchain or malformed manifest. The message names the file or field and the limit."""


def bucket_file(kind: str, batch: int, length: int, target: str) -> str:
    """Bundle-relative path of one bucket executable, e.g. `buckets/prefill_b1_s128.pt2`.

    `length` is the prefill seq_len or the decode context capacity.
    """
    return f"{BUCKETS_DIR}/{kind}_b{batch}_s{length}.{EXECUTABLE_EXT[target]}"


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float8_e4m3fn` -> "float8_e4m3fn" (the manifest spelling)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, where: str) -> torch.dtype:
    """Inverse of `dtype_name`; raises BundleError naming `where` for anything that is not a dtype."""
    value = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(value, torch.dtype):
        raise BundleError(f"manifest {where}: unknown dtype {name!r}")
    return value


def encode_fill(value: float) -> str:
    """Fill values travel as strings so that -inf/nan stay strict JSON."""
    return repr(float(value))


def decode_fill(text: str, where: str) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        raise BundleError(f"manifest {where}: fill {text!r} is not a number") from None


@dataclass(frozen=True)
class TensorSpec:
    """One executable input or output: name, static shape, dtype name (see `dtype_name`)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> "TensorSpec":
        r = _obj(raw, where)
        shape = _get(r, "shape", list, where)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise BundleError(f"manifest {where}.shape: expected a list of non-negative integers, got {shape!r}")
        spec = cls(_get(r, "name", str, where), tuple(shape), _get(r, "dtype", str, where))
        parse_dtype(spec.dtype, f"{where}.dtype")
        return spec

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype, self.name)


@dataclass(frozen=True)
class StateEntry:
    """One state tensor of the step functions, in state-layout order, with its initial fill value."""

    name: str
    dtype: str
    fill: float

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "fill": encode_fill(self.fill)}

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> "StateEntry":
        r = _obj(raw, where)
        entry = cls(_get(r, "name", str, where), _get(r, "dtype", str, where),
                    decode_fill(_get(r, "fill", str, where), f"{where}.fill"))
        parse_dtype(entry.dtype, f"{where}.dtype")
        return entry


def _prepare_from_dict(raw: Any, where: str) -> Prepare:
    """A manifest `prepare` record (kernels_nki/prepare.py `Prepare.to_dict`) -> the recipe;
    BundleError naming `where` and the key when it is malformed."""
    r = _obj(raw, where)
    fmt = _get_choice(r, "fmt", PREPARE_FORMATS, where)
    names = {key: _names(r, key, where, "tensor names") for key in ("weights", "scales", "outputs")}
    if not names["weights"] or len(names["outputs"]) != 2:
        raise BundleError(f"manifest {where}: needs at least one weight and exactly two outputs")
    groups = _get(r, "groups", int, where)
    if groups < 0:
        raise BundleError(f"manifest {where}.groups: must be >= 0 (got {groups})")
    return Prepare(fmt, names["weights"], names["scales"], groups, names["outputs"])


@dataclass(frozen=True)
class Stage:
    """One stage of a staged bucket (module docstring): `file` run on [`weights`] + the values
    named by `inputs`, producing the values named by `outputs`.

    per_token: the executable takes any token count from 1 to the bucket's seq_len and computes
    each token row from that row alone (embed, engram, MoE half, head: graphs/stages.py), so a
    call with a valid_len runs it on the rows valid_len covers only (executor_cpu.StagedExecutable).
    Optional in the manifest (False when absent): a runtime that ignores it runs every padded row,
    with the same results at the valid positions."""

    name: str
    file: str
    weights: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    per_token: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "file": self.file, "weights": list(self.weights), "inputs": list(self.inputs),
                "outputs": list(self.outputs), **({"per_token": True} if self.per_token else {})}

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> "Stage":
        r = _obj(raw, where)
        lists = {key: _names(r, key, where, "names") for key in ("weights", "inputs", "outputs")}
        per_token = _get(r, "per_token", bool, where) if "per_token" in r else False
        return cls(_get(r, "name", str, where), _get(r, "file", str, where), **lists, per_token=per_token)


@dataclass(frozen=True)
class Bucket:
    """One compiled executable.

    kind: "prefill", "decode", "chunk" (a prefill continuing from state), "verify" (a chunk
        returning every position's logits and main_hidden) or "draft": module docstring.
    batch: batch dimension B.
    seq_len: tokens per call (prefill, chunk: the bucket's S; decode: 1).
    capacity: context capacity of the state it reads and writes (positions 0..capacity-1).
    file: bundle-relative path of the executable.
    weights: names in weights.safetensors passed first, in this order.
    inputs / outputs: the data+state inputs after the weights, and the outputs (see module docstring).
    cache_key: the compile-cache key it was built under (sha256 hex), for provenance; of a staged
        bucket, the sha256 of its stage executables' keys.
    stages: the stages of a staged bucket (then `file` is the folder of their executables and
        `weights` is empty), or () for a single executable.
    min_seq_len: > 0 for a prefill or chunk bucket that takes a range of token counts: every
        multiple of seq_len_step in min_seq_len..seq_len.
    """

    kind: str
    batch: int
    seq_len: int
    capacity: int
    file: str
    weights: tuple[str, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    cache_key: str
    stages: tuple[Stage, ...] = ()
    min_seq_len: int = 0
    seq_len_step: int = 1

    def padded_len(self, tokens: int) -> int:
        """The token count a call with `tokens` tokens per row runs at: seq_len for a static bucket,
        else `tokens` rounded up to a multiple of seq_len_step and to at least min_seq_len."""
        if not self.min_seq_len:
            return self.seq_len
        return max(self.min_seq_len, -(-tokens // self.seq_len_step) * self.seq_len_step)

    @property
    def files(self) -> tuple[str, ...]:
        """The executable files this bucket runs (each once)."""
        return tuple(dict.fromkeys(st.file for st in self.stages)) if self.stages else (self.file,)

    def seq_len_range(self) -> tuple[int, int]:
        """(fewest, most) tokens per row a call may pass: (seq_len, seq_len) for a static bucket."""
        return (self.min_seq_len or self.seq_len, self.seq_len)

    @property
    def length(self) -> int:
        """The length in the file name: seq_len for prefill, capacity for decode and chunk."""
        return self.seq_len if self.kind == "prefill" else self.capacity

    def check_inputs(self, inputs: list[torch.Tensor]) -> None:
        """Raise ValueError unless `inputs` match `self.inputs` (count, shape, dtype, contiguous):
        an executable indexes its buffers by the shapes it was compiled for. For a bucket with
        min_seq_len, the token dimension (dim 1 of the data inputs but valid_len) may be anything
        in `seq_len_range()`, the same for all of them."""
        if len(inputs) != len(self.inputs):
            raise ValueError(f"{self.file}: expected {len(self.inputs)} inputs, got {len(inputs)}")
        tokens = self.seq_len
        if self.min_seq_len:
            lo, hi = self.seq_len_range()
            tokens = inputs[0].shape[1] if inputs[0].dim() == 2 else -1
            if not lo <= tokens <= hi or tokens % self.seq_len_step:
                raise ValueError(f"{self.file}: takes {lo}..{hi} tokens per row in steps of {self.seq_len_step}, "
                                 f"got {tokens}")
        for t, spec in zip(inputs, self.inputs):
            want = list(spec.shape)
            if self.min_seq_len and spec.name in ("tokens", "engram_ids"):
                want[1] = tokens
            if list(t.shape) != want or t.dtype != spec.torch_dtype or not t.is_contiguous():
                raise ValueError(f"{self.file}: input {spec.name} must be a contiguous {spec.torch_dtype} {want}, "
                                 f"got {t.dtype} {list(t.shape)}")

    def to_dict(self) -> dict[str, Any]:
        out = {"kind": self.kind, "batch": self.batch, "seq_len": self.seq_len, "capacity": self.capacity,
               "file": self.file, "weights": list(self.weights),
               "inputs": [s.to_dict() for s in self.inputs], "outputs": [s.to_dict() for s in self.outputs],
               "cache_key": self.cache_key}
        if self.stages or self.min_seq_len:
            out.update(stages=[st.to_dict() for st in self.stages], min_seq_len=self.min_seq_len,
                       seq_len_step=self.seq_len_step)
        return out

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> "Bucket":
        r = _obj(raw, where)
        kind = _get_choice(r, "kind", KINDS, where)
        ints = {k: _get(r, k, int, where) for k in ("batch", "seq_len", "capacity")}
        for k, v in ints.items():
            if v <= 0:
                raise BundleError(f"manifest {where}.{k}: must be > 0 (got {v})")
        weights = _get(r, "weights", list, where)
        if not all(isinstance(w, str) for w in weights):
            raise BundleError(f"manifest {where}.weights: expected a list of tensor names")
        stages = tuple(Stage.from_dict(x, f"{where}.stages[{i}]") for i, x in enumerate(r.get("stages", [])))
        min_seq_len = r.get("min_seq_len", 0)
        if not isinstance(min_seq_len, int) or isinstance(min_seq_len, bool) or not 0 <= min_seq_len <= ints["seq_len"]:
            raise BundleError(f"manifest {where}.min_seq_len: must be an integer in 0..seq_len={ints['seq_len']} "
                              f"(got {min_seq_len!r})")
        if min_seq_len and kind == "decode":
            raise BundleError(f"manifest {where}.min_seq_len: a decode bucket takes one token per call, not a range")
        step = r.get("seq_len_step", 1)
        if not isinstance(step, int) or isinstance(step, bool) or step < 1 or (min_seq_len and min_seq_len % step):
            raise BundleError(f"manifest {where}.seq_len_step: must be a positive integer dividing min_seq_len "
                              f"(got {step!r})")
        return cls(kind=kind, file=_get(r, "file", str, where), weights=tuple(weights),
                   inputs=tuple(TensorSpec.from_dict(x, f"{where}.inputs[{i}]")
                                for i, x in enumerate(_get(r, "inputs", list, where))),
                   outputs=tuple(TensorSpec.from_dict(x, f"{where}.outputs[{i}]")
                                 for i, x in enumerate(_get(r, "outputs", list, where))),
                   cache_key=_get(r, "cache_key", str, where), stages=stages, min_seq_len=min_seq_len,
                   seq_len_step=step, **ints)


@dataclass(frozen=True)
class Tokenizer:
    """Tokenizer files (bundle-relative) and the ids generation needs."""

    files: tuple[str, ...]
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    add_bos: bool

    def to_dict(self) -> dict[str, Any]:
        return {"files": list(self.files), "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
                "pad_token_id": self.pad_token_id, "add_bos": self.add_bos}

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> "Tokenizer":
        r = _obj(raw, where)
        files = _get(r, "files", list, where)
        if not all(isinstance(f, str) for f in files):
            raise BundleError(f"manifest {where}.files: expected a list of paths")
        return cls(tuple(files), _get(r, "bos_token_id", int, where), _get(r, "eos_token_id", int, where),
                   _get(r, "pad_token_id", int, where), _get(r, "add_bos", bool, where))


@dataclass(frozen=True)
class Manifest:
    """Everything a runtime needs to verify and run a bundle (see the module docstring).

    toolchain: versions on the compiling host: python, torch, machine (platform.machine()) and
        cpu_isa (sorted ISA extension flags the host offered; executables may use any of them).
    compiler: backend name, the effective backend flags, and `custom_ops` {op: "inline" | "call"}.
    host_preprocessing: model-specific host-side data, e.g. {"engram": NgramHasher params or None}.
    files: {bundle-relative path: {"sha256": hex, "size": bytes}} for every file except manifest.json.
    load_casts: {weight name: dtype name} for weights stored narrower than the executables take them
        (e.g. a bf16 checkpoint head held fp32 by the model); the runtime casts them after loading.
    weight_views: {weight name: dtype name} for weights the executables take as a same-width bitcast
        view (the cpu backend takes float8_e8m0fnu scales as uint8); applied after load_casts.
    prepare: `Prepare` recipes, applied after the views (schema version 2): stored tensors ->
        the kernel-layout tensors the executables take.
    weight_files: when not empty (schema version 3), the weights are in these safetensors files,
        each tensor in one of them and each file at most WEIGHT_SHARD_BYTES of tensors, instead of
        all in weights_file: weights-<i>-of-<n>.safetensors, as a Hugging Face checkpoint is sharded.
    numerics: the cpu kernels' numerics the executables were compiled with (MANIFEST_NUMERICS):
        "exact" (the default, and what a manifest without the field means: bit-identical to the
        golden on every host) or "fast" (schema version 5: bf16 dot products, deterministic on one
        host; `dsneuron compare` re-runs the golden's stages with it). Written only when not exact.
    """

    target: str
    toolchain: dict[str, Any]
    compiler: dict[str, Any]
    model_config: dict[str, Any]
    compile_config: dict[str, Any]
    tokenizer: Tokenizer
    host_preprocessing: dict[str, Any]
    state: tuple[StateEntry, ...]
    buckets: tuple[Bucket, ...]
    files: dict[str, dict[str, Any]]
    weights_file: str = WEIGHTS
    schema_version: int = SCHEMA_VERSION
    format: str = FORMAT
    created_by: str = ""
    load_casts: dict[str, str] = field(default_factory=dict)
    weight_views: dict[str, str] = field(default_factory=dict)
    prepare: tuple[Prepare, ...] = ()
    weight_files: tuple[str, ...] = ()
    numerics: str = "exact"

    @property
    def weights_files(self) -> tuple[str, ...]:
        """Every file that holds weights: weight_files, else (weights_file,)."""
        return self.weight_files or (self.weights_file,)

    def to_json(self) -> str:
        """The manifest.json text, sealed with `manifest_sha256` (module docstring)."""
        body = {
            "format": self.format, "schema_version": self.schema_version, "created_by": self.created_by,
            "target": self.target, "toolchain": self.toolchain, "compiler": self.compiler,
            "model_config": self.model_config, "compile_config": self.compile_config,
            "tokenizer": self.tokenizer.to_dict(), "host_preprocessing": self.host_preprocessing,
            "weights_file": self.weights_file,
            "state": [s.to_dict() for s in self.state], "buckets": [b.to_dict() for b in self.buckets],
            "files": self.files, "load_casts": self.load_casts, "weight_views": self.weight_views,
        }
        if self.prepare:
            body["prepare"] = [p.to_dict() for p in self.prepare]
        if self.weight_files:
            body["weight_files"] = list(self.weight_files)
        if self.numerics != "exact":
            body["numerics"] = self.numerics
        body[SEAL] = content_sha256(body)
        return json.dumps(body, indent=1, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        """Parse and validate: the format and schema version first, then every field and the
        consistency of the bucket set (`_check_buckets`), then the seal (module docstring).

        Raises BundleError naming the first malformed field, or the manifest as edited.
        """
        try:
            raw = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
        except RecursionError:
            raise BundleError(f"{MANIFEST}: not valid JSON (nested too deeply)") from None
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            raise BundleError(f"{MANIFEST}: not valid JSON ({e})") from None
        r = _obj(raw, "")
        if r.get("format") != FORMAT:
            raise BundleError(f"{MANIFEST}: format is {r.get('format')!r}, expected {FORMAT!r} (not a dsneuron bundle)")
        version = r.get("schema_version")
        if version not in SUPPORTED_SCHEMA_VERSIONS or isinstance(version, bool):
            raise BundleError(f"{MANIFEST}: schema version {version!r} is not supported by this runtime "
                              f"(supported: {', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))}); recompile the bundle "
                              "with this dsneuron version")
        files = _get(r, "files", dict, "")
        for path, meta in files.items():
            m = _obj(meta, f"files[{path!r}]")
            _get(m, "sha256", str, f"files[{path!r}]")
            _get(m, "size", int, f"files[{path!r}]")
        compiler = _get(r, "compiler", dict, "")
        custom_ops = _get(compiler, "custom_ops", dict, "compiler")
        for op, mode in custom_ops.items():
            if mode not in LOWERING_MODES:
                raise BundleError(f"manifest compiler.custom_ops[{op!r}]: {mode!r} is not one of {', '.join(LOWERING_MODES)}")
        manifest = cls(
            target=_get(r, "target", str, ""),
            toolchain=_get(r, "toolchain", dict, ""),
            compiler=compiler,
            model_config=_get(r, "model_config", dict, ""),
            compile_config=_get(r, "compile_config", dict, ""),
            tokenizer=Tokenizer.from_dict(r.get("tokenizer"), "tokenizer"),
            host_preprocessing=_get(r, "host_preprocessing", dict, ""),
            state=tuple(StateEntry.from_dict(x, f"state[{i}]") for i, x in enumerate(_get(r, "state", list, ""))),
            buckets=tuple(Bucket.from_dict(x, f"buckets[{i}]") for i, x in enumerate(_get(r, "buckets", list, ""))),
            files=files,
            weights_file=_get(r, "weights_file", str, ""),
            schema_version=version,
            created_by=_get(r, "created_by", str, ""),
            load_casts=_dtype_map(_get(r, "load_casts", dict, ""), "load_casts"),
            weight_views=_dtype_map(_get(r, "weight_views", dict, ""), "weight_views"),
            prepare=tuple(_prepare_from_dict(x, f"prepare[{i}]") for i, x in enumerate(r.get("prepare", []))),
            weight_files=_weight_files(r.get("weight_files", [])),
            numerics=r.get("numerics", "exact"),
        )
        if manifest.numerics not in MANIFEST_NUMERICS:
            raise BundleError(f"manifest numerics: {manifest.numerics!r} is not one of {', '.join(MANIFEST_NUMERICS)}")
        if manifest.numerics != "exact" and version < NUMERICS_SCHEMA_VERSION:
            raise BundleError(f"{MANIFEST}: numerics {manifest.numerics!r} needs schema version {NUMERICS_SCHEMA_VERSION} "
                              f"(the manifest says {version})")
        if manifest.prepare and version < 2:
            raise BundleError(f"{MANIFEST}: prepare needs schema version 2 (the manifest says {version})")
        if manifest.weight_files and version < WEIGHT_FILES_SCHEMA_VERSION:
            raise BundleError(f"{MANIFEST}: weight_files needs schema version {WEIGHT_FILES_SCHEMA_VERSION} (the "
                              f"manifest says {version})")
        _check_buckets(manifest)
        _check_seal(r)
        return manifest


def _weight_files(raw: Any) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(f, str) and f.endswith(".safetensors") for f in raw):
        raise BundleError("manifest weight_files: expected a list of .safetensors file names")
    if len(set(raw)) != len(raw):
        raise BundleError("manifest weight_files: names a file twice")
    return tuple(raw)


def weight_shard_names(n: int) -> list[str]:
    """The file names of a bundle's weights in n > 1 shards (Manifest.weight_files)."""
    return [f"weights-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def content_sha256(raw: dict[str, Any]) -> str:
    """Hex sha256 of a manifest's JSON object without its seal field: compact separators, sorted
    keys, ASCII escapes, so that indentation and key order do not matter. Raises BundleError for
    content that is not strict JSON (NaN, infinity, non-string keys)."""
    body = {k: v for k, v in raw.items() if k != SEAL}
    try:
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise BundleError(f"{MANIFEST}: content is not strict JSON ({e})") from None
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _check_seal(r: dict[str, Any]) -> None:
    seal = r.get(SEAL)
    if seal is None:
        raise BundleError(f"{MANIFEST}: has no {SEAL} seal (written by a dsneuron that did not seal manifests); "
                          "recompile the bundle")
    if seal != content_sha256(r):
        raise BundleError(f"{MANIFEST}: was edited after `dsneuron compile` wrote it (its content does not match "
                          f"its {SEAL}); bucket shapes, capacities and the other entries describe the compiled "
                          "executables and cannot be changed by hand: recompile the bundle")


def _check_buckets(m: "Manifest") -> None:
    """The bucket set a session can run: at least one prefill and one decode bucket, a decode bucket
    for every prefill batch size, no two buckets of one (kind, batch, length), decode seq_len 1, a
    prefill state capacity that holds its seq_len, the data inputs of the module docstring first
    (int64, shapes from batch and seq_len, one engram (E, C) for all) and then only state tensors,
    logits [batch, V] first among the outputs, unique state names and token ids in 0..V-1.
    Raises BundleError naming the first violation."""
    if not m.buckets:
        raise BundleError(f"{MANIFEST}: buckets is empty (a bundle needs at least one prefill and one decode bucket)")
    for kind in ("prefill", "decode"):  # chunk buckets are optional
        if not any(b.kind == kind for b in m.buckets):
            raise BundleError(f"{MANIFEST}: buckets has no {kind} bucket (a bundle needs at least one of each kind)")
    seen: dict[tuple[str, int, int], int] = {}
    vocab: set[int] = set()
    engram: set[tuple[int, ...]] = set()
    for i, b in enumerate(m.buckets):
        where = f"{MANIFEST}: buckets[{i}]"
        key = (b.kind, b.batch, b.length)
        if key in seen:
            raise BundleError(f"{where} ({b.kind} b{b.batch} s{b.length}) duplicates buckets[{seen[key]}]")
        seen[key] = i
        if b.kind == "decode" and b.seq_len != 1:
            raise BundleError(f"{where}.seq_len: a decode bucket takes one token per call (got {b.seq_len})")
        if b.kind != "decode" and b.capacity < b.seq_len:
            raise BundleError(f"{where}.capacity: {b.capacity} cannot hold the {b.kind}'s {b.seq_len} positions")
        for kinds, version in ((("chunk",), CHUNK_SCHEMA_VERSION), (("verify", "draft"), SPECULATIVE_SCHEMA_VERSION)):
            if b.kind in kinds and m.schema_version < version:
                raise BundleError(f"{where}: a {b.kind} bucket needs schema version {version} (the manifest says "
                                  f"{m.schema_version})")
        if b.kind == "draft":
            vocab.add(_check_draft(b, where))
            continue
        if b.kind == "verify":
            _check_verify_outputs(b, where)
        elif not b.outputs or len(b.outputs[0].shape) != 2 or b.outputs[0].shape[0] != b.batch or not b.outputs[0].shape[1]:
            raise BundleError(f"{where}.outputs: the first output must be the logits [batch={b.batch}, V > 0]")
        elif b.kind == "prefill" and _seeds(b):
            _check_prefill_seed(b, where, m.schema_version)
        vocab.add(b.outputs[0].shape[-1])
        engram.add(_check_inputs(b, where, {s.name for s in m.state}))
        if b.stages or b.min_seq_len:
            if m.schema_version < 2:
                raise BundleError(f"{where}: stages and min_seq_len need schema version 2 (the manifest says "
                                  f"{m.schema_version})")
            _check_stages(b, where)
            if written_in_place(b) and m.schema_version < IN_PLACE_SCHEMA_VERSION:
                raise BundleError(f"{where}: stages that write state in place need schema version "
                                  f"{IN_PLACE_SCHEMA_VERSION} (the manifest says {m.schema_version})")
    decode_batches = {b.batch for b in m.buckets if b.kind == "decode"}
    for b in m.buckets:
        if b.kind != "decode" and b.batch not in decode_batches:
            raise BundleError(f"{MANIFEST}: buckets has a {b.kind} bucket of batch {b.batch} but no decode bucket "
                              "of that batch to continue it")
    if len(vocab) != 1:
        raise BundleError(f"{MANIFEST}: buckets disagree on the logits width V ({sorted(vocab)})")
    if len(engram) != 1:
        raise BundleError(f"{MANIFEST}: buckets disagree on the engram_ids columns (E, C): {sorted(engram)}")
    names = [s.name for s in m.state]
    if len(set(names)) != len(names):
        raise BundleError(f"{MANIFEST}: state names a tensor twice")
    V = vocab.pop()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(m.tokenizer, key)
        if not 0 <= value < V:
            raise BundleError(f"{MANIFEST}: tokenizer.{key} {value} is not a token id in 0..{V - 1}")


def _check_draft(b: Bucket, where: str) -> int:
    """A draft bucket's inputs and outputs (module docstring: DATA_INPUTS["draft"], then one ring
    per drafter stage; DRAFT_OUTPUTS, then the same rings), by name, dtype and the shapes its
    batch B and block K (seq_len) fix; returns its vocabulary V. Raises BundleError naming the
    first mismatch."""
    B, K = b.batch, b.seq_len
    names = DATA_INPUTS["draft"]
    data, rings = b.inputs[:len(names)], b.inputs[len(names):]
    if [s.name for s in data] != list(names) or not rings:
        raise BundleError(f"{where}.inputs: a draft bucket takes {', '.join(names)}, then one ring per drafter stage "
                          f"(got {', '.join(s.name for s in b.inputs) or 'none'})")
    outs = b.outputs[:len(DRAFT_OUTPUTS)]
    if [s.name for s in outs] != list(DRAFT_OUTPUTS) or [s.name for s in b.outputs[len(DRAFT_OUTPUTS):]] != \
            [s.name for s in rings]:
        raise BundleError(f"{where}.outputs: a draft bucket returns {', '.join(DRAFT_OUTPUTS)}, then its rings "
                          f"(got {', '.join(s.name for s in b.outputs) or 'none'})")
    V = outs[1].shape[-1] if len(outs[1].shape) == 3 else 0
    want = {"token": ("int64", (B,)), "pos": ("int64", (B,)), "seed_pos": ("int64", (B,)),
            "seed_count": ("int64", (B,)), "gumbel": ("float32", (B, K, V)), "temperature": ("float32", (B,)),
            "draft_tokens": ("int64", (B, K)), "draft_logits": ("float32", (B, K, V)), "confidence": ("float32", (B, K))}
    for spec in (*data, *outs):
        dtype, shape = want.get(spec.name, ("bfloat16", None))
        if spec.dtype != dtype or (shape is not None and spec.shape != shape) or not V \
                or (shape is None and (len(spec.shape) != 3 or spec.shape[0] != B)):
            raise BundleError(f"{where}: {spec.name} must be {dtype} {list(shape) if shape else f'[{B}, S, T*D]'} with "
                              f"V > 0 (got {spec.dtype} {list(spec.shape)})")
    for spec, out in zip(rings, b.outputs[len(DRAFT_OUTPUTS):]):
        if spec.dtype != "bfloat16" or len(spec.shape) != 3 or spec.shape[0] != B or out.shape != spec.shape \
                or out.dtype != spec.dtype:
            raise BundleError(f"{where}: ring {spec.name} must be bfloat16 [{B}, W, head_dim] in and out (got "
                              f"{spec.dtype} {list(spec.shape)} -> {out.dtype} {list(out.shape)})")
    return V


def _check_verify_outputs(b: Bucket, where: str) -> None:
    """A verify bucket's first outputs: logits float32 [B, S, V > 0], then MAIN_HIDDEN bfloat16 [B, S, > 0];
    a staged one's (the cpu target's) logits alone: the runtime reads main_hidden by tapping its
    target layers' attention stages."""
    B, S = b.batch, b.seq_len
    logits, hidden = (b.outputs + (None, None))[:2]
    if logits is None or logits.name != "logits" or logits.dtype != "float32" or len(logits.shape) != 3 \
            or logits.shape[:2] != (B, S) or not logits.shape[2]:
        raise BundleError(f"{where}.outputs: a verify bucket's first output must be the logits float32 [batch={B}, "
                          f"seq_len={S}, V > 0]")
    if b.stages:
        return
    if hidden is None or hidden.name != MAIN_HIDDEN or hidden.dtype != "bfloat16" or len(hidden.shape) != 3 \
            or hidden.shape[:2] != (B, S) or not hidden.shape[2]:
        raise BundleError(f"{where}.outputs: a verify bucket's second output must be {MAIN_HIDDEN} bfloat16 "
                          f"[batch={B}, seq_len={S}, T*D > 0]")


def _seeds(b: Bucket) -> bool:
    """Whether prefill bucket `b` also returns MAIN_HIDDEN (a speculative compile's single-graph
    prefill: each prompt's last positions, what seeds the drafter's rings)."""
    return len(b.outputs) > 1 and b.outputs[1].name == MAIN_HIDDEN


def _check_prefill_seed(b: Bucket, where: str, version: int) -> None:
    """A seeding prefill's second output: MAIN_HIDDEN bfloat16 [B, 1..S, > 0], schema version 7."""
    hidden = b.outputs[1]
    if version < SPECULATIVE_SCHEMA_VERSION:
        raise BundleError(f"{where}: a prefill returning {MAIN_HIDDEN} needs schema version "
                          f"{SPECULATIVE_SCHEMA_VERSION} (the manifest says {version})")
    if hidden.dtype != "bfloat16" or len(hidden.shape) != 3 or hidden.shape[0] != b.batch \
            or not 1 <= hidden.shape[1] <= b.seq_len or not hidden.shape[2]:
        raise BundleError(f"{where}.outputs: a prefill's {MAIN_HIDDEN} must be bfloat16 [batch={b.batch}, "
                          f"1..seq_len={b.seq_len}, T*D > 0] (got {hidden.dtype} {list(hidden.shape)})")


def _check_inputs(b: Bucket, where: str, state: set[str]) -> tuple[int, ...]:
    """Check one bucket's inputs (see `_check_buckets`); returns its engram (E, C)."""
    names = DATA_INPUTS[b.kind]
    got = [s.name for s in b.inputs[:len(names)]]
    if got != list(names):
        raise BundleError(f"{where}.inputs: a {b.kind} bucket takes {', '.join(names)} first (got {', '.join(got) or 'none'})")
    tokens, *lengths, engram = b.inputs[:len(names)]
    want = {tokens.name: (b.batch, b.seq_len), **{x.name: (b.batch,) for x in lengths}}
    for spec in (tokens, *lengths, engram):
        shape_ok = spec.shape == want[spec.name] if spec.name in want else \
            (len(spec.shape) == 4 and spec.shape[:2] == (b.batch, b.seq_len))
        if spec.dtype != "int64" or not shape_ok:
            shape = list(want[spec.name]) if spec.name in want else f"[{b.batch}, {b.seq_len}, E, C]"
            raise BundleError(f"{where}.inputs: {spec.name} must be int64 {shape} (got {spec.dtype} {list(spec.shape)})")
    for spec in b.inputs[len(names):]:
        if spec.name not in state:
            raise BundleError(f"{where}.inputs: {spec.name} is neither a data input nor a state tensor of the manifest")
    for spec in b.outputs[2 if b.kind == "verify" and not b.stages or b.kind == "prefill" and _seeds(b) else 1:]:
        if spec.name not in state and not spec.name.startswith(PROBE_PREFIX):
            raise BundleError(f"{where}.outputs: {spec.name} is neither a state tensor nor a probe")
    return engram.shape[2:]


def written_in_place(b: Bucket) -> list[str]:
    """The state tensors staged bucket `b`'s stages write in place: outputs of the bucket that are
    also its inputs and no stage's output (a decode step's one-row caches, graphs/stages.py
    AttnStage). A runtime must hand the stages copies of these inputs."""
    if not b.stages:
        return []
    produced = {n for st in b.stages for n in st.outputs}
    inputs = {s.name for s in b.inputs}
    return [s.name for s in b.outputs if s.name in inputs and s.name not in produced]


def _check_stages(b: Bucket, where: str) -> None:
    """A staged bucket's wiring: every stage input is a bucket input, a derived input
    (DERIVED_INPUTS) or an output of an earlier stage; every bucket output is produced by some
    stage; a stage file lies in the bucket's folder. Raises BundleError naming the first gap."""
    if not b.stages:
        return
    known = {s.name for s in b.inputs} | {"last"}
    for i, st in enumerate(b.stages):
        if not st.file.startswith(f"{b.file}/"):
            raise BundleError(f"{where}.stages[{i}].file: {st.file} is not in the bucket's folder {b.file}")
        for name in st.inputs:
            if name not in known and not (name.startswith("engram_ids.") and "engram_ids" in known):
                raise BundleError(f"{where}.stages[{i}] ({st.name}): input {name} is neither a bucket input nor "
                                  "an output of an earlier stage")
        known.update(st.outputs)
    for spec in b.outputs:
        if spec.name not in known:
            raise BundleError(f"{where}.outputs: {spec.name} is produced by no stage")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of the float range")
    return value


def _dtype_map(raw: dict[str, Any], where: str) -> dict[str, str]:
    for name, dtype in raw.items():
        parse_dtype(dtype, f"{where}[{name!r}]")
    return raw


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-standard JSON constant {name}")


def _obj(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise BundleError(f"manifest {where or 'top level'}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _get_choice(r: dict[str, Any], key: str, choices: tuple[str, ...], where: str) -> str:
    """_get of a str field that must be one of `choices`."""
    value = _get(r, key, str, where)
    if value not in choices:
        raise BundleError(f"manifest {where}.{key}: {value!r} is not one of {', '.join(choices)}")
    return value


def _names(r: dict[str, Any], key: str, where: str, what: str) -> tuple[str, ...]:
    """r[key] as a tuple of strings; BundleError "manifest WHERE.KEY: expected a list of WHAT"."""
    value = _get(r, key, list, where)
    if not all(isinstance(v, str) for v in value):
        raise BundleError(f"manifest {where}.{key}: expected a list of {what}")
    return tuple(value)


def _get(r: dict[str, Any], key: str, typ: type, where: str) -> Any:
    full = f"{where}.{key}" if where else key
    if key not in r:
        raise BundleError(f"manifest {full}: missing field")
    value = r[key]
    ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
    if typ is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok:
        raise BundleError(f"manifest {full}: expected {typ.__name__}, got {type(value).__name__}")
    return value


# ------------------------------------------------------------------------------ sharded bundles
#: a sharded bundle (`dsneuron compile --tp N`) is a folder of `world` rank bundles, each an
#: ordinary bundle of this module in RANK_DIR, plus this file naming them
PARALLEL = "parallel.json"
PARALLEL_FORMAT = "dsneuron-sharded-bundle"
PARALLEL_SCHEMA_VERSION = 1


def shard_record(tp: int, ep: int, rank: int) -> dict[str, int]:
    """A rank bundle's manifest compiler.shard: its plan and rank (ShardedManifest)."""
    return {"tp": tp, "ep": ep, "rank": rank}


def rank_dir(rank: int, world: int) -> str:
    """The folder of rank `rank`'s bundle inside a sharded bundle of `world` ranks."""
    return f"rank-{rank}-of-{world}"


@dataclass(frozen=True)
class ShardedManifest:
    """parallel.json of a sharded bundle: the parallel plan (compiler/placement.py Parallel: tp ranks =
    the world size, ep expert-parallel groups) and, per rank in rank order, the sha256 of its
    bundle's manifest.json file, so that a rank folder swapped for another compile's is refused
    before any rank starts. Each rank bundle's manifest records the same plan and its rank in
    compiler.shard {"tp", "ep", "rank"}, so a rank folder opened on its own is refused too
    (runtime_min/bundle/bundle.py open_bundle)."""

    tp: int
    ep: int
    manifest_sha256: tuple[str, ...]
    created_by: str = ""
    schema_version: int = PARALLEL_SCHEMA_VERSION
    format: str = PARALLEL_FORMAT

    @property
    def world(self) -> int:
        return self.tp

    def to_json(self) -> str:
        ranks = [{"dir": rank_dir(r, self.world), "manifest_sha256": h} for r, h in enumerate(self.manifest_sha256)]
        return json.dumps({"format": self.format, "schema_version": self.schema_version, "created_by": self.created_by,
                           "tp": self.tp, "ep": self.ep, "world": self.world, "ranks": ranks}, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "ShardedManifest":
        """Parse and validate parallel.json; raises BundleError naming the first bad field."""
        try:
            raw = json.loads(text, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:
            raise BundleError(f"{PARALLEL}: not valid JSON ({e})") from None
        if not isinstance(raw, dict) or raw.get("format") != PARALLEL_FORMAT:
            raise BundleError(f"{PARALLEL}: not a dsneuron sharded bundle (format must be {PARALLEL_FORMAT!r})")
        version = raw.get("schema_version")
        if version != PARALLEL_SCHEMA_VERSION:
            raise BundleError(f"{PARALLEL}: schema_version {version!r} is not one this runtime reads "
                              f"({PARALLEL_SCHEMA_VERSION}); use the dsneuron that wrote it")
        tp, ep, world = (_get(raw, k, int, PARALLEL) for k in ("tp", "ep", "world"))
        if tp < 2 or world != tp or ep < 1 or tp % ep:
            raise BundleError(f"{PARALLEL}: tp={tp}, ep={ep}, world={world} is no plan a sharded bundle holds "
                              "(tp >= 2 = world, ep dividing tp)")
        ranks = _get(raw, "ranks", list, PARALLEL)
        if len(ranks) != world:
            raise BundleError(f"{PARALLEL}: ranks lists {len(ranks)} rank bundles for a world of {world}")
        hashes = []
        for r, entry in enumerate(ranks):
            where = f"{PARALLEL} ranks[{r}]"
            entry = _obj(entry, where)
            if _get(entry, "dir", str, where) != rank_dir(r, world):
                raise BundleError(f"{where}.dir: must be {rank_dir(r, world)!r}, got {entry['dir']!r}")
            h = _get(entry, "manifest_sha256", str, where)
            if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
                raise BundleError(f"{where}.manifest_sha256: not a hex sha256")
            hashes.append(h)
        return cls(tp, ep, tuple(hashes), created_by=str(raw.get("created_by", "")))
