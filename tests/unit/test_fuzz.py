"""Property-based fuzzing (Hypothesis) of every parser that faces untrusted input: the
telemetry decoder and the registry behind it, the control API's request handling, the
remediation webhook's payload handling, token and Content-Length parsing.

The property is always the same: whatever arrives, the parser either accepts it or
refuses it with its own named error; nothing else escapes, and what is kept stays
bounded. Bounded in time for CI: a small max_examples per test, no deadline (the
machines are noisy; a slow example is not a failure)."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clusterpulse.agent import protocol
from clusterpulse.agent.httpsafe import HttpError, content_length, parse_json_object
from clusterpulse.agent.identity import Sender
from clusterpulse.agent.ranks import MAX_ACKS_KEPT, RankRegistry, Refused
from clusterpulse.agent.tokens import TokenError, Tokens
from clusterpulse.dashboard.remediation import PayloadError, promql_string, validate_payload

FUZZ = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

json_scalars = (st.none() | st.booleans() | st.integers(min_value=-(10**30), max_value=10**30)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40))
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=4)
                           | st.dictionaries(st.text(max_size=12), c, max_size=4), max_leaves=20)
keys = st.sampled_from(sorted(protocol.INT_FIELDS | protocol.NUMBER_FIELDS | {
    "v", "type", "run", "phase", "event", "acks", "gpu_uuids", "other"}))
# Messages that are mostly well-formed, with any field possibly wrong: reaches deep
# into the validator instead of failing at the first check.
near_messages = st.fixed_dictionaries(
    {"v": st.just(1) | json_scalars, "type": st.sampled_from(["step", "heartbeat", "event"]),
     "run": st.just("r1") | st.text(max_size=8), "rank": st.integers(-2, 5) | json_scalars},
    optional={"loss": json_values, "step": json_values, "acks": json_values,
              "gpu_uuids": json_values, "event": st.sampled_from(sorted(protocol.EVENTS)),
              "phase": json_values, "step_seconds": json_values},
).flatmap(lambda m: st.dictionaries(keys, json_values, max_size=4).map(lambda x: {**x, **m}))


def _decode_or_named(data: bytes) -> dict | None:
    try:
        return protocol.decode(data)
    except protocol.MalformedMessage:
        return None


@FUZZ
@given(st.binary(max_size=protocol.MAX_DATAGRAM_BYTES + 10))
def test_decoder_never_raises_anything_else_on_bytes(data):
    _decode_or_named(data)


@FUZZ
@given(near_messages)
def test_decoded_messages_are_clean_and_the_registry_bounded(msg):
    data = json.dumps(msg, allow_nan=True).encode()
    out = _decode_or_named(data)
    if out is None:
        return
    assert set(out) <= (protocol.INT_FIELDS | protocol.NUMBER_FIELDS
                        | {"v", "type", "run", "phase", "event", "acks", "gpu_uuids"})
    for k in protocol.NUMBER_FIELDS & set(out):
        assert isinstance(out[k], float) and abs(out[k]) <= 1e18
    reg = RankRegistry(max_ranks=4)
    try:
        r = reg.update(out, None, Sender())
    except Refused:
        return
    assert r is not None and set(r.values) <= protocol.NUMBER_FIELDS
    assert len(r.acks) <= MAX_ACKS_KEPT


@settings(max_examples=20, deadline=None)
@given(st.text(max_size=6).map(lambda s: "[" * 3000 + s))
def test_deep_nesting_is_named(text):
    assert _decode_or_named(text.encode()) is None


@FUZZ
@given(st.text(max_size=30))
def test_content_length_is_a_bounded_non_negative_integer_or_refused(value):
    try:
        n = content_length({"Content-Length": value}, 1024)
    except HttpError as err:
        assert err.status in (400, 413)
        return
    assert 0 <= n <= 1024


@FUZZ
@given(st.binary(max_size=400) | json_values.map(lambda v: json.dumps(v).encode()))
def test_request_bodies_are_objects_or_named(body):
    try:
        out = parse_json_object(body)
    except HttpError as err:
        assert err.status == 400 and err.reason
        return
    assert isinstance(out, dict)


def test_control_api_handles_any_body(sim_agent):
    """The whole control API path (auth, routing, validation) on fuzzed bodies."""
    api_paths = st.sampled_from(["/v1/faults", "/v1/runs/r1/actions", "/v1/runs/../actions",
                                 "/v1/commands/x", "/v1/nowhere"])
    bodies = (st.fixed_dictionaries({}, optional={
        "action": st.sampled_from(sorted(protocol.ACTIONS)) | json_values,
        "reason": st.just("fuzz") | json_values, "deadline_s": json_values,
        "kind": st.sampled_from(["slow_clocks", "xid", "recover"]) | json_values,
        "gpu": json_values, "factor": json_values, "duration_s": json_values,
        "code": json_values, "requested_by": json_values})
        .map(lambda d: json.dumps(d, allow_nan=True).encode()) | st.binary(max_size=64))
    from clusterpulse.agent.control import ControlApi

    api = ControlApi(sim_agent.agent, "fuzz-token-0123456789")

    @FUZZ
    @given(api_paths, bodies)
    def run(path, body):
        status, payload = api.handle("POST", path, "Bearer fuzz-token-0123456789", body)
        assert 200 <= status < 500 and isinstance(payload, dict)
        if status >= 400:
            assert payload.get("error") or payload.get("detail")

    run()


labels = st.dictionaries(st.text(max_size=10), json_values, max_size=4)
alerts = st.fixed_dictionaries({}, optional={
    "status": st.sampled_from(["firing", "resolved"]) | json_values,
    "labels": labels.map(lambda d: {"alertname": "RankHung", **d}) | json_values,
    "startsAt": st.text(max_size=30) | json_values})


@FUZZ
@given(st.fixed_dictionaries({}, optional={"alerts": st.lists(alerts, max_size=4)
                                           | json_values}) | json_values)
def test_webhook_payloads_are_valid_or_named(payload):
    try:
        validate_payload(payload)
    except PayloadError as err:
        assert str(err)


@FUZZ
@given(st.text(max_size=60))
def test_promql_strings_cannot_close_the_literal(value):
    escaped = promql_string(value)
    # every double quote in the result is escaped by an odd run of backslashes
    i = 0
    while (i := escaped.find('"', i)) != -1:
        run_len = len(escaped[:i]) - len(escaped[:i].rstrip("\\"))
        assert run_len % 2 == 1
        i += 1
    assert "\n" not in escaped


@FUZZ
@given(st.text(max_size=200))
def test_token_files_parse_or_are_named(text):
    try:
        tokens = Tokens.parse(text)
    except TokenError as err:
        assert str(err)
        return
    assert tokens.by_principal and all(len(t) >= 16 for t in tokens.by_principal.values())
