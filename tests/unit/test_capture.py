"""Head-and-tail capture keeps at most the cap, whatever the stream's length."""

from __future__ import annotations

import pytest

from devs_sandbox.capture import HeadTailCapture

pytestmark = pytest.mark.unit


def test_small_output_is_kept_whole() -> None:
    c = HeadTailCapture(100)
    c.feed(b"hello ")
    c.feed(b"world")
    r = c.result()
    assert r.text == "hello world"
    assert not r.truncated and r.dropped_bytes == 0 and r.total_bytes == 11


def test_head_and_tail_survive_and_the_middle_is_counted() -> None:
    c = HeadTailCapture(10)
    c.feed(b"HEAD-")
    for _ in range(1000):
        c.feed(b"m" * 7)
    c.feed(b"-TAIL")
    r = c.result()
    assert r.truncated
    assert r.total_bytes == 5 + 7000 + 5
    assert r.dropped_bytes == r.total_bytes - 10
    assert r.text.startswith("HEAD-")
    assert r.text.endswith("-TAIL")
    assert f"{r.dropped_bytes} bytes dropped" in r.text


def test_memory_stays_bounded_for_large_chunks() -> None:
    c = HeadTailCapture(1024)
    for _ in range(64):
        c.feed(b"x" * (1 << 20))
    assert len(c._head) + len(c._tail) == 1024
    assert c.dropped_bytes == 64 * (1 << 20) - 1024


def test_invalid_utf8_is_replaced_not_fatal() -> None:
    c = HeadTailCapture(64)
    c.feed(b"\xff\xfeok")
    assert c.result().text.endswith("ok")


def test_transform_applies_to_kept_text() -> None:
    c = HeadTailCapture(64)
    c.feed(b"secret")
    assert c.result(lambda s: s.replace("secret", "***")).text == "***"
