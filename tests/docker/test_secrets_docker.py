"""Secrets in containers, as an attacker would look: env, /proc, docker inspect, output."""

from __future__ import annotations

import json
import secrets as pysecrets
import threading
from typing import Any

import pytest

from devs_sandbox.lifecycle import SandboxLifecycleManager
from devs_sandbox.security.session_keys import session_key_manager
from tests.docker.conftest import dconfig
from tests.integration.helpers import wait_for

pytestmark = pytest.mark.docker

HOST_SECRETS = {
    "GITHUB_TOKEN": "ghs_dockerhost" + "1" * 24,
    "AWS_SECRET_ACCESS_KEY": "aws" + "5" * 37,
    "OPENAI_API_KEY": "sk-dockerhost" + "6" * 36,
    "MY_VAR": "ghp_" + "7" * 36,
}


def test_host_credentials_and_secrets_in_a_container(
    manager: SandboxLifecycleManager, engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in HOST_SECRETS.items():
        monkeypatch.setenv(k, v)
    user_token = "ctr-" + pysecrets.token_hex(16)
    seen: dict[str, Any] = {}

    def inspect_while_running(_e: str, p: dict[str, Any]) -> None:
        seen["key"] = session_key_manager.get_key(p["sandbox_id"])

    manager.bus.on("sandbox:created", inspect_while_running)
    script = (
        "env; echo ---; tr '\\0' '\\n' < /proc/self/environ; echo ---; "
        "tr '\\0' '\\n' < /proc/1/environ 2>/dev/null; echo ---; "
        'cat "$DEVS_SESSION_KEY_FILE"; echo; cat "$USER_TOKEN_FILE"; echo; '
        'stat -c "%a" "$DEVS_SESSION_KEY_FILE"; sleep 2'
    )
    holder: dict[str, Any] = {}

    def run() -> None:
        holder["out"] = manager.run_in_sandbox(
            ["sh", "-c", script], dconfig(), secrets={"USER_TOKEN": user_token}
        )

    t = threading.Thread(target=run)
    t.start()
    assert wait_for(lambda: "key" in seen and manager.live_sandboxes(), 60)
    key = seen["key"]
    assert key is not None
    key_hex = key.hex()
    # From outside, while it runs: docker inspect of the container holds neither value.
    sandbox = manager.live_sandboxes()[0]
    inspected = json.dumps(engine.api.inspect_container(sandbox.context.labels["container_id"]))
    assert key_hex not in inspected and user_token not in inspected
    for value in HOST_SECRETS.values():
        assert value not in inspected
    t.join(120)
    out = holder["out"]
    text = out.result.stdout.text + out.result.stderr.text
    for name, value in HOST_SECRETS.items():
        assert value not in text and f"{name}=" not in text
    assert key_hex not in text and user_token not in text
    assert "[REDACTED:DEVS_SESSION_KEY]" in text and "[REDACTED:USER_TOKEN]" in text
    assert "\n400\n" in text
    assert key == bytearray(16) and not session_key_manager.has_key(out.sandbox_id)


@pytest.mark.parametrize(
    ("value", "first_stdin"),
    [
        (b"line one\nit's 'quoted' $HOME `x`\n", None),  # through the launcher's request
        (b"bin\x00ary\xff", None),  # a NUL cannot live in a shell string: written by exec
        (b"plain-secret-value", b"fed\n"),  # the first exec has stdin: no launcher
    ],
    ids=["launcher", "binary", "stdin-first"],
)
def test_secrets_arrive_whichever_way_the_first_exec_goes(
    manager: SandboxLifecycleManager, value: bytes, first_stdin: bytes | None
) -> None:
    with manager.open_sandbox(dconfig(), secrets={"TOKEN": value}) as sb:
        first = sb.exec(
            ["sh", "-c", 'cat >/dev/null; od -An -tx1 "$TOKEN_FILE"; stat -c %a "$TOKEN_FILE"'],
            stdin=first_stdin,
        )
        assert first.exit_code == 0, first.stderr.text
        digits = "".join(first.stdout.text.split()[:-1])
        assert digits == value.hex()
        assert first.stdout.text.split()[-1] == "400"
        again = sb.exec(["sh", "-c", 'test -r "$TOKEN_FILE" && echo ok'])
        assert again.stdout.text == "ok\n"
