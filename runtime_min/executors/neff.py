"""NEFF files: the 1024-byte header, its checks before a NEFF is loaded, and what a bundle records per NEFF.

A NEFF (Neuron Executable File Format) is a 1024-byte header followed by a tarball
(aws-neuron/aws-neuron-sdk:neuron-runtime/explore/work-with-neff-files.rst, "NEFF Header"). The
header is a packed little-endian C struct, byte offsets on the left:

       0 u64 pkg_version          8 u64 header_size        16 u64 data_size
      24 u64 neff_version_major  32 u64 neff_version_minor 40 u8  neff_build_version[128]
     168 u32 num_tpb            172 u8  hash[32]           204 u8  uuid[16]
     220 char name[256]         476 u32 requested_tpb_count 480 u8 tpb_per_node[64]
     544 u64 feature_bits       552 u32 lnc_size           556 u8  pad[468]         (= 1024)

No magic number is documented, so a file is checked by what the header says about itself and about
the host (`check_header`), in this order, naming the first failing field and its limit:
- the file holds at least the 1024 header bytes (a shorter file is truncated);
- header_size == 1024;
- data_size == file size - header_size (a truncated or padded tarball fails here);
- feature_bits holds no bit outside the allowed mask. The runtime rejects NEFF features it does not
  know ("NEFF version: 2.0, features: 0x100 are not supported", aws-neuron-sdk issue 820), and no
  public table of the bits exists; the allowed mask is therefore what the compiling SDK produced for
  this bucket (`NeffRecord.feature_bits`), and runtime_min/executors/executor_neuron.py requires the same SDK
  release at run time;
- lnc_size == the host's logical NeuronCore size (`host_lnc`): "AWS Neuron currently doesn't
  support setting the compiler flag to a different LNC configuration than the Neuron Runtime
  environment variable" (aws-neuron-sdk:about-neuron/arch/neuron-features/logical-neuroncore-config.rst).

Pure Python, no SDK: the checks run (and are tested) on any host.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..bundle.schema import BundleError

HEADER_SIZE = 1024
_LAYOUT = struct.Struct("<5Q128sI32s16s256sI64sQI468s")
LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
# Where Linux names the EC2 instance type (nkipy reads it the same way to pick the compile target).
PRODUCT_NAME = Path("/sys/devices/virtual/dmi/id/product_name")


class NeffError(BundleError):
    """A NEFF that must not be loaded on this host; the message names the file, the header field and
    the limit it breaks."""


@dataclass(frozen=True)
class NeffHeader:
    """The fields of the 1024-byte NEFF header (module docstring); byte strings are NUL-trimmed."""

    pkg_version: int
    header_size: int
    data_size: int
    neff_version_major: int
    neff_version_minor: int
    build_version: str
    num_tpb: int
    hash: bytes
    uuid: bytes
    name: str
    requested_tpb_count: int
    tpb_per_node: bytes
    feature_bits: int
    lnc_size: int

    @property
    def neff_version(self) -> str:
        return f"{self.neff_version_major}.{self.neff_version_minor}"


def parse_header(data: bytes, where: str) -> NeffHeader:
    """Decode the first 1024 bytes of `data`; raises NeffError naming `where` when fewer are given."""
    if len(data) < HEADER_SIZE:
        raise NeffError(f"{where}: {len(data)} bytes, shorter than the {HEADER_SIZE}-byte NEFF header (truncated file)")
    (pkg, hsize, dsize, major, minor, build, num_tpb, digest, uuid, name, requested, per_node, features, lnc,
     _pad) = _LAYOUT.unpack_from(data)
    return NeffHeader(pkg, hsize, dsize, major, minor, _text(build), num_tpb, digest, uuid, _text(name), requested,
                      per_node.rstrip(b"\0"), features, lnc)


def read_header(path: Path) -> NeffHeader:
    """The header of the NEFF at `path` (reads 1024 bytes)."""
    with open(path, "rb") as f:
        return parse_header(f.read(HEADER_SIZE), Path(path).name)


def check_header(header: NeffHeader, file_size: int, where: str, *, allowed_feature_bits: int, lnc: int,
                 lnc_source: str = "") -> None:
    """Raise NeffError for the first check of the module docstring that `header` fails.

    file_size: bytes of the whole file; allowed_feature_bits: mask of the features this host accepts;
    lnc: the logical NeuronCore size the NEFF must have, `lnc_source` saying where it comes from.
    """
    if file_size < HEADER_SIZE:
        raise NeffError(f"{where}: {file_size} bytes, shorter than the {HEADER_SIZE}-byte NEFF header (truncated file)")
    if header.header_size != HEADER_SIZE:
        raise NeffError(f"{where}: header_size is {header.header_size}, a NEFF header is {HEADER_SIZE} bytes")
    if header.data_size != file_size - HEADER_SIZE:
        raise NeffError(f"{where}: data_size is {header.data_size} bytes but the file holds {file_size - HEADER_SIZE} "
                        f"after the header (truncated or padded NEFF)")
    unknown = header.feature_bits & ~allowed_feature_bits
    if unknown:
        raise NeffError(f"{where}: feature_bits {header.feature_bits:#x} include {unknown:#x}, outside the features "
                        f"this host accepts ({allowed_feature_bits:#x}); the NEFF and the Neuron runtime must come "
                        "from the same SDK release: recompile the bundle with this host's SDK")
    if header.lnc_size != lnc:
        raise NeffError(f"{where}: lnc_size is {header.lnc_size}, this host runs logical NeuronCores of size {lnc}"
                        f"{f' ({lnc_source})' if lnc_source else ''}; set {LNC_ENV}={header.lnc_size} or recompile "
                        f"with --lnc {lnc}")


def host_lnc(environ: Mapping[str, str] | None = None, product_name: str | None = None) -> tuple[int, str]:
    """(logical NeuronCore size of this host, where that value comes from).

    NEURON_LOGICAL_NC_CONFIG when set (1 or 2, else NeffError); otherwise the instance default: 2 on
    trn2, 1 elsewhere (logical-neuroncore-config.rst: LNC=2 is the Trn2 default; trn1 supports only 1,
    compiler error NCC_EARG001). `environ` / `product_name` default to this process and
    /sys/devices/virtual/dmi/id/product_name.
    """
    env = os.environ if environ is None else environ
    raw = env.get(LNC_ENV)
    if raw is not None:
        if raw.strip() not in ("1", "2"):
            raise NeffError(f"{LNC_ENV}={raw!r}: the logical NeuronCore size must be 1 or 2")
        return int(raw), f"{LNC_ENV}={raw.strip()}"
    if product_name is None:
        try:
            product_name = PRODUCT_NAME.read_text().strip()
        except OSError:
            product_name = ""
    size = 2 if product_name.startswith("trn2") else 1
    return size, f"default of instance type {product_name or 'unknown'}"


@dataclass(frozen=True)
class NeffRecord:
    """What a bundle records about one bucket's NEFF, in `Manifest.compiler["neff"][bucket file]`.

    flags: the neuronx-cc arguments it was compiled with (canonical order, compiler/backend_neuron.py);
    lnc_size, feature_bits, neff_version: copied from its header when it was compiled.
    """

    flags: tuple[str, ...]
    lnc_size: int
    feature_bits: int
    neff_version: str

    @classmethod
    def of(cls, header: NeffHeader, flags: tuple[str, ...]) -> "NeffRecord":
        return cls(tuple(flags), header.lnc_size, header.feature_bits, header.neff_version)

    def to_dict(self) -> dict[str, Any]:
        return {"flags": list(self.flags), "lnc_size": self.lnc_size, "feature_bits": self.feature_bits,
                "neff_version": self.neff_version}

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> "NeffRecord":
        """Raises BundleError naming the first malformed field of `where`."""
        if not isinstance(raw, dict):
            raise BundleError(f"manifest {where}: expected a JSON object")
        flags = raw.get("flags")
        if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
            raise BundleError(f"manifest {where}.flags: expected a list of strings")
        for key in ("lnc_size", "feature_bits"):
            value = raw.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise BundleError(f"manifest {where}.{key}: expected a non-negative integer, got {value!r}")
        if not isinstance(raw.get("neff_version"), str):
            raise BundleError(f"manifest {where}.neff_version: expected a string")
        return cls(tuple(flags), raw["lnc_size"], raw["feature_bits"], raw["neff_version"])


def verify_neff(path: Path, record: NeffRecord, lnc: int, lnc_source: str = "") -> NeffHeader:
    """Read and check the header of the NEFF at `path` against its bundle record and the host's LNC;
    returns the header. Raises NeffError (module docstring) before anything loads the file."""
    path = Path(path)
    header = read_header(path)
    check_header(header, path.stat().st_size, path.name, allowed_feature_bits=record.feature_bits, lnc=lnc,
                 lnc_source=lnc_source)
    if header.lnc_size != record.lnc_size:
        raise NeffError(f"{path.name}: lnc_size is {header.lnc_size} but the manifest records {record.lnc_size}")
    return header


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", errors="replace")
