"""Operators: the password hash policy, sign-in throttling, session expiry, and what
viewers see of refused sign-ins."""

import hashlib
import json
from pathlib import Path

import pytest

from clusterpulse.dashboard import auth

REPO = Path(__file__).resolve().parents[2]


def pbkdf2(password: str, iterations: int) -> str:
    salt = b"0123456789abcdef"
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    return f"pbkdf2_sha256${iterations}${salt.hex()}${digest.hex()}"


def test_new_hashes_are_scrypt_and_verify():
    stored = auth.hash_password("correct horse")
    assert stored.startswith(f"scrypt${auth.SCRYPT_N}$")
    assert auth.verify_password("correct horse", stored)
    assert not auth.verify_password("wrong", stored)
    assert auth.weak_entries({"a": stored}) == []


@pytest.mark.parametrize("iterations", [1, 200_000])
def test_stored_hashes_below_the_policy_never_verify(iterations):
    """Finding: the stored iteration count was trusted (a 1-iteration hash verified),
    and new hashes used 200k PBKDF2 iterations (OWASP: 600k)."""
    stored = pbkdf2("pw", iterations)
    with pytest.raises(auth.WeakHash, match="clusterpulse-ctl hash-password"):
        auth.verify_password("pw", stored)
    assert not auth.verify_password("other", stored)
    result = auth.authenticate("ops", "pw", {"ops": stored}, auth.Throttle())
    assert not result.ok and "weaker than the policy" in result.message
    assert auth.weak_entries({"ops": stored}) == ["ops"]
    weak_scrypt = "scrypt$2$1$1$00$" + hashlib.scrypt(b"pw", salt=b"\0", n=2, r=1, p=1).hex()
    with pytest.raises(auth.WeakHash):
        auth.verify_password("pw", weak_scrypt)


def test_pbkdf2_at_the_policy_is_still_accepted():
    assert auth.verify_password("pw", pbkdf2("pw", auth.PBKDF2_MIN_ITERATIONS))


def test_absurd_stored_parameters_are_refused_not_run():
    assert not auth.verify_password("pw", "scrypt$1073741824$8$1$00$00")
    assert not auth.verify_password("pw", "pbkdf2_sha256$999999999999$00$00")


def test_failed_sign_ins_are_throttled():
    """Finding: no sign-in throttling."""
    now = [0.0]
    throttle = auth.Throttle(per_name=3, overall=100, window_s=600, clock=lambda: now[0])
    ops = {"ops": auth.hash_password("right")}
    for _ in range(3):
        assert auth.authenticate("ops", "wrong", ops, throttle).message.startswith("Wrong")
    locked = auth.authenticate("ops", "right", ops, throttle)
    assert not locked.ok and "Too many failed sign-ins" in locked.message
    now[0] = 601.0
    assert auth.authenticate("ops", "right", ops, throttle).ok


def test_sessions_expire():
    """Finding: sessions never expired."""
    assert not auth.session_expired(1000.0, now=1000.0 + auth.SESSION_TTL_S - 1)
    assert auth.session_expired(1000.0, now=1000.0 + auth.SESSION_TTL_S + 1)
    assert auth.session_expired(None)


def test_viewers_see_nothing_of_refused_sign_ins(tmp_path, monkeypatch):
    """Finding: refused sign-in names (perhaps a mistyped password) were shown to viewers."""
    from streamlit.testing.v1 import AppTest

    log = tmp_path / "audit.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in [
        {"ts": 1.0, "who": "hunter2-typed-as-name", "action": "sign-in", "why": "dashboard",
         "outcome": "refused"},
        {"ts": 2.0, "who": "unauthenticated", "action": "authenticate", "why": "wrong token",
         "outcome": "refused", "client": "10.0.0.9"},
        {"ts": 3.0, "who": "token", "action": "restart", "why": "hung", "outcome": "delivered"},
    ]) + "\n")
    monkeypatch.setenv("CLUSTERPULSE_AUDIT_LOG", str(log))
    at = AppTest.from_file(str(REPO / "dashboard" / "pages" / "audit.py"), default_timeout=60)
    at.run()
    assert not at.exception
    shown = at.dataframe[0].value
    assert list(shown["action"]) == ["restart"]


@pytest.mark.parametrize("refresh", ["0", "-2", "nan", "inf"])
def test_dashboard_refuses_a_refresh_that_would_freeze_its_pages(refresh, capsys):
    """--refresh 0 made every live view (and a page waiting for Prometheus) still."""
    from clusterpulse.dashboard import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--refresh", refresh])
    assert exit_.value.code == 2
    assert "--refresh must be a number of seconds > 0" in capsys.readouterr().err
