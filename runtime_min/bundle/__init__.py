"""Bundle loading and trust: the bundle format (schema.py), opening and verifying a bundle
(bundle.py) and its signature (signing.py). The lowest layer of runtime_min: it imports no other
subpackage of it."""
