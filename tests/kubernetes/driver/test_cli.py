"""``devs-sandbox run --driver kubernetes``: the same ``--json`` contract and exit statuses
(124, 125, 137) as the other drivers, through the real command against the emulated stack
(and a real cluster behind ``kubernetes_cluster``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from devs_sandbox.models import CapturedStream, ExecResult, SandboxOutcome
from tests.conftest import run_cli
from tests.kubernetes.driver.helpers import BOTH, Target
from tests.kubernetes.emulator import Quota

pytestmark = pytest.mark.kubernetes

HOG = "b = []\nwhile True: b.append(bytearray(1 << 20))"
CONTRACT = set(
    SandboxOutcome("x", "d", (), ExecResult(0, CapturedStream(), CapturedStream(), 0)).to_json()
)


def run(target: Target, *args: str, timeout: float = 180) -> tuple[int, dict[str, Any], str]:
    cluster = ["--kubeconfig", str(target.kubeconfig), "--namespace", target.namespace]
    if target.context:
        cluster += ["--context", target.context]
    image = ["--image", target.image] if target.image else []
    done = run_cli(
        "run", "--driver", "kubernetes", *cluster, *image, "--json", *args, timeout=timeout
    )
    payload = json.loads(done.stdout) if done.stdout.strip() else {}
    return done.returncode, payload, done.stderr


@pytest.mark.parametrize("target", BOTH, indirect=True)
def test_run_gives_the_json_contract_and_the_commands_own_status(target: Target) -> None:
    code, out, err = run(target, "--", "sh", "-c", "echo hi; echo oops >&2; exit 3")
    assert code == 3, err
    assert set(out) == CONTRACT
    assert out["driver"] == "kubernetes" and out["exit_code"] == 3
    assert (out["stdout"], out["stderr"]) == ("hi\n", "oops\n")
    assert out["violation"] is None and out["timed_out"] is False
    assert {"rlimits", "network-policy", "seccomp", "unprivileged-user"} <= set(out["isolation"])


@pytest.mark.parametrize("target", BOTH, indirect=True)
def test_run_past_its_timeout_exits_124(target: Target) -> None:
    code, out, err = run(target, "--timeout", "3", "--", "sleep", "120")
    assert code == 124, err
    assert out["timed_out"] is True and out["exit_code"] == 124
    assert "timed out" in err


@pytest.mark.parametrize("target", BOTH, indirect=True)
def test_run_killed_for_its_memory_exits_137_with_the_violation_recorded(target: Target) -> None:
    code, out, err = run(target, "--memory", "96m", "--", "python3", "-c", HOG)
    assert code == 137, err
    assert out["violation"]["type"] == "MEMORY_EXCEEDED"
    assert out["violation"]["limit_value"] == 96 << 20
    listed = run_cli("violations", "--json", "--sandbox-id", out["sandbox_id"])
    assert [r["violation_type"] for r in json.loads(listed.stdout)] == ["MEMORY_EXCEEDED"]


@pytest.mark.docker
def test_a_quota_refusal_exits_125_with_the_reason_at_once(emulated: Target) -> None:
    emulated.emulator.quotas.append(Quota({"pods": "0"}, name="sandboxes"))
    code, _, err = run(emulated, "--", "true")
    assert code == 125
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "exceeded quota: sandboxes" in lines[0]
    assert "Traceback" not in err
