"""Secrets, as an attacker would look for them: inside the sandbox, on the host, in logs."""

from __future__ import annotations

import hashlib
import logging
import secrets as pysecrets
import threading
from pathlib import Path
from typing import Any

import pytest

from devs_sandbox.security.session_keys import session_key_manager
from tests.conftest import caps, run_cli
from tests.helpers import manager as new_manager
from tests.integration.helpers import config, wait_for

pytestmark = pytest.mark.integration

HOST_SECRETS = {
    "GITHUB_TOKEN": "ghs_hostsecret" + "1" * 24,
    "AWS_SECRET_ACCESS_KEY": "aws" + "2" * 37,
    "OPENAI_API_KEY": "sk-host" + "3" * 40,
    "MY_VAR": "ghp_" + "4" * 36,
}


def _levels() -> list[Any]:
    """Every isolation level this host can offer; a missing layer is skipped, with why."""
    have_bwrap = not caps()["bwrap"]
    have_cgroup = not caps()["cgroups"]
    have_unshare = not caps()["unshare"]
    return [
        pytest.param(
            {},
            id="full",
            marks=pytest.mark.skipif(
                not (have_bwrap and have_cgroup), reason="needs bwrap and cgroups"
            ),
        ),
        pytest.param(
            {"use_bwrap": False},
            id="unshare",
            marks=pytest.mark.skipif(
                not (have_unshare and have_cgroup), reason="needs unshare(2) namespaces and cgroups"
            ),
        ),
        pytest.param(
            {"namespaces": False, "allow_weaker_isolation": True},
            id="no-namespaces",
            marks=pytest.mark.skipif(not have_cgroup, reason="needs cgroups"),
        ),
        pytest.param(
            {"use_cgroups": False},
            id="namespaces-only",
            marks=pytest.mark.skipif(not have_bwrap, reason="needs bwrap"),
        ),
        pytest.param(
            {
                "namespaces": False,
                "allow_weaker_isolation": True,
                "use_cgroups": False,
                "tmpfs_workspace": False,
            },
            id="rlimits-only",
        ),
    ]


