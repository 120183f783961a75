"""Per-user paths: the XDG base directory spec, through platformdirs for our own environment
and through our own resolver for a client's (the warm server's case); both must agree and
keep the paths devs-sandbox has always used."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from devs_sandbox.config import default_db_path, user_dir
from devs_sandbox.config_trust import user_config_path

pytestmark = pytest.mark.unit

# (XDG_DATA_HOME, XDG_CONFIG_HOME, HOME) -> (database, user config file); None = unset
CASES = [
    (("/xd", "/xc", "/h"), ("/xd/devs-sandbox/devs.db", "/xc/devs-sandbox/config.json")),
    (
        (None, None, "/h"),
        ("/h/.local/share/devs-sandbox/devs.db", "/h/.config/devs-sandbox/config.json"),
    ),
    (
        ("", "", "/h"),
        ("/h/.local/share/devs-sandbox/devs.db", "/h/.config/devs-sandbox/config.json"),
    ),
    # relative values are invalid by the spec and ignored (platformdirs >= 4.11.8 does too)
    (
        ("rel", "rel", "/h"),
        ("/h/.local/share/devs-sandbox/devs.db", "/h/.config/devs-sandbox/config.json"),
    ),
    (("/xd", None, "/h"), ("/xd/devs-sandbox/devs.db", "/h/.config/devs-sandbox/config.json")),
]


def _env(data: str | None, config: str | None, home: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "DEVS_SANDBOX_"))}
    env["HOME"] = home
    if data is not None:
        env["XDG_DATA_HOME"] = data
    if config is not None:
        env["XDG_CONFIG_HOME"] = config
    return env


@pytest.mark.parametrize(("given", "expected"), CASES)
def test_explicit_environment_gives_todays_paths(
    given: tuple[str | None, str | None, str], expected: tuple[str, str]
) -> None:
    env = _env(*given)
    assert (str(default_db_path(env)), str(user_config_path(env))) == expected


@pytest.mark.parametrize(("given", "expected"), CASES)
def test_own_environment_through_platformdirs_agrees(
    given: tuple[str | None, str | None, str],
    expected: tuple[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = _env(*given)
    for key in list(os.environ):
        if key not in env:
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert (str(default_db_path()), str(user_config_path())) == expected
    for kind in ("data", "config"):
        assert user_dir(kind) == user_dir(kind, env)


def test_devs_sandbox_db_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_db_path({"DEVS_SANDBOX_DB": "/d/x.db", "HOME": "/h"}) == Path("/d/x.db")
    monkeypatch.setenv("DEVS_SANDBOX_DB", "/d/y.db")
    assert default_db_path() == Path("/d/y.db")
