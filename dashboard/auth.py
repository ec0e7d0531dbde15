"""Who may act. Viewers see everything; only operators can trigger actions.

Operators are either OIDC users (through Streamlit's `st.login`, when `[auth]` is
configured in Streamlit secrets; allowed emails in `operators_oidc`), or named
accounts whose passwords are stored hashed in Streamlit secrets (`[operators]`) or
in the TOML file named by CLUSTERPULSE_OPERATORS_FILE. Create a hash with
`clusterpulse-ctl hash-password`.

Hash policy: scrypt (N=2^14, r=8, p=5: OWASP's 2023 equivalents of N=2^17/p=1, at
16 MiB of memory per check). PBKDF2-SHA256 hashes are still accepted at 600,000
iterations or more (OWASP); the parameters stored in a hash are checked against this
policy before they are used, so a weaker stored hash (e.g. 1 iteration) never
verifies: the operator is told, once they give the right password, to have it
re-created. Failed sign-ins are throttled per operator name and overall, and a
signed-in session expires (see `SESSION_TTL_S`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 5
PBKDF2_MIN_ITERATIONS = 600_000
_MAX_N = 2**20  # refuse absurd stored parameters (memory/CPU exhaustion)
_MAXMEM = 256 * 2**20
SESSION_TTL_S = 8 * 3600.0


class WeakHash(Exception):
    """A stored hash below the policy; the text says what to do."""


def hash_password(password: str, salt: bytes | None = None) -> str:
    salt = salt or secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P,
                            maxmem=_MAXMEM, dklen=32)
    return f"scrypt${SCRYPT_N}${SCRYPT_R}${SCRYPT_P}${salt.hex()}${digest.hex()}"


def _check(password: str, stored: str) -> tuple[bool, bool]:
    """(matches, meets the policy). Raises ValueError on a malformed entry."""
    parts = stored.split("$")
    if parts[0] == "scrypt" and len(parts) == 6:
        n, r, p = (int(x) for x in parts[1:4])
        if not (1 < n <= _MAX_N and n & (n - 1) == 0 and 1 <= r <= 32 and 1 <= p <= 16):
            raise ValueError("scrypt parameters out of range")
        strong = r >= SCRYPT_R and n * p >= SCRYPT_N * SCRYPT_P
        got = hashlib.scrypt(password.encode(), salt=bytes.fromhex(parts[4]), n=n, r=r, p=p,
                             maxmem=_MAXMEM, dklen=len(bytes.fromhex(parts[5])))
        return hmac.compare_digest(got.hex(), parts[5]), strong
    if parts[0] == "pbkdf2_sha256" and len(parts) == 4:
        iterations = int(parts[1])
        if not 1 <= iterations <= 10_000_000:
            raise ValueError("pbkdf2 iterations out of range")
        got = hashlib.pbkdf2_hmac("sha256", password.encode(), bytes.fromhex(parts[2]),
                                  iterations)
        return hmac.compare_digest(got.hex(), parts[3]), iterations >= PBKDF2_MIN_ITERATIONS
    raise ValueError("unknown hash scheme")


def verify_password(password: str, stored: str) -> bool:
    """Constant-time check against a stored hash that meets the policy.

    False for a wrong password or a malformed entry; raises WeakHash when the
    password is right but the stored hash is below the policy (never trusted)."""
    try:
        ok, strong = _check(password, stored)
    except (ValueError, TypeError, OverflowError, MemoryError):
        return False
    if ok and not strong:
        raise WeakHash("this operator's password hash is weaker than the policy (scrypt, or "
                       f"PBKDF2-SHA256 with >= {PBKDF2_MIN_ITERATIONS:,} iterations): "
                       "ask an administrator to re-create it with "
                       "`clusterpulse-ctl hash-password`")
    return ok


def weak_entries(operators: dict[str, str]) -> list[str]:
    """Names whose stored hash is below the policy or malformed (checked without a
    password, from the parameters alone), for a warning at start-up."""
    out = []
    for name, stored in operators.items():
        parts = stored.split("$")
        try:
            if parts[0] == "scrypt" and len(parts) == 6:
                n, r, p = int(parts[1]), int(parts[2]), int(parts[3])
                ok = r >= SCRYPT_R and n * p >= SCRYPT_N * SCRYPT_P
            elif parts[0] == "pbkdf2_sha256" and len(parts) == 4:
                ok = int(parts[1]) >= PBKDF2_MIN_ITERATIONS
            else:
                ok = False
        except ValueError:
            ok = False
        if not ok:
            out.append(name)
    return out


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


@dataclass
class Throttle:
    """Failed sign-ins: after `per_name` failures for one name within `window_s` that
    name is locked for the rest of the window; after `overall` failures (any names)
    every sign-in is. Shared by every session of the dashboard process."""

    per_name: int = 5
    overall: int = 50
    window_s: float = 900.0
    clock: Callable[[], float] = time.monotonic
    _fails: dict[str, list[float]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _recent(self, key: str, now: float) -> list[float]:
        kept = [t for t in self._fails.get(key, []) if now - t < self.window_s]
        if kept:
            self._fails[key] = kept
        else:
            self._fails.pop(key, None)
        return kept

    def retry_after(self, name: str) -> float:
        """Seconds until `name` may try again (0: now)."""
        now = self.clock()
        with self._lock:
            waits = [t + self.window_s - now for key, limit in ((f"n:{name}", self.per_name),
                                                                 ("*", self.overall))
                     if len(fails := self._recent(key, now)) >= limit for t in fails[:1]]
        return max(waits, default=0.0)

    def failed(self, name: str) -> None:
        now = self.clock()
        with self._lock:
            if len(self._fails) > 10000:  # bounded whatever names are tried
                self._fails = {k: v for k, v in self._fails.items() if k == "*"}
            for key in (f"n:{name}", "*"):
                self._fails.setdefault(key, []).append(now)

    def succeeded(self, name: str) -> None:
        with self._lock:
            self._fails.pop(f"n:{name}", None)


@dataclass(frozen=True)
class SignIn:
    ok: bool
    message: str = ""


THROTTLE = Throttle()


def authenticate(name: str, password: str, operators: dict[str, str],
                 throttle: Throttle | None = None) -> SignIn:
    """Check a sign-in; the message is safe to show (no user enumeration)."""
    throttle = throttle or THROTTLE
    wait = throttle.retry_after(name)
    if wait > 0:
        return SignIn(False, f"Too many failed sign-ins; try again in {wait / 60:.0f} min.")
    stored = operators.get(name)
    try:
        if stored is None:
            verify_password(password, _DUMMY)  # same cost: no user enumeration
            ok = False
        else:
            ok = verify_password(password, stored)
    except WeakHash as err:
        return SignIn(False, str(err))
    if not ok:
        throttle.failed(name)
        return SignIn(False, "Wrong operator name or password.")
    throttle.succeeded(name)
    return SignIn(True)


def session_expired(signed_in_at: float | None, now: float | None = None,
                    ttl_s: float = SESSION_TTL_S) -> bool:
    """Whether a session signed in at `signed_in_at` (time.time()) must sign in again."""
    if signed_in_at is None:
        return True
    return (time.time() if now is None else now) - signed_in_at > ttl_s


_DUMMY = hash_password("not a real password")
