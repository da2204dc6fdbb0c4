"""Signed bundles (runtime_min/bundle/signing.py): sign + verify round trip, every kind of change after
signing refused under a verify key (weights, executable, manifest resealed, tokenizer, an added
file, a removed file), another key refused, the signature itself truncated or edited refused, and
the CLI paths (compile --sign-key, sign, run/inspect --verify-key and DSNEURON_VERIFY_KEY). On the
compiled stand-in bundle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

import stand_in
from stand_in import run_cli
from dsneuron.runtime_min.bundle.bundle import open_bundle
from dsneuron.runtime_min.bundle.schema import SEAL, BundleError, content_sha256
from dsneuron.runtime_min.bundle.signing import SIGNATURE, public_key_hint, sign_bundle, signer_hint, verify_bundle


def _keypair(folder: Path, name: str, curve=ec.SECP256R1()) -> tuple[Path, Path]:
    key = ec.generate_private_key(curve)
    priv, pub = folder / f"{name}.pem", folder / f"{name}.pub"
    priv.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    return priv, pub


@pytest.fixture()
def keys(tmp_path):
    return _keypair(tmp_path, "a"), _keypair(tmp_path, "b")


@pytest.fixture()
def signed(tmp_path, keys):
    src, _ = stand_in.shared_bundle()
    dst = tmp_path / "bundle"
    shutil.copytree(src, dst)
    sign_bundle(dst, keys[0][0])
    return dst


def test_round_trip_and_the_recorded_signer(signed, keys):
    (priv, pub), (_, other) = keys
    assert (signed / SIGNATURE).is_file()
    verify_bundle(signed, pub)
    assert open_bundle(signed, pub).root == signed
    assert signer_hint(signed) == public_key_hint(pub) != public_key_hint(other)
    open_bundle(signed)  # without a verify key a signed bundle loads as any other


def _reseal(root: Path, change) -> None:
    m = json.loads((root / "manifest.json").read_text())
    change(m)
    m[SEAL] = content_sha256(m)
    (root / "manifest.json").write_text(json.dumps(m))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _tamper_weights(root):
    _flip_byte(root / "weights.safetensors")


def _tamper_executable(root):
    _flip_byte(next((root / "buckets").rglob("*.pt2")))


def _tamper_manifest_resealed(root):
    # the attack the seal alone cannot stop: edit, recompute every checksum and the seal
    _reseal(root, lambda m: m.update(created_by=m["created_by"] + "+evil"))


def _tamper_tokenizer(root):
    tok = next((root / "tokenizer").glob("*.json"))
    tok.write_text(tok.read_text().replace("{", "{ ", 1))


def _add_file(root):
    (root / "buckets" / "extra.so").write_bytes(b"\x7fELF")


def _remove_file(root):
    next((root / "tokenizer").iterdir()).unlink()


@pytest.mark.parametrize("tamper, named", [(_tamper_weights, "changed: weights.safetensors"),
                                           (_tamper_executable, "changed: buckets/"),
                                           (_tamper_manifest_resealed, "changed: manifest.json"),
                                           (_tamper_tokenizer, "changed: tokenizer/"),
                                           (_add_file, "added: buckets/extra.so"),
                                           (_remove_file, "removed: tokenizer/")])
def test_any_change_after_signing_is_refused(signed, keys, tamper, named):
    tamper(signed)
    with pytest.raises(BundleError, match=f"was changed after it was signed \\({named}.*refusing to load it"):
        open_bundle(signed, keys[0][1])


def test_another_key_and_no_signature_are_refused(signed, keys, tmp_path):
    with pytest.raises(BundleError, match="is signed by another key than .*b.pub"):
        open_bundle(signed, keys[1][1])
    (signed / SIGNATURE).unlink()
    with pytest.raises(BundleError, match="is not signed \\(no signature.sig\\) and a verify key is set"):
        open_bundle(signed, keys[0][1])
    with pytest.raises(BundleError, match="verify key .*none.pub does not exist"):
        open_bundle(signed, tmp_path / "none.pub")


@pytest.mark.parametrize("edit", ["truncate", "payload", "signature", "garbage"])
def test_an_edited_signature_is_refused(signed, keys, edit):
    sig = signed / SIGNATURE
    text = sig.read_text()
    if edit == "truncate":
        sig.write_text(text[: len(text) // 2])
    elif edit == "garbage":
        sig.write_bytes(b"\x00\xff not a signature")
    else:
        doc = json.loads(text)
        env = doc["dsseEnvelope"]
        if edit == "payload":
            env["payload"] = env["payload"][:-8] + ("A" * 8 if not env["payload"].endswith("A" * 8) else "B" * 8)
        else:
            s = env["signatures"][0]["sig"]
            env["signatures"][0]["sig"] = ("A" if s[0] != "A" else "B") + s[1:]
        sig.write_text(json.dumps(doc))
    with pytest.raises(BundleError, match="refusing to load it"):
        open_bundle(signed, keys[0][1])


def test_bad_signing_keys_are_named(tmp_path, keys):
    src, _ = stand_in.shared_bundle()
    dst = tmp_path / "b"
    shutil.copytree(src, dst)
    not_pem = tmp_path / "k.pem"
    not_pem.write_text("hello")
    with pytest.raises(BundleError, match="not a usable elliptic-curve private key"):
        sign_bundle(dst, not_pem)
    with pytest.raises(BundleError, match="signing key .*missing.pem does not exist"):
        sign_bundle(dst, tmp_path / "missing.pem")
    assert not (dst / SIGNATURE).exists()


@pytest.mark.parametrize("kind", ["RSA", "Ed25519"])
def test_keys_of_another_type_are_named_not_a_traceback(tmp_path, kind):
    """model-signing's key mode takes elliptic-curve keys only, and fails on others with an
    AttributeError; dsneuron names the key's type, for signing, compiling with --sign-key and verifying."""
    from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

    key = rsa.generate_private_key(65537, 2048) if kind == "RSA" else ed25519.Ed25519PrivateKey.generate()
    priv, pub = tmp_path / "k.pem", tmp_path / "k.pub"
    priv.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    src, _ = stand_in.shared_bundle()
    dst = tmp_path / "b"
    shutil.copytree(src, dst)
    with pytest.raises(BundleError, match=rf"signing key {priv}: its type is {kind} \(private\); bundles are signed "
                                          "with elliptic-curve keys"):
        sign_bundle(dst, priv)
    (dst / SIGNATURE).write_text("{}")
    with pytest.raises(BundleError, match=rf"verify key {pub}: its type is {kind} \(public\)"):
        verify_bundle(dst, pub)


