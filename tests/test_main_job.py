"""The main job on the cpu target with the real model: the session's micro probe bundle (conftest
`micro_bundle`: one prefill and one decode bucket) run through the CLI and runtime_min."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

from rich.console import Console

from stand_in import run_cli
from dsneuron.compiler.compile import build_steps_for_config, compile_bundle
from dsneuron.runtime_min.bundle.schema import SEAL, content_sha256


def test_run_generates_text_from_the_bundle(micro_bundle):
    r = subprocess.run([sys.executable, "-m", "dsneuron.compiler.cli", "run", str(micro_bundle.path), "--prompt", "Hello there",
                        "--max-new-tokens", "5"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


def test_prompt_longer_than_the_largest_bucket_exits_2(micro_bundle):
    r = subprocess.run([sys.executable, "-m", "dsneuron.compiler.cli", "run", str(micro_bundle.path), "--prompt", "word " * 40,
                        "--max-new-tokens", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "16" in r.stderr


def test_second_compile_with_the_same_cache_compiles_nothing(micro_bundle, tmp_path):
    b = micro_bundle
    parts = build_steps_for_config(b.model_cfg, b.compile_cfg, b.cache, probes=True)
    console = Console(file=io.StringIO(), width=300)
    again = compile_bundle(b.model_cfg, b.compile_cfg, tmp_path / "bundle2", parts, cache_dir=b.cache, console=console)
    assert "(0 of " in console.file.getvalue()

    def executables(root):
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in (root / "buckets").rglob("*.pt2")}

    first = executables(b.path)
    assert len(first) >= 4 and executables(again) == first  # staged: one per stage kind and bucket


def test_inspect_lists_the_stage_executables(micro_bundle):
    """`dsneuron inspect` on a staged bundle: each bucket's size is that of its stage executables,
    and every stage kind is listed with the stages that run it."""
    r = subprocess.run([sys.executable, "-m", "dsneuron.compiler.cli", "inspect", str(micro_bundle.path)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "300"})
    assert r.returncode == 0, r.stderr
    from dsneuron.runtime_min.bundle.bundle import read_manifest

    m = read_manifest(micro_bundle.path)
    for b in m.buckets:
        files = {st.file for st in b.stages}
        mib = sum(m.files[f]["size"] for f in files) / 2**20
        assert f"{mib:.2f}" in r.stdout
        for f in files:
            assert f in r.stdout
    assert "stages (one executable per stage kind)" in r.stdout and "layers.0" in r.stdout
    assert "prepared at load" in r.stdout and "weights 0 tensors" not in r.stdout


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsneuron.compiler.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "COLUMNS": "300"})


def test_run_stats_prints_prefill_first_token_and_decode_rate(micro_bundle):
    r = _cli("run", str(micro_bundle.path), "--prompt", "Hello there", "--max-new-tokens", "4", "--stats",
             "--temperature", "1.0", "--seed", "3")  # sampling, so EOS can hardly end it before 4 tokens
    assert r.returncode == 0, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "prefill " in line and "(bucket b1 s16)" in line and "time to first token" in line, line
    assert "tokens/s" in line and "executables loaded on first use" in line, line


def test_run_prompts_file_prints_one_json_line_per_prompt(micro_bundle, tmp_path):
    import json

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "Hello there"}\n\n', encoding="utf-8")
    r = _cli("run", str(micro_bundle.path), "--prompts-file", str(f), "--max-new-tokens", "3")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(rows) == 1 and rows[0]["prompt"] == "Hello there" and isinstance(rows[0]["completion"], str)
    # micro_bundle has batch-1 buckets only: the scheduler runs the prompts one row at a time,
    # printed in input order, each the completion it gets alone
    from dsneuron.runtime_min.session import Session

    prompts = ["one", "two words", "and three"]
    f.write_text("\n".join(prompts) + "\n", encoding="utf-8")
    r = _cli("run", str(micro_bundle.path), "--prompts-file", str(f), "--max-new-tokens", "5")
    assert r.returncode == 0, r.stderr
    session = Session.load(micro_bundle.path)
    assert [json.loads(x) for x in r.stdout.splitlines()] == [
        {"prompt": p, "completion": session.generate(p, 5)} for p in prompts]


def test_run_bad_prompt_options_exit_2_before_loading(tmp_path, monkeypatch, capsys):
    """Refused before the bundle is opened: the bundle path here does not exist."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 3}\n', encoding="utf-8")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": \n', encoding="utf-8")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n", encoding="utf-8")
    nobundle = str(tmp_path / "no-bundle")
    for args, message in [((), "exactly one of --prompt TEXT and --prompts-file FILE"),
                          (("--prompt", "x", "--prompts-file", str(bad)), "exactly one of"),
                          (("--prompts-file", str(tmp_path / "none.txt")), "none.txt: does not exist"),
                          (("--prompts-file", str(bad)), 'line 1: a JSON line needs a string "prompt"'),
                          (("--prompts-file", str(broken)), "line 1: not valid JSON"),
                          (("--prompts-file", str(empty)), "holds no prompt"),
                          (("--prompt", "x", "--max-new-tokens", "0"), "--max-new-tokens must be a positive integer, got 0"),
                          (("--prompt", "x", "--temperature", "-1"), "temperature"),
                          (("--prompt", "x", "--seed", "-1"), "seed")]:
        code = run_cli(monkeypatch, "run", nobundle, *args)
        err = capsys.readouterr().err
        assert code == 2 and message in " ".join(err.split()), (args, err)


def test_a_stage_pointed_at_another_kinds_executable_is_refused(micro_bundle, tmp_path):
    """A resealed manifest that points one stage (layers.0.ffn) at the file of another kind (the
    embedding, which takes other arguments): refused at load with exit 2 naming the stage, not
    run with the wrong executable or a traceback."""
    copy = tmp_path / "bundle"
    shutil.copytree(micro_bundle.path, copy)
    m = json.loads((copy / "manifest.json").read_text())
    for bucket in m["buckets"]:
        embed = next(st["file"] for st in bucket["stages"] if st["name"] == "embed")
        next(st for st in bucket["stages"] if st["name"] == "layers.0.ffn")["file"] = embed
    m[SEAL] = content_sha256(m)
    (copy / "manifest.json").write_text(json.dumps(m))
    r = _cli("run", str(copy), "--prompt", "Hello", "--max-new-tokens", "2")
    assert r.returncode == 2 and "stage layers.0.ffn" in r.stderr and "Traceback" not in r.stderr, r.stderr
