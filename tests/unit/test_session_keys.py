"""Session keys (generate, register, revoke with zeroing) and redaction across chunk boundaries."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devs_sandbox import SecretError
from devs_sandbox.security.session_keys import (
    Redactor,
    SessionKeyManager,
    session_key_manager,
    validate_secret_name,
)

pytestmark = pytest.mark.unit


def test_generate_key_is_16_fresh_csprng_bytes() -> None:
    keys = {bytes(SessionKeyManager.generate_key()) for _ in range(100)}
    assert len(keys) == 100
    k = SessionKeyManager.generate_key()
    assert isinstance(k, bytearray) and len(k) == 16


def test_register_twice_raises() -> None:
    m = SessionKeyManager()
    m.register_key("sb-1", m.generate_key())
    with pytest.raises(SecretError, match="already registered"):
        m.register_key("sb-1", m.generate_key())


def test_revoke_zeroes_in_place_and_logs_without_the_key(caplog: pytest.LogCaptureFixture) -> None:
    m = SessionKeyManager()
    key = m.generate_key()
    secret_hex = key.hex()
    m.register_key("sb-1", key)
    with caplog.at_level(logging.DEBUG, logger="devs_sandbox"):
        assert m.revoke_key("sb-1") is True
    assert key == bytearray(16)  # the very buffer was overwritten
    assert m.get_key("sb-1") is None and not m.has_key("sb-1")
    assert m.revoke_key("sb-1") is False
    record = next(r for r in caplog.records if "session_key_rotated" in r.getMessage())
    assert json.loads(record.getMessage()) == {"event": "session_key_rotated", "sandbox_id": "sb-1"}
    assert record.event == "session_key_rotated"  # type: ignore[attr-defined]
    assert secret_hex not in caplog.text


def test_process_scoped_instance_is_exported() -> None:
    from devs_sandbox import session_key_manager as exported

    assert exported is session_key_manager


@pytest.mark.parametrize("bad", ["", "1ABC", "A-B", "A B", "a" * 200])
def test_secret_names_are_validated(bad: str) -> None:
    with pytest.raises(SecretError):
        validate_secret_name(bad)


def test_redact_text_and_forms() -> None:
    r = Redactor({"API": b"s3cr3t-value\n", "SHORT": b"ab"})
    assert r.redact(b"x s3cr3t-value y") == b"x [REDACTED:API] y"
    assert r.redact_text("s3cr3t-value\nrest") == "[REDACTED:API]rest"
    assert r.redact(b"ab ab") == b"ab ab"  # too short to redact without shredding output
    assert not Redactor({}).active and Redactor({}).redact(b"x") == b"x"


def test_stream_passes_ordinary_output_through_at_once() -> None:
    s = Redactor({"K": b"0123456789abcdef"}).stream()
    assert s.feed(b"first line\n") == b"first line\n"
    assert s.feed(b"tail 0123") == b"tail "  # might be the start of the secret: held
    assert s.feed(b"x") == b"0123x"  # it was not
    assert s.flush() == b""


@settings(max_examples=300)
@given(
    prefix=st.binary(max_size=30),
    middle=st.binary(max_size=30),
    suffix=st.binary(max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8),
)
def test_stream_redaction_survives_any_chunking(
    prefix: bytes, middle: bytes, suffix: bytes, cuts: list[int]
) -> None:
    secret_a, secret_b = b"deadbeefcafef00d", b"correct horse battery"
    data = prefix + secret_a + middle + secret_b + suffix + secret_a
    r = Redactor({"A": secret_a, "B": secret_b})
    stream = r.stream()
    points = sorted({c % (len(data) + 1) for c in cuts})
    out = b""
    last = 0
    for p in [*points, len(data)]:
        out += stream.feed(data[last:p])
        last = p
    out += stream.flush()
    assert out == r.redact(data)
    assert secret_a not in out and secret_b not in out


def test_a_60_kib_secret_is_redacted_across_chunks_without_a_prefix_table() -> None:
    import os

    big = os.urandom(60 * 1024)
    r = Redactor({"BIG": big})
    assert not hasattr(r, "_prefixes")  # memory stays linear in the secret's length
    data = b"head " + big + b" tail " + big[: len(big) // 2]
    stream = r.stream()
    out = b"".join(stream.feed(data[i : i + 4096]) for i in range(0, len(data), 4096))
    out += stream.flush()
    assert out.startswith(b"head [REDACTED:BIG] tail ")
    assert big not in out
