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

An operators file that cannot be used is never an empty list of operators: it is
`Operators.broken`, which `clusterpulse-dashboard` refuses to start with and the
sign-in box shows; an entry that cannot be used is skipped naming its line, and the
others still sign in (see `load_operators`).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import date, datetime
from datetime import time as time_of_day
from pathlib import Path

from clusterpulse.agent.audit import RefusalSummary
from clusterpulse.agent.peeruid import is_loopback
from clusterpulse.agent.validate import read_toml, unknown_keys

log = logging.getLogger(__name__)

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


def _parse(stored: str) -> tuple[str, tuple[int, ...], bytes, bytes]:
    """(scheme, parameters, salt, digest) of a stored hash, its shape and ranges checked
    before anything runs on it (absurd parameters would exhaust memory or CPU).
    ValueError says what is wrong without quoting the value: it may be a password
    pasted where its hash belongs."""
    parts = stored.split("$")
    if parts[0] == "scrypt" and len(parts) == 6:
        params = _integers(parts[1:4], "scrypt parameters N$r$p")
        n, r, p = params
        if not (1 < n <= _MAX_N and n & (n - 1) == 0 and 1 <= r <= 32 and 1 <= p <= 16):
            raise ValueError("scrypt parameters out of range")
    elif parts[0] == "pbkdf2_sha256" and len(parts) == 4:
        params = _integers(parts[1:2], "pbkdf2_sha256 iterations")
        if not 1 <= params[0] <= 10_000_000:
            raise ValueError("pbkdf2 iterations out of range")
    else:
        raise ValueError("not a password hash (`clusterpulse-ctl hash-password` makes "
                         "one: scrypt$N$r$p$salt$digest)")
    try:
        salt, digest = bytes.fromhex(parts[-2]), bytes.fromhex(parts[-1])
    except ValueError:
        raise ValueError(f"malformed {parts[0]} hash: its salt and digest must be "
                         "hexadecimal") from None
    if not digest:
        raise ValueError(f"malformed {parts[0]} hash: no digest")
    return parts[0], params, salt, digest


def _integers(fields: list[str], what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in fields)
    except ValueError:
        raise ValueError(f"malformed hash: {what} must be integers") from None


def _strong(scheme: str, params: tuple[int, ...]) -> bool:
    """Whether a parsed hash's parameters meet the policy (see the module's text)."""
    if scheme == "scrypt":
        n, r, p = params
        return r >= SCRYPT_R and n * p >= SCRYPT_N * SCRYPT_P
    return params[0] >= PBKDF2_MIN_ITERATIONS