@pytest.fixture
def host_secrets(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for k, v in HOST_SECRETS.items():
        monkeypatch.setenv(k, v)
    return HOST_SECRETS


DUMP = (
    "env; echo ---; cat /proc/self/environ | tr '\\0' '\\n'; echo ---; "
    "cat /proc/1/environ 2>/dev/null | tr '\\0' '\\n'; echo ---; "
    'sha256sum "$DEVS_SESSION_KEY_FILE" | cut -c1-64; cat "$DEVS_SESSION_KEY_FILE"; echo; '
    'cat "$USER_TOKEN_FILE"; echo; stat -c "%a %U" "$DEVS_SESSION_KEY_FILE"'
)


@pytest.mark.parametrize("isolation", _levels())
def test_host_credentials_never_reach_the_sandbox(
    host_secrets: dict[str, str], isolation: dict[str, Any]
) -> None:
    from devs_sandbox.config import DevsConfig, EnvironmentConfig

    # MY_VAR is explicitly allowed by name: the value rule (ghp_...) must still win.
    manager = new_manager(config=DevsConfig(environment=EnvironmentConfig(extra_allow=("MY_VAR",))))
    user_token = "user-" + pysecrets.token_hex(16)
    seen_key: list[str] = []

    def grab_key(_e: str, p: dict[str, Any]) -> None:
        key = session_key_manager.get_key(p["sandbox_id"])
        if key is not None:
            seen_key.append(key.hex())

    manager.bus.on("sandbox:created", grab_key)
    out = manager.run_in_sandbox(
        ["sh", "-c", DUMP], config(isolation=isolation), secrets={"USER_TOKEN": user_token}
    )
    text = out.result.stdout.text + out.result.stderr.text
    for name, value in host_secrets.items():
        assert value not in text, f"{name}'s value leaked ({isolation})"
        assert f"{name}=" not in text, f"{name} leaked ({isolation})"
    # The session key and the user secret arrived (as 0400 files), and were redacted.
    assert seen_key
    key_hex = seen_key[0]
    assert hashlib.sha256(key_hex.encode()).hexdigest() in text
    assert key_hex not in text and user_token not in text
    assert "[REDACTED:DEVS_SESSION_KEY]" in text and "[REDACTED:USER_TOKEN]" in text
    assert "400 " in text
    # Revoked after the run.
    assert not session_key_manager.has_key(out.sandbox_id)


@pytest.mark.parametrize("isolation", _levels())
def test_no_host_process_exposes_a_secret_while_the_task_runs(isolation: dict[str, Any]) -> None:
    manager = new_manager()
    user_token = "tok-" + pysecrets.token_hex(20)
    found: dict[str, Any] = {}

    def scan_host() -> None:
        """From outside, as any host user with /proc access would look."""
        live = manager.live_sandboxes()
        if not live:
            return
        key = session_key_manager.get_key(live[0].id)
        if key is None:
            return
        needles = [key.hex().encode(), bytes(key), user_token.encode()]
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            for what in ("cmdline", "environ"):
                try:
                    data = (proc / what).read_bytes()
                except OSError:
                    continue
                for n in needles:
                    if n in data:
                        found[f"{proc.name}/{what}"] = n
        found["scanned"] = True
        found["key"] = key

    def task() -> None:
        manager.run_in_sandbox(
            ["sh", "-c", 'cat "$DEVS_SESSION_KEY_FILE" "$USER_TOKEN_FILE" >/dev/null; sleep 2'],
            config(isolation=isolation),
            secrets={"USER_TOKEN": user_token},
        )

    t = threading.Thread(target=task)
    t.start()
    assert wait_for(lambda: bool(manager.live_sandboxes()), 15)
    wait_for(lambda: False, 0.5)
    scan_host()
    t.join(60)
    assert found.pop("scanned", False)
    key = found.pop("key")
    assert found == {}, f"secret visible on the host: {sorted(found)}"
    assert key == bytearray(16), "the session key buffer was not zeroed at revoke"


def test_secret_files_are_gone_after_the_run() -> None:
    manager = new_manager()
    out = manager.run_in_sandbox(
        ["sh", "-c", 'echo "$DEVS_SESSION_KEY_FILE"; ls -la "$(dirname "$DEVS_SESSION_KEY_FILE")"'],
        config(isolation={"namespaces": False, "allow_weaker_isolation": True}),
    )
    path = Path(out.result.stdout.text.splitlines()[0])
    assert path.parent.name == ".devs-secrets" and "r-x------" in out.result.stdout.text
    assert not path.exists() and not path.parent.exists()


def test_debug_logs_of_a_run_hold_no_secret(caplog: pytest.LogCaptureFixture) -> None:
    manager = new_manager()
    user_token = "dbg-" + pysecrets.token_hex(16)
    keys: list[bytes] = []
    manager.bus.on(
        "sandbox:created",
        lambda _e, p: keys.append(bytes(session_key_manager.get_key(p["sandbox_id"]) or b"")),
    )
    with caplog.at_level(logging.DEBUG, logger="devs_sandbox"):
        manager.run_in_sandbox(
            ["sh", "-c", 'cat "$USER_TOKEN_FILE"; cat "$DEVS_SESSION_KEY_FILE"'],
            config(),
            secrets={"USER_TOKEN": user_token},
        )
    assert "session_key_rotated" in caplog.text
    assert user_token not in caplog.text and keys[0].hex() not in caplog.text


def test_cli_secret_from_file_and_environment_never_leaks(tmp_path: Path) -> None:
    file_secret = "file-" + pysecrets.token_hex(16)
    env_secret = "env-" + pysecrets.token_hex(16)
    f = tmp_path / "token.txt"
    f.write_text(file_secret + "\n")
    r = run_cli(
        "--log-level",
        "debug",
        "run",
        "--json",
        "--secret",
        f"FROM_FILE=@{f}",
        "--secret",
        "FROM_ENV",
        "--",
        "sh",
        "-c",
        'cat "$FROM_FILE_FILE" "$FROM_ENV_FILE"; echo; env | grep -c _FILE',
        env={"FROM_ENV": env_secret},
    )
    assert r.returncode == 0, r.stderr
    assert file_secret not in r.stdout + r.stderr and env_secret not in r.stdout + r.stderr
    assert "[REDACTED:FROM_FILE]" in r.stdout and "[REDACTED:FROM_ENV]" in r.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--secret", "TOKEN=inline-value"], "never inline"),
        (["--secret", "NOT_SET_ANYWHERE_1234"], "not set in the environment"),
        (["--secret", "X=@/nonexistent/file"], "cannot read"),
        (["--secret", "bad-name=@/etc/hostname"], "invalid secret name"),
    ],
)
def test_cli_secret_errors(args: list[str], needle: str) -> None:
    r = run_cli("run", *args, "--", "true")
    assert r.returncode == 125 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "inline-value" not in r.stderr
