"""--memory and other sizes mean what `docker run -m` means: k, m, g are binary multiples."""

from __future__ import annotations

import argparse

import pytest

from devs_sandbox.cli.parser import parse_size

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("64m", 64 << 20),
        ("64M", 64 << 20),
        ("1g", 1 << 30),
        ("512k", 512 << 10),
        ("10MB", 10 << 20),
        ("1GiB", 1 << 30),
        ("1.5g", 3 << 29),
        ("1024", 1024),
        ("2t", 2 << 40),
    ],
)
def test_sizes_are_binary_like_docker(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "m", "abc", "12x", "inf", "nan", "1e400", "0", "-1m"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)
