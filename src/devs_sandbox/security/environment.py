"""The environment sanitizer: which host variables may reach a sandbox or a tool we run.

Two rules, and the deny rule always wins:
- allow: a short list of harmless names (locale, terminal, time zone) plus any
  configured extra names; everything else is dropped (an allow-list, because the
  set of credential names in the wild is open-ended);
- deny: anything that looks like a credential by name (TOKEN, SECRET, PASSWORD,
  API_KEY, ... anywhere in it; AWS_, GITHUB_, OPENAI_, ... prefixes) or by value
  (GitHub, OpenAI/Anthropic, Slack, AWS key shapes, PEM blocks), plus configured
  extra names.

``sanitize`` is pure: it reads the mapping it is given and returns a new dict;
it never touches ``os.environ`` (no swapping of the process environment, which
would race with every other thread).

# REQ: 5_SECURITY_DESIGN-REQ-SEC-STR-005
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

# Harmless in a sandbox: locale, terminal, time zone, colour preferences.
SANDBOX_ALLOW: Final = frozenset(
    {
        "LANG",
        "LANGUAGE",
        "LC_*",
        "TERM",
        "COLORTERM",
        "NO_COLOR",
        "TZ",
        "CLICOLOR",
        "COLUMNS",
        "LINES",
    }
)
# What the tools we run (docker, debootstrap, bwrap) may additionally need from the host.
TOOL_ALLOW: Final = SANDBOX_ALLOW | frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "TMPDIR",
        "XDG_RUNTIME_DIR",
        "DOCKER_HOST",
        "DOCKER_TLS_VERIFY",
        "DOCKER_CERT_PATH",
        "DOCKER_CONTEXT",
        "DOCKER_CONFIG",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "http_proxy",
        "https_proxy",
        "no_proxy",
    }
)
DENY_SUBSTRINGS: Final = (
    "TOKEN",
    "SECRET",
    "PASSWORD",
    "PASSWD",
    "CREDENTIAL",
    "API_KEY",
    "APIKEY",
    "PRIVATE_KEY",
    "ACCESS_KEY",
    "SESSION",
)
DENY_PREFIXES: Final = (
    "AWS_",
    "AZURE_",
    "GCP_",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GITHUB_",
    "GH_",
    "OPENAI_",
    "ANTHROPIC_",
    "HF_",
    "HUGGING_FACE_",
    "NPM_TOKEN",
    "DOCKER_AUTH",
    "SSH_AUTH_SOCK",
    "GPG_",
    "VAULT_",
)
# Shapes of well-known credentials, anywhere in a value.
DENY_VALUE_PATTERNS: Final = (
    re.compile(r"gh[pousr]_[A-Za-z0-9]{10,}"),  # GitHub tokens
    re.compile(r"github_pat_[A-Za-z0-9_]{10,}"),
    # No word boundaries: "0sk-..." or "xAKIA..." are still worth refusing; the only cost
    # is a harmless variable (LANG, TERM, ...) with such a value being dropped.
    re.compile(r"sk-[A-Za-z0-9_\-]{10,}"),  # OpenAI / Anthropic style keys
    re.compile(r"xox[abposr]-[A-Za-z0-9\-]{8,}"),  # Slack
    re.compile(r"(?:AKIA|ASIA)[A-Z0-9]{12,}"),  # AWS access key ids
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"-----BEGIN [A-Z ]+-----"),  # any PEM block
)


def _matches(name: str, patterns: Iterable[str]) -> bool:
    for p in patterns:
        if p.endswith("*"):
            if name.startswith(p[:-1]):
                return True
        elif name == p:
            return True
    return False


def looks_like_credential_name(name: str) -> bool:
    upper = name.upper()
    return any(s in upper for s in DENY_SUBSTRINGS) or upper.startswith(DENY_PREFIXES)


def looks_like_credential_value(value: str) -> bool:
    return any(p.search(value) for p in DENY_VALUE_PATTERNS)


@dataclass(frozen=True)
class EnvironmentSanitizer:
    """Filters a host environment; ``extra_allow``/``extra_deny`` take names or NAME* prefixes."""

    extra_allow: tuple[str, ...] = ()
    extra_deny: tuple[str, ...] = ()
    base_allow: frozenset[str] = field(default=SANDBOX_ALLOW)

    @classmethod
    def for_tools(
        cls, extra_allow: Iterable[str] = (), extra_deny: Iterable[str] = ()
    ) -> EnvironmentSanitizer:
        """The profile for external tools we run (docker, debootstrap): PATH, HOME, proxies."""
        return cls(tuple(extra_allow), tuple(extra_deny), TOOL_ALLOW)

    def allows(self, name: str, value: str) -> bool:
        """Would ``name=value`` pass? The deny rule wins over every allow.

        The allow test comes first only because it is the cheap one: most host variables
        fail it, and then no value needs scanning. A name that passes it still faces the
        whole deny rule.
        """
        if not name or "=" in name or "\0" in name or "\0" in value:
            return False
        if not (_matches(name, self.base_allow) or _matches(name, self.extra_allow)):
            return False
        if _matches(name, self.extra_deny) or looks_like_credential_name(name):
            return False
        return not looks_like_credential_value(value)

    def sanitize(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """A new dict with only the allowed variables of ``env`` (default: ``os.environ``)."""
        source = os.environ if env is None else env
        return {k: v for k, v in source.items() if self.allows(k, v)}

    def dropped(self, env: Mapping[str, str] | None = None) -> list[str]:
        """Names ``sanitize`` would drop (for ``doctor`` and debug logs; never the values)."""
        source = os.environ if env is None else env
        return sorted(k for k, v in source.items() if not self.allows(k, v))


def tool_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for an external tool we spawn: sanitized host env plus ``extra``."""
    env = EnvironmentSanitizer.for_tools().sanitize()
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    if extra:
        env.update(extra)
    return env
