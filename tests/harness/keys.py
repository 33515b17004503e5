"""Signing key pairs for the fleet tests (needs the ``fleet`` extra's ``cryptography``)."""

from __future__ import annotations

from pathlib import Path

from packcache.fleet.manifest import generate_key, public_path_for


def make_keys(directory: Path, *names: str) -> dict[str, Path]:
    """A key pair per name in ``directory`` (0600 private, 0644 public, as ``keygen`` makes them):
    ``{name: private key path, f"{name}.pub": public key path}``."""
    made = {}
    for name in names:
        generate_key(directory / f"{name}.pem")
        made[name] = directory / f"{name}.pem"
        made[f"{name}.pub"] = Path(public_path_for(directory / f"{name}.pem"))
    return made
