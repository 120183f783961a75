"""Session keys and user secrets: generated, delivered, redacted, revoked.

Invariants:
- a secret never travels in argv (world-readable in /proc/<pid>/cmdline), never in
  a process environment (/proc/<pid>/environ, ``docker inspect``), never in a log
  line or the store. It reaches the sandbox as a file, mode 0400, whose path is in
  ``NAME_FILE``: created from a pipe inside the sandbox's private tmpfs by bwrap
  where available (the host filesystem never holds it), else in the workspace's
  tmpfs; gone at destroy;
- whatever a task prints of a secret is replaced by ``[REDACTED:NAME]`` before it is
  captured, streamed, returned or recorded, also when the secret straddles two
  reads of the stream;
- ``revoke_key`` overwrites the key's buffer with zeros before dropping it.

Zeroing in a managed runtime is best effort: the interpreter may have copied the
bytes (a hex string for the file, a compiled pattern for redaction, a pipe
buffer in the kernel) where we cannot reach them. It shortens the key's life in
memory; it does not guarantee erasure.

# REQ: 5_SECURITY_DESIGN-REQ-SEC-STR-005
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import threading
from collections.abc import Iterable, Mapping
from typing import Final

from devs_sandbox.errors import SecretError

logger = logging.getLogger(__name__)

SESSION_KEY_NAME: Final = "DEVS_SESSION_KEY"
SESSION_KEY_BYTES: Final = 16
# Drivers may write a secret into a pipe before its reader starts: stay under 64 KiB.
MAX_SECRET_BYTES: Final = 60 * 1024
MIN_REDACT_LEN: Final = 4  # shorter "secrets" would shred ordinary output
SECRET_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


def validate_secret_name(name: str) -> str:
    if not SECRET_NAME.fullmatch(name):
        raise SecretError(
            f"invalid secret name {name!r}: use letters, digits and '_', not starting with a digit"
        )
    return name


def validate_secrets(secrets: Mapping[str, bytes | bytearray] | None) -> None:
    """What every driver checks before it accepts secrets: names and sizes."""
    for name, value in (secrets or {}).items():
        validate_secret_name(name)
        if len(value) > MAX_SECRET_BYTES:
            raise SecretError(f"secret {name} is larger than {MAX_SECRET_BYTES} bytes")


def wipe(buffers: Iterable[bytearray]) -> None:
    """Overwrite each buffer with zeros in place (best effort: see the module docstring)."""
    for buf in buffers:
        buf[:] = bytes(len(buf))


class SessionKeyManager:
    """Process-scoped registry of one key per sandbox."""

    def __init__(self) -> None:
        self._keys: dict[str, bytearray] = {}
        self._lock = threading.Lock()

    @staticmethod
    def generate_key() -> bytearray:
        """16 bytes from the OS CSPRNG, in a buffer that ``revoke_key`` can overwrite."""
        return bytearray(secrets.token_bytes(SESSION_KEY_BYTES))

    def register_key(self, sandbox_id: str, key: bytearray) -> None:
        with self._lock:
            if sandbox_id in self._keys:
                raise SecretError(f"a session key is already registered for sandbox {sandbox_id}")
            self._keys[sandbox_id] = key

    def get_key(self, sandbox_id: str) -> bytearray | None:
        with self._lock:
            return self._keys.get(sandbox_id)

    def has_key(self, sandbox_id: str) -> bool:
        with self._lock:
            return sandbox_id in self._keys

    def revoke_key(self, sandbox_id: str) -> bool:
        """Zero the key in place, forget it, log the rotation; False if there was none."""
        with self._lock:
            key = self._keys.pop(sandbox_id, None)
        if key is None:
            return False
        wipe([key])
        logger.info(
            json.dumps({"event": "session_key_rotated", "sandbox_id": sandbox_id}),
            extra={"event": "session_key_rotated", "sandbox_id": sandbox_id},
        )
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)


session_key_manager = SessionKeyManager()


class Redactor:
    """Replaces secret values with ``[REDACTED:NAME]`` in text and in byte streams."""

    def __init__(self, secrets_by_name: Mapping[str, bytes | bytearray]) -> None:
        needles: dict[bytes, bytes] = {}
        for name, value in secrets_by_name.items():
            for form in _forms(bytes(value)):
                if len(form) >= MIN_REDACT_LEN:
                    needles.setdefault(form, f"[REDACTED:{name}]".encode())
        # Longest first, so a secret that contains another is replaced whole.
        ordered = sorted(needles, key=len, reverse=True)
        self._replacements = needles
        self._pattern: re.Pattern[bytes] | None = (
            re.compile(b"|".join(re.escape(n) for n in ordered)) if ordered else None
        )
        self.max_len = max((len(n) for n in ordered), default=0)
        self._needles = ordered

    @property
    def active(self) -> bool:
        return self._pattern is not None

    def redact(self, data: bytes) -> bytes:
        if self._pattern is None:
            return data
        return self._pattern.sub(lambda m: self._replacements[m.group(0)], data)

    def redact_text(self, text: str) -> str:
        if self._pattern is None:
            return text
        return self.redact(text.encode("utf-8", "surrogateescape")).decode(
            "utf-8", "surrogateescape"
        )

    def stream(self) -> StreamRedactor:
        return StreamRedactor(self)

    def partial_tail(self, data: bytes, start: int) -> int:
        """Length of the longest suffix of ``data[start:]`` that is a proper prefix of a
        secret (what must wait for the next chunk). Candidates are the positions of each
        secret's first byte near the end, so the cost follows the data, not the square of
        a long secret's length."""
        best = 0
        for needle in self._needles:
            lo = max(start, len(data) - (len(needle) - 1))
            first = needle[0]
            j = data.find(first, lo)
            while j != -1:
                tail_len = len(data) - j
                if tail_len <= best:
                    break  # later positions give shorter tails
                if needle.startswith(data[j:]):
                    best = tail_len
                    break
                j = data.find(first, j + 1)
        return best


class StreamRedactor:
    """Redacts a byte stream fed in arbitrary chunks.

    Complete secrets are replaced at once; a chunk that ends with the beginning of a
    secret keeps just that beginning back until the next chunk (or ``flush``) says
    whether the secret follows. Anything else passes through immediately, so the
    stream stays live: a short line is never held waiting for more output.
    """

    def __init__(self, redactor: Redactor) -> None:
        self._r = redactor
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        pattern = self._r._pattern
        if pattern is None:
            return chunk
        data = self._pending + chunk
        out = bytearray()
        i = 0
        for m in pattern.finditer(data):
            out += data[i : m.start()]
            out += self._r._replacements[m.group(0)]
            i = m.end()
        keep = len(data) - self._r.partial_tail(data, i)
        out += data[i:keep]
        self._pending = data[keep:]
        return bytes(out)

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return self._r.redact(rest)


def _forms(value: bytes) -> Iterable[bytes]:
    """The shapes a secret is likely to be printed in: as given, and without the
    trailing newline a file usually adds."""
    yield value
    stripped = value.strip()
    if stripped != value:
        yield stripped
