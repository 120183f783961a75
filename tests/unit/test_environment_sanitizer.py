"""Property tests of the environment sanitizer: no credential gets through, harmless ones do."""

from __future__ import annotations

import os
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devs_sandbox.security.environment import (
    DENY_PREFIXES,
    DENY_SUBSTRINGS,
    SANDBOX_ALLOW,
    EnvironmentSanitizer,
    looks_like_credential_name,
    tool_environment,
)

pytestmark = pytest.mark.unit

NAME_CHARS = string.ascii_uppercase + string.digits + "_"
names = st.text(NAME_CHARS, min_size=0, max_size=12)
harmless_values = st.text(
    string.ascii_letters + string.digits + " ./:-_=", min_size=0, max_size=40
).filter(
    lambda v: (
        not any(
            p in v
            for p in ("ghp_", "gho_", "github_pat_", "sk-", "xox", "AKIA", "ASIA", "-----BEGIN")
        )
    )
)


@st.composite
def credential_names(draw: st.DrawFn) -> str:
    if draw(st.booleans()):
        return draw(names) + draw(st.sampled_from(DENY_SUBSTRINGS)) + draw(names)
    return draw(st.sampled_from(DENY_PREFIXES)) + draw(names)


token_body = st.text(string.ascii_letters + string.digits, min_size=20, max_size=40)


@st.composite
def credential_values(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["ghp", "pat", "sk", "xox", "akia", "pem"]))
    body = draw(token_body)
    core = {
        "ghp": f"ghp_{body}",
        "pat": f"github_pat_{body}",
        "sk": f"sk-{body}",
        "xox": f"xoxb-{body}",
        "akia": "AKIA" + body.upper()[:16].ljust(16, "Q"),
        "pem": f"-----BEGIN RSA PRIVATE KEY-----\n{body}\n-----END RSA PRIVATE KEY-----",
    }[kind]
    return draw(harmless_values) + (" " if draw(st.booleans()) else "") + core


allowed_names = (
    st.sampled_from(sorted(n for n in SANDBOX_ALLOW if not n.endswith("*")))
    | st.text(string.ascii_uppercase, min_size=1, max_size=8).map(lambda s: "LC_" + s)
).filter(lambda n: not looks_like_credential_name(n))  # LC_SESSION: the deny rule wins


@settings(max_examples=300)
@given(name=credential_names(), value=harmless_values)
def test_no_credential_shaped_name_survives(name: str, value: str) -> None:
    sanitizer = EnvironmentSanitizer(extra_allow=(name,))  # even when explicitly allowed
    assert name not in sanitizer.sanitize({name: value})


@settings(max_examples=300)
@given(name=allowed_names, value=credential_values())
def test_no_credential_shaped_value_survives(name: str, value: str) -> None:
    assert EnvironmentSanitizer().sanitize({name: value}) == {}
    assert EnvironmentSanitizer(extra_allow=("MY_VAR",)).sanitize({"MY_VAR": value}) == {}


@settings(max_examples=300)
@given(name=allowed_names, value=harmless_values)
def test_every_allow_listed_harmless_variable_survives(name: str, value: str) -> None:
    assert EnvironmentSanitizer().sanitize({name: value}) == {name: value}


@settings(max_examples=200)
@given(env=st.dictionaries(names.filter(bool), harmless_values | credential_values(), max_size=12))
def test_sanitize_is_pure(env: dict[str, str]) -> None:
    before_env = dict(os.environ)
    snapshot = dict(env)
    s = EnvironmentSanitizer(extra_allow=("A*",), extra_deny=("AB*",))
    first = s.sanitize(env)
    second = s.sanitize(env)
    assert first == second
    assert env == snapshot
    assert first is not env
    assert dict(os.environ) == before_env
    assert set(first) <= set(env)


def test_extra_allow_and_deny() -> None:
    env = {"MY_TOOL_HOME": "/opt/tool", "PROJECT_X": "1", "TERM": "xterm", "LC_ALL": "C"}
    s = EnvironmentSanitizer(extra_allow=("MY_TOOL_HOME", "PROJECT_*"), extra_deny=("LC_*",))
    assert s.sanitize(env) == {"MY_TOOL_HOME": "/opt/tool", "PROJECT_X": "1", "TERM": "xterm"}
    assert s.dropped(env) == ["LC_ALL"]


def test_the_issue_examples_are_dropped() -> None:
    env = {
        "GITHUB_TOKEN": "x" * 20,
        "AWS_SECRET_ACCESS_KEY": "y" * 20,
        "OPENAI_API_KEY": "z" * 20,
        "MY_VAR": "ghp_" + "a" * 36,
        "GOOGLE_APPLICATION_CREDENTIALS": "/k.json",
        "NPM_TOKEN": "n",
        "DOCKER_AUTH_CONFIG": "{}",
        "LANG": "C.UTF-8",
    }
    assert EnvironmentSanitizer(extra_allow=("MY_VAR",)).sanitize(env) == {"LANG": "C.UTF-8"}


def test_tool_profile_keeps_what_tools_need_and_nothing_secret() -> None:
    env = {"PATH": "/usr/bin", "HOME": "/root", "DOCKER_HOST": "unix:///x", "GH_TOKEN": "t" * 20}
    out = EnvironmentSanitizer.for_tools().sanitize(env)
    assert out == {"PATH": "/usr/bin", "HOME": "/root", "DOCKER_HOST": "unix:///x"}


def test_tool_environment_reads_without_mutating(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-" + "q" * 30)
    before = dict(os.environ)
    env = tool_environment({"EXTRA": "1"})
    assert "OPENAI_API_KEY" not in env and env["EXTRA"] == "1" and "PATH" in env
    assert dict(os.environ) == before
