"""Bundle signatures: who wrote a bundle's executables, checkable before any of them is opened.

A bundle's executables are native code that `dsneuron run` loads into the user's process; the
manifest seal and sha256 list catch corruption, but anyone who can write the folder can also reseal
it. A signature made with a private key can only be remade by its holder.

Signing and verification are the OpenSSF `model-signing` library's key-based mode (elliptic-curve
keys, P-256/384/521, PEM; e.g. `openssl ecparam -name prime256v1 -genkey -noout -out key.pem` and
`openssl ec -in key.pem -pubout -out key.pub`): it hashes every file of the bundle folder (the
manifest included, so every digest and the seal are covered) into a manifest of its own and signs
that as a DSSE envelope in a Sigstore bundle, written to `signature.sig` at the bundle's top
(the one file left out of the hash). Verification recomputes the hashes and refuses any file
changed, added or removed after signing.

The trust rule (README): with a verify key (`--verify-key` or DSNEURON_VERIFY_KEY), a bundle that
is unsigned, signed by another key, or changed after signing is refused before anything of it
loads; without one, bundles load as they always did, signed or not.
Source: github.com/sigstore/model-transparency (PyPI model-signing), its `signing.Config.
use_elliptic_key_signer` and `verifying.Config.use_elliptic_key_verifier`.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from .schema import BundleError

SIGNATURE = "signature.sig"
#: the environment variable naming the verify key when --verify-key is not given
VERIFY_KEY_ENV = "DSNEURON_VERIFY_KEY"


def _hashing():
    from model_signing import hashing

    return hashing.Config().set_ignored_paths(paths=[SIGNATURE], ignore_git_paths=False)


def check_private_key(private_key: Path, password: str | None = None) -> None:
    """Raise BundleError unless `private_key` is a readable PEM elliptic-curve private key of a
    curve model-signing takes (checked before a compile, so a bad key fails in seconds)."""
    from model_signing._signing.sign_ec_key import Signer

    from cryptography.hazmat.primitives import serialization

    key = Path(private_key)
    if not key.is_file():
        raise BundleError(f"signing key {key} does not exist")
    try:
        _require_ec(key, serialization.load_pem_private_key(key.read_bytes(), password and password.encode()), "private")
        Signer(key, password)
    except (ValueError, TypeError) as e:
        raise BundleError(f"signing key {key}: not a usable elliptic-curve private key ({e})") from None


def _require_ec(path: Path, key: object, which: str) -> None:
    """Raise BundleError naming the key's type unless it is an elliptic-curve key (model-signing's
    key mode takes nothing else, and fails on an RSA or Ed25519 key without saying so)."""
    from cryptography.hazmat.primitives.asymmetric import ec

    if not isinstance(key, (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey)):
        kind = type(key).__name__.lstrip("_").replace("PrivateKey", "").replace("PublicKey", "")
        raise BundleError(f"{'signing' if which == 'private' else 'verify'} key {path}: its type is {kind} ({which}); bundles "
                          "are signed with elliptic-curve keys (P-256, P-384 or P-521; e.g. `openssl ecparam -name "
                          "prime256v1 -genkey -noout -out key.pem`)")


def sign_bundle(root: Path, private_key: Path, password: str | None = None) -> Path:
    """Sign the bundle folder `root` with the PEM private key `private_key`; writes (or replaces)
    root/signature.sig whole, and returns its path. Raises BundleError naming the key when it
    cannot be read or is not a supported elliptic-curve key."""
    from model_signing import signing

    root, key = Path(root), Path(private_key)
    check_private_key(key, password)
    fd, tmp = tempfile.mkstemp(prefix=".signature.", dir=root.parent)
    os.close(fd)
    try:
        config = signing.Config().use_elliptic_key_signer(private_key=key, password=password)
        config.set_hashing_config(_hashing()).sign(root, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, root / SIGNATURE)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return root / SIGNATURE


def verify_bundle(root: Path, public_key: Path) -> None:
    """Raise BundleError unless root/signature.sig is a signature by the private key of the PEM
    public key `public_key` over exactly the bundle's files as they are now; the message says
    which: unsigned, unreadable signature, another key, or which files changed."""
    from model_signing import verifying

    root, key = Path(root), Path(public_key)
    sig = root / SIGNATURE
    if not key.is_file():
        raise BundleError(f"verify key {key} does not exist")
    if not sig.is_file():
        raise BundleError(f"bundle {root} is not signed (no {SIGNATURE}) and a verify key is set: refusing to load it")
    from cryptography.hazmat.primitives import serialization

    try:
        _require_ec(key, serialization.load_pem_public_key(key.read_bytes()), "public")
        config = verifying.Config().use_elliptic_key_verifier(public_key=key)
    except ValueError as e:
        raise BundleError(f"verify key {key}: not a usable elliptic-curve public key ({e})") from None
    try:
        config.set_hashing_config(_hashing()).verify(root, sig)
    except Exception as e:  # the library raises ValueError, protobuf/JSON errors and cryptography's InvalidSignature
        text = str(e) or type(e).__name__
        if "Key mismatch" in text:
            raise BundleError(f"bundle {root} is signed by another key than {key}: refusing to load it") from None
        if "Signature mismatch" in text:
            raise BundleError(f"bundle {root} was changed after it was signed ({_what_changed(text)}): refusing to "
                              "load it") from None
        raise BundleError(f"bundle {root}: its {SIGNATURE} does not verify with {key} ({type(e).__name__}: {text[:200]})"
                          ": refusing to load it") from None


def _what_changed(mismatch: str) -> str:
    """"changed: a, b; added: c; removed: d" from model-signing's mismatch message (its digests left out)."""
    mismatch = mismatch.replace("\\'", "'")  # the library formats a list: its quotes come escaped
    parts = []
    changed = re.findall(r"Hash mismatch for '([^']+)'", mismatch)
    if changed:
        parts.append("changed: " + ", ".join(changed))
    for label, pattern in (("added", r"Extra files found in model '[^']*': ([^\]\"]+)"),
                           ("removed", r"Missing files in model '[^']*': ([^\]\"]+)")):
        m = re.search(pattern, mismatch)
        if m:
            parts.append(f"{label}: {m.group(1).strip(chr(39)).strip()}")
    return "; ".join(parts) or mismatch[:200]


def signer_hint(root: Path) -> str | None:
    """The sha256 of the signing public key (PEM) recorded in root/signature.sig, "unreadable" when
    the file is not a signature this module wrote, None when the bundle is unsigned. Informative
    only: nothing is verified here."""
    sig = Path(root) / SIGNATURE
    if not sig.is_file():
        return None
    try:
        hint = json.loads(sig.read_text())["verificationMaterial"]["publicKey"]["hint"]
        return str(hint)
    except (ValueError, KeyError, TypeError, OSError):
        return "unreadable"


def public_key_hint(public_key: Path) -> str:
    """The sha256 of a PEM public key as model-signing records it (for comparing with signer_hint)."""
    import hashlib

    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_public_key(Path(public_key).read_bytes())
    pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(pem).hexdigest()
