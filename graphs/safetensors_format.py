"""The safetensors file format at header level: read a header without reading tensor data, and lay
out one byte for byte as the safetensors library writes it.

Source: the format spec of huggingface/safetensors (README.md, "Format"), and its writer
(safetensors/src/tensor.rs `prepare`, `Metadata::validate`, safetensors 0.8.0):

    8 bytes      N, little-endian u64: the header's length in bytes
    N bytes      UTF-8 JSON object {name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
                 optional "__metadata__": {str: str}}; the writer pads it with spaces to a multiple
                 of 8 bytes
    the rest     the data: tensor `name` is bytes [8 + N + begin, 8 + N + end) of the file, row-major,
                 little-endian; the tensors tile the data exactly (first begin 0, each begin the end
                 of the one before, last end the data's length)

The writer orders the tensors by dtype, widest first in the library's `Dtype` order
(`WRITE_ORDER`), then by name, and serialises the JSON compactly (serde_json) in that order, without
`__metadata__` when none is given. `layout` reproduces that, so a file streamed tensor by tensor
(compiler/bundle_writer.py) has the bytes `safetensors.torch.save_file` would write
(tests/test_lazy_weights.py compares them).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

#: safetensors dtype name -> (torch dtype, bytes per element), for the dtypes dsneuron stores
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BOOL": (torch.bool, 1), "U8": (torch.uint8, 1), "I8": (torch.int8, 1), "F8_E5M2": (torch.float8_e5m2, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E8M0": (torch.float8_e8m0fnu, 1), "I16": (torch.int16, 2),
    "U16": (torch.uint16, 2), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2), "I32": (torch.int32, 4),
    "U32": (torch.uint32, 4), "F32": (torch.float32, 4), "F64": (torch.float64, 8), "I64": (torch.int64, 8),
    "U64": (torch.uint64, 8),
}
NAMES: dict[torch.dtype, str] = {d: n for n, (d, _) in DTYPES.items()}
#: the library's `Dtype` enum order (its writer sorts by it, descending), measured on safetensors
#: 0.8.0 by saving one tensor of each dtype; F4/F6 (sub-byte) and complex dtypes are left out
WRITE_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16", "I32", "U32",
               "F32", "F64", "I64", "U64")
#: the largest header the library reads (tensor.rs MAX_HEADER_SIZE)
MAX_HEADER_BYTES = 100_000_000


class HeaderError(ValueError):
    """A safetensors header that is unreadable or inconsistent with its file; the message names the
    tensor when one is at fault (callers add the file's name)."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a header: dtype (safetensors name), shape, and its bytes [begin, end) counted
    from the start of the data (file offset `data_start + begin`)."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A parsed header: tensors in file order, where the data starts (8 + N), the file's size."""

    entries: dict[str, Entry]
    data_start: int
    file_size: int


def read_header(path: Path) -> Header:
    """Parse and check the header of the safetensors file `path`, reading only its first 8 + N bytes.

    Checks: N fits the file and MAX_HEADER_BYTES; the header is a UTF-8 JSON object; every tensor
    has a known dtype (DTYPES), a shape of non-negative ints and data_offsets [begin, end] with
    end - begin = prod(shape) * itemsize; the tensors tile the data exactly. A tensor whose end lies
    past the end of the file (a truncated file, or a header pointing past it) is named.
    Raises HeaderError (the message names the tensor at fault), OSError when the file cannot be read.
    """
    size = os.stat(path).st_size
    with open(path, "rb", buffering=0) as f:  # unbuffered: no read-ahead into the data
        head = f.read(8)
        if len(head) < 8:
            raise HeaderError(f"{size} bytes: shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise HeaderError(f"header length {n} is over the format's limit of {MAX_HEADER_BYTES} bytes")
        if 8 + n > size:
            raise HeaderError(f"header length {n} runs past the end of the file ({size} bytes): truncated")
        raw = f.read(n)
    if len(raw) < n:
        raise HeaderError(f"header length {n}: the file ended after {len(raw)} of its bytes")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeaderError(f"header is not UTF-8 JSON ({e})") from None
    if not isinstance(obj, dict):
        raise HeaderError("header is not a JSON object")
    entries: dict[str, Entry] = {}
    for name, info in obj.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(name, info)
    data = size - 8 - n
    ordered = sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end))
    at = 0
    for name, e in ordered:
        if e.begin != at:
            raise HeaderError(f"tensor {name}: data_offsets [{e.begin}, {e.end}] do not start where the tensor "
                              f"before it ends ({at}); the tensors must tile the data")
        if e.end > data:
            raise HeaderError(f"tensor {name}: data_offsets [{e.begin}, {e.end}] end past the file's {data} data "
                              f"bytes: truncated, or the header points past the end of the file")
        at = e.end
    if at != data:
        raise HeaderError(f"{data - at} bytes after the last tensor's data (the tensors must tile the data)")
    return Header(dict(ordered), 8 + n, size)


def _entry(name: str, info: object) -> Entry:
    if not isinstance(info, dict):
        raise HeaderError(f"tensor {name}: header entry is not a JSON object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPES:
        raise HeaderError(f"tensor {name}: unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise HeaderError(f"tensor {name}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)):
        raise HeaderError(f"tensor {name}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    nbytes = math.prod(shape) * DTYPES[dtype][1]
    if end - begin != nbytes:
        raise HeaderError(f"tensor {name}: data_offsets [{begin}, {end}] hold {end - begin} bytes, its dtype {dtype} "
                          f"and shape {shape} need {nbytes}")
    return Entry(dtype, tuple(shape), begin, end)


def layout(tensors: dict[str, tuple[str, tuple[int, ...]]],
           metadata: dict[str, str] | None = None) -> tuple[bytes, list[str]]:
    """(the file's first 8 + N bytes, tensor names in data order) of a safetensors file holding
    `tensors` {name: (dtype name, shape)}, exactly as the library writes it: "__metadata__" first
    when `metadata` is given (one key: the library keeps several in a hash map's order), then the
    tensors sorted by WRITE_ORDER descending, then name; compact JSON; padded with spaces to 8
    bytes. Raises HeaderError for a dtype outside WRITE_ORDER, or metadata of more than one key."""
    if metadata is not None and len(metadata) != 1:
        raise HeaderError(f"metadata {metadata!r}: the library's order is reproduced for one key only")
    rank = {d: i for i, d in enumerate(WRITE_ORDER)}
    bad = [n for n, (d, _) in tensors.items() if d not in rank]
    if bad:
        raise HeaderError(f"tensor {bad[0]}: dtype {tensors[bad[0]][0]!r} has no byte layout here")
    order = sorted(tensors, key=lambda n: (-rank[tensors[n][0]], n))
    header: dict = {} if metadata is None else {"__metadata__": dict(metadata)}
    at = 0
    for name in order:
        dtype, shape = tensors[name]
        nbytes = math.prod(shape) * DTYPES[dtype][1]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
    # serde_json's compact form: no spaces, non-ASCII kept as UTF-8
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order
