"""The prompts shipped with the package (compiler/prompts/*.txt), used by `dsneuron compare` and the
benchmark: short (11 tokens), medium (172: wraps tiny's 128-token window) and long (715: tiny's
candidate-block filter active), counted with the DeepSeek V4 tokenizer and BOS; and for bundles
too small for those (micro: 64 tokens of context), short with small_medium (21: wraps micro's
16-token window) and small_long (55: fits 64 with 8 decode steps).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Callable

from dsneuron import UserError

NAMES = ("short", "medium", "long")
SMALL_NAMES = ("short", "small_medium", "small_long")


def default_prompts(names: tuple[str, ...] = NAMES) -> list[tuple[str, str]]:
    """[(name, text)] of the shipped prompts `names` (default NAMES), in that order."""
    root = resources.files("dsneuron.compiler") / "prompts"
    return [(name, (root / f"{name}.txt").read_text(encoding="utf-8")) for name in names]


def shipped_prompts(fits: Callable[[str], bool]) -> list[tuple[str, str]]:
    """The shipped prompts for a bundle: NAMES when `fits(text)` holds for all of them, else SMALL_NAMES."""
    prompts = default_prompts()
    return prompts if all(fits(text) for _, text in prompts) else default_prompts(SMALL_NAMES)


def read_prompts(path: Path) -> list[tuple[str, str]]:
    """Prompts from a file: one prompt per line (blank lines skipped), named by line number.
    Raises UserError when the file is missing, unreadable as UTF-8, or holds no prompt."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--prompts {path}: cannot read it ({e})") from None
    prompts = [(f"line{i + 1}", line) for i, line in enumerate(lines) if line.strip()]
    if not prompts:
        raise UserError(f"--prompts {path}: no prompt in it (one prompt per non-blank line)")
    return prompts
