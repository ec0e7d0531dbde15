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
re-created. Sign-ins are throttled per client address, never per account (see
`Throttle`), and a signed-in session expires (see `SESSION_TTL_S`).
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

from clusterpulse.agent.audit import RefusalSummary
from clusterpulse.agent.peeruid import is_loopback

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


def bcrypt_hash(password: str) -> str:
    """A bcrypt hash for Alertmanager's web config (`basic_auth_users`: Alertmanager
    accepts bcrypt only). Cost 10, Prometheus' own example; checked per API request."""
    import bcrypt  # the dashboard extra; only this and the local stack need it

    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(10)).decode()


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


def client_of(ip: object) -> str:
    """The client a sign-in counts against: its address, and every loopback address
    (Streamlit gives None for 127.0.0.1 and ::1 only) one `localhost`: a local user
    may connect from any of 127/8's addresses, and 40 guesses from 40 of them were 40
    clients, each checked and audited, none throttled."""
    return ip if isinstance(ip, str) and ip and not is_loopback(ip) else "localhost"


@dataclass
class Throttle:
    """Sign-in attempts per client (the connection's address): at most `per_client`
    failed or in-flight attempts within `window_s`, then that client waits. Accounts
    are never locked: a name that others guess at still signs in from elsewhere (5
    anonymous wrong passwords used to lock out the real admin, 50 every operator).
    An attempt is counted when it starts, under the lock, before the slow password
    check: concurrent tries cannot slip past the cap (7 did). Shared by every session
    of the dashboard process."""

    per_client: int = 5
    window_s: float = 900.0
    max_clients: int = 10_000
    clock: Callable[[], float] = time.monotonic
    _tries: dict[str, list[float]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _recent(self, client: str, now: float) -> list[float]:
        kept = [t for t in self._tries.get(client, []) if now - t < self.window_s]
        if kept:
            self._tries[client] = kept
        else:
            self._tries.pop(client, None)
        return kept

    def begin(self, client: str) -> tuple[float, float]:
        """(seconds the client must wait first, 0 when it may try now; the attempt's
        mark, to `release` if it succeeds)."""
        now = self.clock()
        with self._lock:
            recent = self._recent(client, now)
            if len(recent) >= self.per_client:
                return recent[0] + self.window_s - now, now
            if client not in self._tries and len(self._tries) >= self.max_clients:
                for other in list(self._tries):  # bounded whatever addresses come
                    self._recent(other, now)
                if len(self._tries) >= self.max_clients:
                    self._tries.pop(next(iter(self._tries)))
            self._tries.setdefault(client, []).append(now)
            return 0.0, now

    def release(self, client: str, mark: float) -> None:
        """A successful attempt does not count against its client."""
        with self._lock:
            tries = self._tries.get(client, [])
            if mark in tries:
                tries.remove(mark)


@dataclass(frozen=True)
class SignIn:
    ok: bool
    message: str = ""


THROTTLE = Throttle()
# refused sign-ins: one audit line per client per minute (docs/security.md)
REFUSALS = RefusalSummary()


def authenticate(name: str, password: str, operators: dict[str, str],
                 throttle: Throttle | None = None, client: str = "localhost") -> SignIn:
    """Check a sign-in from `client` (the connection's address); the message is safe
    to show (no user enumeration)."""
    throttle = throttle or THROTTLE
    wait, mark = throttle.begin(client)
    if wait > 0:
        return SignIn(False, "Too many failed sign-ins from your address; try again in "
                             f"{max(1, round(wait / 60))} min.")
    stored = operators.get(name)
    try:
        if stored is None:
            verify_password(password, _DUMMY)  # same cost: no user enumeration
            ok = False
        else:
            ok = verify_password(password, stored)
    except WeakHash as err:
        throttle.release(client, mark)  # the right password: not a guess
        return SignIn(False, str(err))
    if not ok:
        return SignIn(False, "Wrong operator name or password.")
    throttle.release(client, mark)
    return SignIn(True)


def session_expired(signed_in_at: float | None, now: float | None = None,
                    ttl_s: float = SESSION_TTL_S) -> bool:
    """Whether a session signed in at `signed_in_at` (time.time()) must sign in again."""
    if signed_in_at is None:
        return True
    return (time.time() if now is None else now) - signed_in_at > ttl_s


_DUMMY = hash_password("not a real password")
