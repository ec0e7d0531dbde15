"""The dashboard's operator session is checked against the operators file at every page
run: a review found an operator removed from the file (or whose password changed) kept
acting for up to 8 hours, the session trusting its own "operator"."""

from __future__ import annotations

import os

import pytest
from streamlit.testing.v1 import AppTest

from clusterpulse.dashboard import auth


def page() -> None:
    """A page that shows who may act, as the dashboard's pages ask (ui.operator)."""
    import streamlit as st

    from clusterpulse.dashboard import ui

    st.markdown(f"WHO={ui.operator()}")


def who(at: AppTest) -> list[str]:
    return [m.value for m in at.markdown if m.value.startswith("WHO=")]


@pytest.fixture
def signed_in(tmp_path, monkeypatch):
    """alice signed in; the operators file and the AppTest."""
    ops = tmp_path / "operators.toml"
    ops.write_text(f'[operators]\nalice = "{auth.hash_password("correct horse 1")}"\n')
    monkeypatch.setenv("CLUSTERPULSE_OPERATORS_FILE", str(ops))
    monkeypatch.setenv("CLUSTERPULSE_AUDIT_LOG", str(tmp_path / "audit.jsonl"))
    at = AppTest.from_function(page, default_timeout=30).run()
    at.text_input(key="login_name").input("alice")
    at.text_input(key="login_password").input("correct horse 1")
    at.button[0].click().run()
    assert who(at) == ["WHO=alice"], who(at)
    return ops, at


def rewrite(path, text: str) -> None:
    """Write the file as an administrator's editor would; its mtime moves on even where
    the clock's tick is coarse (the same size is likely: one name for another)."""
    before = path.stat().st_mtime_ns
    path.write_text(text)
    if path.stat().st_mtime_ns == before:
        os.utime(path, ns=(before + 1_000_000, before + 1_000_000))


def test_a_removed_operator_is_signed_out_at_the_next_run(signed_in):
    ops, at = signed_in
    rewrite(ops, f'[operators]\nbob = "{auth.hash_password("battery staple 2")}"\n')
    at.run()
    assert who(at) == ["WHO=None"]
    assert any("no longer an operator" in w.value for w in at.warning), at.warning
    at.run()  # and stays out: the sign-in box again
    assert who(at) == ["WHO=None"] and at.text_input(key="login_name")


def test_a_changed_password_signs_the_session_out(signed_in):
    ops, at = signed_in
    rewrite(ops, f'[operators]\nalice = "{auth.hash_password("new horse 3")}"\n')
    at.run()
    assert who(at) == ["WHO=None"]
    assert any("password of operator alice was changed" in w.value for w in at.warning)


def test_an_unchanged_file_keeps_the_session_and_is_not_read_again(signed_in, monkeypatch):
    _, at = signed_in
    reads = []
    monkeypatch.setattr(auth, "load_operators",
                        lambda *a: reads.append(a) or pytest.fail("read again"))
    at.run()
    at.run()
    assert who(at) == ["WHO=alice"] and not reads


def test_an_operators_file_that_cannot_be_parsed_keeps_the_sessions(signed_in):
    """Found in review: one syntax error in the operators file (an entry being added,
    or a page run reading it mid-rewrite) read as no operators, so every session was
    signed out as "removed by an administrator", and stayed out once it was fixed. Only
    a file read whole says an entry is gone; a broken one keeps the sessions as they
    are, and the page says the file cannot be read."""
    ops, at = signed_in
    alice = ops.read_text()
    rewrite(ops, alice + 'bob = "oops\n')  # a missing closing quote
    at.run()
    assert who(at) == ["WHO=alice"], who(at)
    assert not any("no longer an operator" in w.value for w in at.warning), at.warning
    assert any(w.value.startswith("The operators file cannot be read: ")
               and "Sessions are kept" in w.value for w in at.warning), at.warning
    rewrite(ops, alice)  # fixed
    at.run()
    assert who(at) == ["WHO=alice"] and not at.warning, at.warning
    rewrite(ops, "")  # read whole, alice is gone: signed out
    at.run()
    assert who(at) == ["WHO=None"]
    assert any("no longer an operator" in w.value for w in at.warning), at.warning
