"""What counts as an image of run_code's outputs/: the content decides, not the name."""

from __future__ import annotations

import pytest

from devs_sandbox.tools.outputs import MIME_BY_SUFFIX, OutputImage, OutputImages, image_type

PNG = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR"


@pytest.mark.parametrize(
    ("data", "mime"),
    [
        (PNG, "image/png"),
        (b"\xff\xd8\xff\xe0\0\x10JFIF", "image/jpeg"),
        (b"GIF89a\x01\0\x01\0", "image/gif"),
        (b"GIF87a\x01\0\x01\0", "image/gif"),
        (b"RIFF\x24\0\0\0WEBPVP8 ", "image/webp"),
        (b'<svg xmlns="http://www.w3.org/2000/svg"/>', "image/svg+xml"),
        (b"\xef\xbb\xbf  <?xml version='1.0'?><!-- c --><!DOCTYPE svg>\n<svg>", "image/svg+xml"),
        (b"<svg\n width='1'></svg>", "image/svg+xml"),
    ],
)
def test_known_types_by_content(data: bytes, mime: str) -> None:
    assert image_type(data) == mime
    assert mime in MIME_BY_SUFFIX.values()


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"PNG but not really",
        b"\x89PNG\r\n",  # a signature cut short
        b"RIFF\x24\0\0\0WAVEfmt ",  # RIFF, but audio
        b"<html><svg/></html>",  # svg, but not the root
        b"<svgfoo/>",
        b"<!DOCTYPE svg [<!ENTITY a 'b'>]><svg/>",  # entity definitions: refused
        b"<svg\0/>",
        b"\xff\xfe<\0s\0v\0g\0",  # UTF-16: not what we read
    ],
)
def test_other_content_is_no_image(data: bytes) -> None:
    assert image_type(data) is None


def test_the_listing_carries_no_bytes() -> None:
    found = OutputImages((OutputImage("a.png", "image/png", PNG),))
    assert bool(found) and not OutputImages()
    assert found.to_json() == {
        "images": [{"name": "a.png", "mime_type": "image/png", "size_bytes": len(PNG)}],
        "skipped_images": [],
    }