def _check(password: str, stored: str) -> tuple[bool, bool]:
    """(matches, meets the policy). Raises ValueError on a malformed entry."""
    scheme, params, salt, digest = _parse(stored)
    if scheme == "scrypt":
        n, r, p = params
        got = hashlib.scrypt(password.encode(), salt=salt, n=n, r=r, p=p, maxmem=_MAXMEM,
                             dklen=len(digest))
    else:
        got = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, params[0])
    return hmac.compare_digest(got, digest), _strong(scheme, params)


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
    password, from the parameters alone)."""
    out = []
    for name, stored in operators.items():
        try:
            ok = _strong(*_parse(stored)[:2])
        except ValueError:
            ok = False
        if not ok:
            out.append(name)
    return out


class OperatorsFileError(ValueError):
    """The operators file cannot be read or parsed; the text names it (and, for TOML
    syntax, the line)."""


@dataclass(frozen=True)
class Operators:
    """The operators who may sign in with a password (name -> hash), and what was
    wrong on the way. `skipped`: entries left out, each naming where (the file and
    line), the operator and why, never the value (it may be a password pasted by
    mistake); `weak`: entries kept though below the policy, so that their operator
    is told to have the hash re-created; `broken`: why the operators file gave no
    operator at all, naming no operator (the sign-in box shows it to anyone)."""

    hashes: dict[str, str] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()
    weak: tuple[str, ...] = ()
    broken: str | None = None

    @property
    def problems(self) -> tuple[str, ...]:
        return self.skipped + self.weak

    def refusal_note(self) -> str:
        """What a refused sign-in adds, so that an operator whose entry was left out
        is not only told "wrong password"; it names no operator (the box is anyone's)."""
        if self.broken:
            return " The operators file cannot be used (the dashboard's log says why)."
        n = len(self.skipped)
        if n:
            return (f" {n} operator entr{'y' if n == 1 else 'ies'} could not be used (the "
                    "dashboard's log says which and why).")
        return ""


def load_operators(file: Path | None, secrets_section: Mapping | None) -> Operators:
    """The operators from Streamlit secrets and/or the operators file (the file's win),
    read at each use so that an edited file takes effect.

    It used to return the secrets' operators alone, saying nothing, when the file could
    not be read or parsed: a typo left a dashboard nobody could sign in to, answering
    "Wrong operator name or password". Now a file that cannot be read or parsed, or
    whose entries are all unusable, is `broken` (TOML syntax errors name the line:
    TOML is not read line by line, a stray quote can swallow the lines after it); a
    bad entry among good ones is skipped and named with its line, an unknown table
    (`[operator]`) named with the close match."""
    hashes: dict[str, str] = {}
    skipped: list[str] = []
    weak: list[str] = []

    def take(entries: Mapping, where: Callable[[str], str]) -> int:
        kept = 0
        for name, value in entries.items():
            keep, why = _judge(value)
            if keep:
                hashes[str(name)] = value
                kept += 1
            if why:
                (weak if keep else skipped).append(
                    f"{where(str(name))}: operator {str(name)!r}"
                    f"{'' if keep else ' skipped'}: {why}")
        return kept

    if secrets_section:
        take(secrets_section, lambda _: "Streamlit secrets [operators]")
    broken = None
    if file is not None:
        where = f"operators file {file}"
        before = len(skipped)
        try:
            data = read_toml(file, "operators file", OperatorsFileError)
        except OperatorsFileError as err:
            data, broken = {}, str(err)
        unknown = unknown_keys(data, ("operators",))
        if unknown:
            skipped.append(f"{where}: {unknown}")
        table = data.get("operators", {})
        if not isinstance(table, dict):
            skipped.append(f"{where}: [operators] must be a table of name = \"hash\" "
                           f"lines, not {_kind(table)}")
            table = {}

        @functools.cache
        def text() -> str:  # read again only to name a problem's line
            try:
                return file.read_text()
            except (OSError, UnicodeDecodeError):
                return ""

        def at(name: str) -> str:
            line = _line_of(text(), name)
            return f"{where} line {line}" if line else where

        kept = take(table, at)
        if not kept and not broken and len(skipped) > before:
            n = len(skipped) - before
            broken = (f"{where} has no usable operator entry ({n} problem{'s' * (n > 1)}, "
                      "each logged with its line)")
    return Operators(hashes, tuple(skipped), tuple(weak), broken)


def file_identity(file: Path | None) -> tuple:
    """What tells an edited operators file from the one read before, without reading it:
    its inode, size and modification and change times (an editor that renames a new
    file over it changes the inode; one that rewrites it in place, the times). A file
    that cannot be stat'ed is its error, so that it is read (and reported) again."""
    if file is None:
        return ()
    try:
        st = os.stat(file)
    except OSError as err:
        return (str(file), "error", err.errno)
    return (str(file), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass
class OperatorsCache:
    """`load_operators`, read again only when the operators file (or the secrets'
    section) changed. Every page run checks its signed-in operator against the current
    entries (a removed operator kept acting for up to SESSION_TTL_S): one stat a run,
    not a TOML parse. Shared by every session of the dashboard process."""

    _key: tuple | None = None
    _ops: Operators | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def load(self, file: Path | None, secrets_section: Mapping | None) -> Operators:
        key = (file_identity(file),
               tuple(sorted((str(k), repr(v)) for k, v in (secrets_section or {}).items())))
        with self._lock:
            if key == self._key and self._ops is not None:
                return self._ops
        ops = load_operators(file, secrets_section)
        with self._lock:
            self._key, self._ops = key, ops
        return ops


def entry_fingerprint(stored: str) -> str:
    """A digest of an operator's stored hash, kept in the session at sign-in: a later
    entry that differs (the password changed, the account re-created) no longer
    matches it, and the session is signed out. The hash itself stays out of the
    session."""
    return hashlib.sha256(stored.encode()).hexdigest()


def _judge(value: object) -> tuple[bool, str | None]:
    """(kept, what is wrong) for an operators entry's value: one that can never sign
    anyone in is left out; a hash below the policy is kept, so that its operator is
    told to have it re-created (verify_password) rather than "wrong password"."""
    if not isinstance(value, str):
        hint = (' (each entry is name = "hash"; a name with a dot must be quoted)'
                if isinstance(value, Mapping) else "")
        return False, f"{_kind(value)}, not a hash string{hint}"
    try:
        scheme, params, _, _ = _parse(value)
    except ValueError as err:
        return False, str(err)
    if not _strong(scheme, params):
        return True, ("hash weaker than the policy: it signs no one in until it is "
                      "re-created with `clusterpulse-ctl hash-password`")
    return True, None


def _kind(value: object) -> str:
    """A TOML value's kind, for messages that must not quote the value itself."""
    kinds: list[tuple[type | tuple[type, ...], str]] = [
        (str, "a string"), (bool, "a boolean"), ((int, float), "a number"),
        (Mapping, "a table"), (list, "an array"),
        ((datetime, date, time_of_day), "a date or time")]
    return next((what for kind, what in kinds if isinstance(value, kind)), "a value")


_HEADER = re.compile(r"\s*\[\s*([^\]]*?)\s*\]")


def _line_of(text: str, name: str) -> int | None:
    """The line (from 1) of operator `name`'s entry in an operators file's `text`, for
    messages: its `name = ...` line under [operators] (the name quoted or not, or the
    first part of a dotted one), or an [operators.name] header. None where it is
    written some other way (an inline table)."""
    table = None
    for number, line in enumerate(text.splitlines(), 1):
        header = _HEADER.match(line)
        if header:
            table = header.group(1)
            parent, dot, child = table.partition(".")
            if dot and parent.strip() == "operators" and child.strip().strip("\"'") == name:
                return number
            continue
        key, eq, _ = line.partition("=")
        key = key.strip()
        quoted = key[:1] in ("'", '"')  # a quoted name may hold a dot; a bare one splits
        if table == "operators" and eq and name == (
                key.strip("\"'") if quoted else key.partition(".")[0].strip()):
            return number
    return None


@dataclass
class ProblemReport:
    """Logs what is wrong with the operators when it changes. The sign-in box reads
    them at every page run (every refresh): the journal should say each problem once,
    not every few seconds, and again if it comes back after a fix."""

    _last: tuple[str, ...] = ()
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def report(self, ops: Operators) -> None:
        now = (ops.broken or "", *ops.problems)
        with self._lock:
            if now == self._last:
                return
            self._last = now
        for problem in ops.problems:
            log.warning("%s", problem)
        if ops.broken:
            log.error("%s: its operators cannot sign in until it is fixed", ops.broken)


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
# the operators' problems, logged once each by the dashboard's pages
REPORTED = ProblemReport()
# the operators, read again when their file changes (every page run checks its operator)
OPERATORS = OperatorsCache()


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
