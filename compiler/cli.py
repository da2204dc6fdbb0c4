"""The `dsneuron` command line (typer). Every command is a thin wrapper over a Python API; user
errors (`dsneuron.UserError`) print one line naming the problem and exit with code 2."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from dsneuron import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Ahead-of-time compiler and minimal runtime for DeepSeek-V4.x models (cpu and neuron targets).")
console = Console()
err_console = Console(stderr=True)


@app.command("make-checkpoint")
def make_checkpoint_cmd(
    config: str = typer.Option(..., "--config", help="config JSON path or packaged name (tiny, micro)"),
    out: Path = typer.Option(..., "--out", help="output folder (must not exist unless --force)"),
    seed: int = typer.Option(0, "--seed", help="random seed; the same seed gives byte-identical files"),
    force: bool = typer.Option(False, "--force", help="replace an existing output folder"),
) -> None:
    """Write a deterministic random checkpoint in the HF layout of V4.1-Flash."""
    from dsneuron.compiler.config import load_config
    from dsneuron.graphs.checkpoint import make_checkpoint

    model, _, _ = load_config(config)
    make_checkpoint(model, out, seed=seed, force=force, console=console)


@app.command("inspect-checkpoint")
def inspect_checkpoint_cmd(
    path: Path = typer.Argument(..., help="checkpoint folder"),
    stats: bool = typer.Option(False, "--stats", help="also run the model and report numeric health"),
) -> None:
    """Validate a checkpoint and print its tensor families, dtypes, shapes and bytes."""
    from dsneuron.graphs.checkpoint import inspect_checkpoint

    inspect_checkpoint(path, stats=stats, console=console)


def main() -> None:
    """Console-script entry point: run the typer app, mapping UserError to exit code 2."""
    try:
        app(standalone_mode=False)
    except UserError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("[bold red]interrupted[/]")
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:  # click usage errors arrive here with standalone_mode=False
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(2)
        if isinstance(e, click.exceptions.Abort):
            sys.exit(130)
        raise


if __name__ == "__main__":
    main()
