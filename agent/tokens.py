"""Bearer tokens, each naming the principal that holds it.

A token file holds one token per line, optionally preceded by the principal's name:

    dashboard   3f9c...   # the dashboard (acts for its signed-in operators)
    remediation 81aa...   # the Alertmanager policy
    2b7e...               # a bare token: principal "token"

A `#` starts a comment at the start of a line or after a space or tab; inside a token
it is part of the token.

Audit records name the principal a token belongs to, never a name the caller sends.
Give each client (and, for a fleet, each node) its own token so one leaked file
does not open every door and the audit log says who acted.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MIN_LENGTH = 16
_NAME = re.compile(r"^[A-Za-z0-9_.@:-]{1,64}$")
_COMMENT = re.compile(r"(?:^|\s)#")


class TokenError(ValueError):
    """The token file is unusable; the text names the line and the problem."""


@dataclass(frozen=True)
class Tokens:
    by_principal: dict[str, str]

    @classmethod
    def single(cls, token: str, principal: str = "token") -> Tokens:
        return cls({principal: token})

    def match(self, presented: str) -> str | None:
        """The principal holding `presented`, compared in constant time with every token."""
        found = None
        for principal, token in self.by_principal.items():
            if hmac.compare_digest(presented.encode(), token.encode()):
                found = principal
        return found

    @classmethod
    def parse(cls, text: str, source: str = "token file") -> Tokens:
        out: dict[str, str] = {}
        holder: dict[str, str] = {}  # token -> the principal first listed with it
        for n, line in enumerate(text.splitlines(), 1):
            line = without_comment(line)
            if not line:
                continue
            parts = line.split()
            if len(parts) == 1:
                name, token = "token", parts[0]
            elif len(parts) == 2 and _NAME.match(parts[0]):
                name, token = parts
            else:
                raise TokenError(f"{source}, line {n}: expected 'TOKEN' or 'PRINCIPAL TOKEN'")
            if len(token) < MIN_LENGTH:
                raise TokenError(f"{source}, line {n}: token shorter than {MIN_LENGTH} "
                                 "characters; use a random one (`openssl rand -hex 32`)")
            if name in out:
                raise TokenError(f"{source}, line {n}: principal {name!r} appears twice")
            # One token under two names: `match` gave it to the last, and the audit log
            # named that principal for what the other did. The token itself is never
            # printed (the error goes to logs and terminals).
            if token in holder:
                raise TokenError(f"{source}, line {n}: principal {name!r} has the same "
                                 f"token as {holder[token]!r}; give each its own")
            holder[token] = name
            out[name] = token
        if not out:
            raise TokenError(f"{source} holds no token")
        return cls(out)

    @classmethod
    def load(cls, path: Path) -> tuple[Tokens, bool]:
        """The tokens, and whether the file is readable by other users (warn)."""
        try:
            mode = path.stat().st_mode
            # utf-8-sig: a byte-order mark that some Windows editors write first is
            # not part of the token (kept, it made the first token never match).
            text = path.read_text(encoding="utf-8-sig")
        except OSError as err:
            raise TokenError(f"cannot read token file {path}: {err.strerror}") from None
        except UnicodeDecodeError as err:
            raise TokenError(f"token file {path} is not UTF-8 text: {err}") from None
        return cls.parse(text, str(path)), bool(mode & (stat.S_IRGRP | stat.S_IROTH))


def without_comment(line: str) -> str:
    """A token file's line without its comment, stripped: a `#` at the line's start
    or after a space or tab begins one; inside a token it is part of it (cut there, a
    token was refused, or a shorter secret accepted, without a word)."""
    return _COMMENT.split(line, 1)[0].strip()


def credentials(header: str | None, scheme: str) -> str | None:
    """What an `Authorization` header carries under `scheme` ("Bearer", "Basic"), or
    None when it names another scheme or none. The scheme is case-insensitive (RFC
    7235): `bearer <token>`, as some clients send it, was refused as no token."""
    name, _, value = (header or "").strip().partition(" ")
    return value.strip() if name.lower() == scheme.lower() else None


def write_secret(path: Path, text: str, replace: bool = True) -> bool:
    """Write a secret file that no other user can ever read: created 0600 by the
    `open` that makes it (O_EXCL, whatever the umask), never widened and tightened
    afterwards (`write_text` then `chmod` left a window in which another user read 5
    tokens of 5). `replace`: write a private temporary file beside it and rename it
    over the old one (readers see the old or the new secret, whole); else keep an
    existing file that only its owner can read. One that others could read may have
    been read (a 0644 token of an older demo was kept as it was): it is replaced, with
    a warning. True when it was written."""
    if not replace:
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(path, follow_symlinks=False)
            if st.st_uid == os.geteuid() and stat.S_ISREG(st.st_mode) \
                    and not stat.S_IMODE(st.st_mode) & 0o077:
                return False
            # another user's file (planted in a shared directory: its content is theirs)
            # or one others could read (and may have): a new secret replaces it
            log.warning("secret %s was %s: replaced with a new one (restart what reads it)",
                        path, "readable by other users" if st.st_uid == os.geteuid()
                        else f"owned by uid {st.st_uid}")
            replace = True
    if not replace:
        target, final = path, None
    else:
        target, final = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}"), path
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        if final is None:
            return False
        raise
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if final is not None:
            os.replace(target, final)
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    return True
