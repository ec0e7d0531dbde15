"""Who may act. Viewers see everything; only operators can trigger actions.

Operators are either OIDC users (through Streamlit's `st.login`, when `[auth]` is
configured in Streamlit secrets; allowed emails in `operators_oidc`), or named
accounts whose passwords are stored hashed (PBKDF2-SHA256) in Streamlit secrets
(`[operators]`) or in the TOML file named by CLUSTERPULSE_OPERATORS_FILE.
Create a hash with `clusterpulse-ctl hash-password`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import tomllib
from pathlib import Path

ITERATIONS = 200_000


def hash_password(password: str, salt: bytes | None = None) -> str:
    salt = salt or secrets.token_bytes(16)
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, ITERATIONS)
    return f"pbkdf2_sha256${ITERATIONS}${salt.hex()}${digest.hex()}"


def verify_password(password: str, stored: str) -> bool:
    """Constant-time check against a stored hash; False for any malformed entry."""
    try:
        scheme, iterations, salt, digest = stored.split("$")
        if scheme != "pbkdf2_sha256":
            return False
        got = hashlib.pbkdf2_hmac("sha256", password.encode(), bytes.fromhex(salt),
                                  int(iterations))
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(got.hex(), digest)


def load_operators(file: Path | None, secrets_section: dict | None) -> dict[str, str]:
    """name -> password hash, from Streamlit secrets and/or the operators file."""
    ops: dict[str, str] = {}
    if secrets_section:
        ops.update({str(k): str(v) for k, v in secrets_section.items()})
    if file is not None:
        try:
            data = tomllib.loads(file.read_text())
        except (OSError, tomllib.TOMLDecodeError):
            return ops
        ops.update({str(k): str(v) for k, v in data.get("operators", {}).items()})
    return ops


def authenticate(name: str, password: str, operators: dict[str, str]) -> bool:
    stored = operators.get(name)
    if stored is None:
        verify_password(password, hash_password("x"))  # same cost: no user enumeration
        return False
    return verify_password(password, stored)