def test_cli_sign_run_and_inspect_with_a_verify_key(tmp_path, keys, monkeypatch, capsys):
    (priv, pub), (_, other) = keys
    src, _ = stand_in.shared_bundle()
    dst = tmp_path / "bundle"
    shutil.copytree(src, dst)
    assert run_cli(monkeypatch, "inspect", str(dst)) == 0
    assert "signature: none (unsigned)" in capsys.readouterr().out
    assert run_cli(monkeypatch, "inspect", str(dst), "--verify-key", str(pub)) == 2
    assert "is not signed" in capsys.readouterr().err
    assert run_cli(monkeypatch, "sign", str(dst), "--key", str(priv)) == 0
    capsys.readouterr()
    assert run_cli(monkeypatch, "inspect", str(dst), "--verify-key", str(pub)) == 0
    out = capsys.readouterr().out
    assert f"by the key with sha256 {public_key_hint(pub)}" in out and "signature by" in out
    _tamper_manifest_resealed(dst)
    monkeypatch.setenv("DSNEURON_VERIFY_KEY", str(pub))
    assert run_cli(monkeypatch, "run", str(dst), "--prompt", "hi") == 2
    assert "was changed after it was signed" in capsys.readouterr().err
    monkeypatch.setenv("DSNEURON_VERIFY_KEY", str(other))
    assert run_cli(monkeypatch, "run", str(dst), "--prompt", "hi") == 2
    assert "signed by another key" in capsys.readouterr().err


def test_compile_sign_key_signs_before_the_bundle_appears(tmp_path, keys, monkeypatch, capsys):
    from dsneuron.compiler import backend_cpu
    from dsneuron.compiler import compile as pipeline
    from dsneuron.compiler.cache import normalised_graph

    (priv, pub), _ = keys
    monkeypatch.setattr(backend_cpu, "compile_cpu", lambda program, out, flags: out.write_text(normalised_graph(program)))
    kit = stand_in.make_kit(tmp_path, {"max_seq_len": 8, "decode_context_lens": [8]})
    config = tmp_path / "stand_in.json"
    config.write_text(json.dumps({"model": kit.model_cfg.to_dict(), "compile": kit.compile_cfg.to_dict()}))
    monkeypatch.setattr(pipeline, "build_steps_for_config", lambda m, c, cache_dir=None, probes=False, target="cpu": kit.parts)
    out = tmp_path / "art"
    bad = tmp_path / "bad.pem"
    bad.write_text("x")
    assert run_cli(monkeypatch, "compile", "--config", str(config), "--out", str(out), "--cache-dir",
                   str(tmp_path / "c"), "--sign-key", str(bad)) == 2
    assert "not a usable elliptic-curve private key" in capsys.readouterr().err and not out.exists()
    assert run_cli(monkeypatch, "compile", "--config", str(config), "--out", str(out), "--cache-dir",
                   str(tmp_path / "c"), "--sign-key", str(priv)) == 0
    verify_bundle(out, pub)
