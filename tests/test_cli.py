"""The `dsneuron` entry point's process behaviour (compiler/cli.py): Ctrl-C, SIGTERM and output
width when piped. Stand-in kits only; the SIGTERM test runs the CLI in a subprocess so that a
missing handler cannot kill the test process."""

from __future__ import annotations

import io
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dsneuron
import stand_in
from stand_in import run_cli
from dsneuron.compiler import cli
from dsneuron.runtime_min import session as session_mod


def test_ctrl_c_prints_interrupted_and_exits_130(monkeypatch, capsys, tmp_path):
    def interrupt(path, verify_key=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(session_mod.Session, "load", interrupt)
    assert run_cli(monkeypatch, "run", str(tmp_path), "--prompt", "hi") == 130
    captured = capsys.readouterr()
    assert captured.err.strip() == "interrupted" and captured.out == ""


_SIGTERM_SCRIPT = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
import stand_in
from dsneuron.compiler import backend_cpu, cli
from dsneuron.compiler import compile as pipeline

work = Path({work!r})
kit = stand_in.make_kit(work, {{"max_seq_len": 8, "decode_context_lens": [8]}})
config = work / "stand_in.json"
config.write_text(json.dumps({{"model": kit.model_cfg.to_dict(), "compile": kit.compile_cfg.to_dict()}}))
pipeline.build_steps_for_config = lambda m, c, cache_dir=None, probes=False, target="cpu": kit.parts

def slow(program, out, flags):
    out.write_text("half-written")
    (work / "ready").write_text("")
    time.sleep(120)

backend_cpu.compile_cpu = slow
sys.argv = ["dsneuron", "compile", "--config", str(config), "--out", str(work / "art"), "--cache-dir", str(work / "cache")]
cli.main()
"""


def test_sigterm_during_compile_cleans_up(tmp_path):
    """SIGTERM while a bucket compiles: the command unwinds like an exception, so the temporary
    bundle folder is removed, nothing appears at --out, and the exit code is 143 (128 + 15)."""
    script = _SIGTERM_SCRIPT.format(tests=str(Path(stand_in.__file__).parent), work=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "ready").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the compile never reached the backend: {proc.communicate()[1][-2000:]}")
            time.sleep(0.2)
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".art.tmp-")]  # the partial bundle
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err[-2000:]
    assert "terminated" in err and "Traceback" not in err
    assert not (tmp_path / "art").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".art")] == []


def test_piped_console_does_not_wrap(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    console = cli.make_console()
    assert console.width == cli.PIPE_WIDTH
    line = " ".join(f"word{i}" for i in range(40))  # 269 characters
    console.print(line)
    assert sys.stdout.getvalue() == line + "\n"
    monkeypatch.setenv("COLUMNS", "100")
    assert cli.make_console().width == 100  # an explicit width wins


def test_piped_inspect_keeps_lines_whole(monkeypatch, capsys, tmp_path):
    """`dsneuron inspect B | cat`: each printed line stays one line (rich wrapped at 80 columns)."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(cli, "console", cli.make_console())
    src, _ = stand_in.shared_bundle()
    deep = tmp_path / "a-folder-with-a-rather-long-name-to-pass-eighty-columns" / "bundle"
    shutil.copytree(src, deep)
    assert run_cli(monkeypatch, "inspect", str(deep)) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(line for line in lines if line.startswith(str(deep)))
    assert len(head) > 80 and head.endswith(f"target cpu, dsneuron {dsneuron.__version__}")
    assert any(line.startswith("weights ") and line.endswith("engram hashing yes") for line in lines)


def test_help_shows_no_value_after_flags(monkeypatch, capsys):
    """An on/off flag takes no value, so its help line names none (typer prints "<bool>" by default)."""
    for command, flag in (("compile", "--force"), ("compile", "--probes"), ("run", "--stats"),
                          ("make-checkpoint", "--force"), ("inspect-checkpoint", "--stats")):
        monkeypatch.setenv("COLUMNS", "200")
        run_cli(monkeypatch, command, "--help")
        line = next(x for x in capsys.readouterr().out.splitlines() if f"{flag} " in x)
        assert "<bool>" not in line, line


def test_compile_workers_die_at_once_on_terminate():
    """A staged-compile worker gets SIGTERM's default action back (it inherits the CLI's handler
    through fork, which would turn the parent's terminate() into an exception inside one task and
    let the worker run the next ones) and ignores SIGINT (the parent handles Ctrl-C)."""
    code = ("import signal; from dsneuron.compiler import cli, staged; "
            "signal.signal(signal.SIGTERM, cli._on_sigterm); staged._worker_init(); "
            "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, signal.getsignal(signal.SIGINT) is signal.SIG_IGN)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["True", "True"], r.stderr


def test_version_prints_the_package_version(monkeypatch, capsys):
    assert run_cli(monkeypatch, "--version") == 0
    assert capsys.readouterr().out.strip() == f"dsneuron {dsneuron.__version__}"
