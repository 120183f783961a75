"""Images a program left in its output directory: found, checked by content, bounded.

``run_code`` makes ``outputs/`` in the workspace, empty, before the program runs, and
gives the program its absolute path in ``$DEVS_SANDBOX_OUTPUT_DIR``. Afterwards
``collect_images`` looks at that directory only (not below it: a subdirectory is not
looked into) for entries named ``*.png``, ``*.jpg``/``*.jpeg``, ``*.gif``, ``*.webp``
and ``*.svg`` (case-insensitive), and returns the ones that are what their name says;
every other such entry is reported as skipped, with the reason, never dropped silently:

- a symbolic link is not followed (even to a file of the workspace), nor is anything
  that is not a regular file read;
- the type comes from the content (PNG, JPEG, GIF and WebP by their magic bytes, SVG as
  UTF-8 text whose root element is ``<svg``), and must be the one the name says;
- at most ``MAX_IMAGES`` images of at most ``MAX_IMAGE_BYTES`` each and
  ``MAX_IMAGES_TOTAL_BYTES`` together, taken in name order.

Reading goes through the file API (``lifecycle.files``): a listing and one read per
image, each a command inside the sandbox under its confinement (the resolved path must
stay in the workspace) and size cap. A sandbox that has ended (its total timeout fired,
it broke a quota, it was cancelled) runs nothing more, so nothing is read from it.
"""

from __future__ import annotations

import base64
import logging
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, Final

from devs_sandbox.errors import DevsSandboxError, SandboxFileError

if TYPE_CHECKING:
    from devs_sandbox.lifecycle import Sandbox

logger = logging.getLogger(__name__)

MiB: Final = 1 << 20
OUTPUT_DIR: Final = "outputs"  # in the workspace; where a program leaves files (plots)
OUTPUT_DIR_ENV: Final = "DEVS_SANDBOX_OUTPUT_DIR"  # its absolute path, for the program
# A plot is tens to hundreds of KiB; a model API refuses an image over about 5 MB, and
# every image is base64 in the answer (4/3 of its size) that the host holds in memory.
MAX_IMAGE_BYTES: Final = 2 * MiB
# What one answer carries in images at most (about 11 MB of base64 JSON).
MAX_IMAGES_TOTAL_BYTES: Final = 8 * MiB
# Each image costs the model's context; a program that writes hundreds is not plotting.
MAX_IMAGES: Final = 16

MIME_BY_SUFFIX: Final[dict[str, str]] = {
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".gif": "image/gif",
    ".webp": "image/webp",
    ".svg": "image/svg+xml",
}
_PROLOG: Final = re.compile(
    r"\s+|<\?.*?\?>|<!--.*?-->|<!DOCTYPE[^\[>]*>",  # whitespace, <?xml?>, comments, DOCTYPE
    re.DOTALL | re.IGNORECASE,
)
_SVG_ROOT: Final = re.compile(r"<svg[\s/>]")


