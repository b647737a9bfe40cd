"""host.identity_file: a private key, not its public half.

paramiko, handed a `.pub` file, says "not a valid OPENSSH private key file", which does
not tell a user that the file is the other half of the pair. Checked before connecting.
"""

from __future__ import annotations

from pathlib import Path

from dflashctl.errors import ConfigError

# How a public key's single line starts (OpenSSH's key types, FIDO keys included).
PUBLIC_KEY_PREFIXES = (b"ssh-", b"ecdsa-sha2-", b"sk-ssh-", b"sk-ecdsa-")


def is_public_key(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            head = handle.read(64)
    except OSError:
        return False
    return head.startswith(PUBLIC_KEY_PREFIXES)


def check_identity_file(path: str) -> None:
    """ConfigError (exit 2) when `path` is a public key file."""
    file = Path(path).expanduser()
    if not is_public_key(file):
        return
    private = file.with_suffix("") if file.suffix == ".pub" else None
    if private is not None and private.is_file():
        hint = f"set host.identity_file: {private} (the private key of this pair)"
    else:
        hint = "point it at the private key of this pair (the file without .pub)"
    raise ConfigError(
        f"host.identity_file: {path} is a public key; SSH logs in with the private key",
        hint=hint,
    )