def image_type(data: bytes) -> str | None:
    """The MIME type ``data`` is by its content (PNG, JPEG, GIF, WebP, SVG), or None.

    SVG is UTF-8 text (a BOM allowed) whose first element, after an XML declaration,
    comments and a DOCTYPE, is ``<svg``; a DOCTYPE with an internal subset (entity
    definitions, what entity-expansion bombs are made of) is not accepted."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if b"\0" in data:
        return None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None
    pos = 0
    while match := _PROLOG.match(text, pos):
        pos = match.end()
    return "image/svg+xml" if _SVG_ROOT.match(text, pos) else None


@dataclass(frozen=True, slots=True)
class OutputImage:
    """One image a program left: its file name (in the output directory), its type (by
    content) and its bytes."""

    name: str
    mime_type: str
    data: bytes = field(repr=False)

    @property
    def size_bytes(self) -> int:
        return len(self.data)

    def base64(self) -> str:
        return base64.b64encode(self.data).decode("ascii")

    def to_json(self) -> dict[str, Any]:
        """Its listing (the bytes go elsewhere: MCP image content, a file on the host)."""
        return {"name": self.name, "mime_type": self.mime_type, "size_bytes": self.size_bytes}


@dataclass(frozen=True, slots=True)
class SkippedImage:
    """A file named as an image that was not returned, and why."""

    name: str
    reason: str
    size_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "reason": self.reason, "size_bytes": self.size_bytes}


@dataclass(frozen=True, slots=True)
class OutputImages:
    """What ``collect_images`` found: the images, and the files skipped with reasons."""

    images: tuple[OutputImage, ...] = ()
    skipped: tuple[SkippedImage, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.images or self.skipped)

    def to_json(self) -> dict[str, Any]:
        return {
            "images": [i.to_json() for i in self.images],
            "skipped_images": [s.to_json() for s in self.skipped],
        }


def _ended(sandbox: Sandbox) -> str | None:
    if sandbox.destroyed:
        return "destroyed"
    if sandbox.cancelled:
        return "cancelled"
    if sandbox.timed_out:
        return "timed out"
    if sandbox.violation is not None:
        return "stopped for a quota"
    return None


def collect_images(sandbox: Sandbox, directory: str = OUTPUT_DIR) -> OutputImages:
    """The images in ``directory`` of the workspace (see the module's docstring); an empty
    answer when the sandbox has ended or the directory cannot be listed (the program
    removed it, or made it a link out of the workspace)."""
    ended = _ended(sandbox)
    if ended is not None:
        logger.debug("sandbox %s %s: its %s/ is not read", sandbox.id, ended, directory)
        return OutputImages()
    try:
        entries = sandbox.list_files(directory)
    except DevsSandboxError as exc:
        logger.debug("sandbox %s: %s/ not listed: %s", sandbox.id, directory, exc)
        return OutputImages()
    images: list[OutputImage] = []
    skipped: list[SkippedImage] = []
    total = 0
    gone: str | None = None  # why nothing more can be read (the sandbox ended meanwhile)
    for entry in entries:
        expected = MIME_BY_SUFFIX.get(PurePosixPath(entry.name).suffix.lower())
        if expected is None:
            continue  # not named as an image: not ours to judge
        name, size = entry.name, entry.size_bytes

        def skip(reason: str, name: str = name, size: int = size) -> None:
            skipped.append(SkippedImage(_printable(name), reason, size))

        if entry.kind == "symlink":
            skip("a symbolic link: not followed")
        elif entry.kind != "file":
            skip(f"not a regular file (a {entry.kind})")
        elif _printable(name) != name:
            skip("its name is not UTF-8")
        elif len(images) >= MAX_IMAGES:
            skip(f"more than {MAX_IMAGES} images")
        elif size > MAX_IMAGE_BYTES:
            skip(f"larger than {MAX_IMAGE_BYTES} bytes (the limit for one image)")
        elif total + size > MAX_IMAGES_TOTAL_BYTES:
            skip(f"over the {MAX_IMAGES_TOTAL_BYTES} bytes all images may take together")
        elif gone is not None:
            skip(gone)
        else:
            try:
                data = sandbox.read_file(f"{directory}/{name}", max_bytes=MAX_IMAGE_BYTES)
            except SandboxFileError as exc:
                skip(f"not read: {str(exc).removeprefix(f'{directory}/{name}: ')}")
                continue
            except DevsSandboxError as exc:  # the sandbox ended while we read
                gone = f"not read: {exc}"
                skip(gone)
                continue
            actual = image_type(data)
            if actual is None:
                skip(f"its content is not an image of a supported type ({expected} by name)")
            elif actual != expected:
                skip(f"its content is {actual}, not the {expected} its name says")
            elif total + len(data) > MAX_IMAGES_TOTAL_BYTES:  # it grew since the listing
                skip(f"over the {MAX_IMAGES_TOTAL_BYTES} bytes all images may take together")
            else:
                images.append(OutputImage(name, actual, data))
                total += len(data)
    return OutputImages(tuple(images), tuple(skipped))


def _printable(name: str) -> str:
    """``name`` as valid UTF-8 text (a listing keeps undecodable bytes as surrogates)."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
