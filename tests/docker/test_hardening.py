"""The hardening, as the engine and the kernel see it in a running sandbox."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from devs_sandbox.base import ExecRequest
from devs_sandbox.errors import IsolationUnavailableError, SecurityConfigError
from devs_sandbox.models import SandboxContext
from tests.docker.conftest import LABELS, dconfig, session_containers

pytestmark = pytest.mark.docker
MiB = 2**20


def test_hardened_config_is_visible_in_docker_inspect(
    driver: Any, sandbox: Callable[..., SandboxContext], engine: Any
) -> None:
    ctx = sandbox(quotas={"memory_bytes": 96 * MiB, "process_count_limit": 40, "cpu_cores": 1.0})
    info = engine.api.inspect_container(ctx.labels["container_id"])
    host = info["HostConfig"]
    assert host["CapDrop"] == ["ALL"]
    assert "no-new-privileges:true" in host["SecurityOpt"]
    assert host["Privileged"] is False
    assert host["ReadonlyRootfs"] is True
    assert host["Init"] is True
    assert host["Memory"] == host["MemorySwap"] == 96 * MiB
    assert host["PidsLimit"] == 42
    assert host["CpuQuota"] == 100_000
    assert host["NetworkMode"] == "none"
    assert "size=" in host["Tmpfs"]["/workspace"] and "nr_inodes=" in host["Tmpfs"]["/workspace"]
    assert {u["Name"] for u in host["Ulimits"]} >= {"nofile", "nproc"}
    assert host["LogConfig"]["Type"] == "none"
    config = info["Config"]
    assert config["User"] == "65534:65534"
    labels = config["Labels"]
    assert labels["devs.managed"] == "true"
    assert labels["devs.sandbox.id"] == ctx.id
    assert labels["devs.owner.pid"].isdigit() and labels["devs.owner.boot"]
    assert info["Name"] == f"/devs-sandbox-{ctx.id}"
    assert info["State"]["Running"] is True
    assert set(ctx.isolation) >= {
        "pid-namespace",
        "mount-namespace",
        "net-namespace",
        "tmpfs-workspace",
        "unprivileged-user",
        "cap-drop-all",
        "no-new-privileges",
        "read-only-rootfs",
    }


def test_the_kernel_enforces_it_inside(driver: Any, sandbox: Callable[..., SandboxContext]) -> None:
    ctx = sandbox()
    script = (
        "id -u; grep -E '^(CapEff|NoNewPrivs)' /proc/self/status; "
        "touch /etc/x 2>/dev/null && echo rootfs-writable || echo rootfs-ro; "
        "echo ok > /workspace/f && echo workspace-rw; "
        "ls /sys/class/net; "
        "ulimit -n; pwd; echo $HOME"
    )
    out = driver.exec(ctx, ExecRequest.of(["sh", "-c", script]))
    assert out.exit_code == 0, out.stderr.text
    lines = out.stdout.text.split()
    assert lines[0] == "65534"
    assert "CapEff:\t0000000000000000" in out.stdout.text
    assert "NoNewPrivs:\t1" in out.stdout.text
    assert "rootfs-ro" in lines and "workspace-rw" in lines
    assert "eth0" not in lines and "lo" in lines
    assert "1024" in lines
    assert lines[-2:] == ["/workspace", "/workspace"]


def test_network_only_when_asked(driver: Any, sandbox: Callable[..., SandboxContext]) -> None:
    ctx = sandbox(network=True)
    assert "net-namespace" not in ctx.isolation
    out = driver.exec(ctx, ExecRequest.of(["ls", "/sys/class/net"]))
    assert "eth0" in out.stdout.text.split()


def test_host_environment_is_not_inherited(
    driver: Any, sandbox: Callable[..., SandboxContext], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEVS_TEST_HOST_SECRET", "s3cr3t-value")
    ctx = sandbox(env={"EXPLICIT": "yes"})
    out = driver.exec(ctx, ExecRequest.of(["env"], env={"PER_EXEC": "1"}))
    env = dict(line.split("=", 1) for line in out.stdout.text.splitlines())
    assert "DEVS_TEST_HOST_SECRET" not in env and "s3cr3t" not in out.stdout.text
    assert env["EXPLICIT"] == "yes" and env["PER_EXEC"] == "1"
    assert env["DEVS_SANDBOX_ID"] == ctx.id
    assert set(env) <= {
        "PATH",
        "HOME",
        "LANG",
        "TERM",
        "TMPDIR",
        "HOSTNAME",
        "DEVS_SANDBOX_ID",
        "EXPLICIT",
        "PER_EXEC",
    }


@pytest.mark.parametrize(
    "override",
    [
        {"Privileged": True},
        {"CapDrop": []},
        {"CapAdd": ["SYS_ADMIN"]},
        {"SecurityOpt": []},
        {"SecurityOpt": ["no-new-privileges:true", "seccomp=unconfined"]},
        {"ReadonlyRootfs": False},
        {"MemorySwap": -1},
        {"PidsLimit": 0},
        {"NetworkMode": "host"},
        {"PidMode": "host"},
        {"Binds": ["/var/run/docker.sock:/var/run/docker.sock"]},
    ],
    ids=lambda o: next(iter(o)),
)
def test_a_weakened_config_is_refused_before_any_container_exists(
    docker_image: str, engine: Any, override: dict[str, Any]
) -> None:
    from devs_sandbox.drivers.docker import DockerDriver

    before = {c["Id"] for c in session_containers(engine)}
    driver = DockerDriver(host_config_overrides=override, extra_labels=LABELS, watch_oom=False)
    try:
        with pytest.raises(SecurityConfigError):
            driver.provision(dconfig())
    finally:
        driver.close()
    assert {c["Id"] for c in session_containers(engine)} == before


def test_required_mechanism_missing_refuses_to_run(docker_image: str) -> None:
    from devs_sandbox.drivers.docker import DockerDriver

    driver = DockerDriver(extra_labels=LABELS, watch_oom=False)
    try:
        with pytest.raises(IsolationUnavailableError, match="net-namespace"):
            driver.provision(dconfig(network=True, isolation={"required": ["net-namespace"]}))
        report = driver.isolation_report(dconfig(isolation={"run_as_user": "current"}))
        assert report["unprivileged-user"]  # root in the container is reported, not hidden
    finally:
        driver.close()


def test_destroy_removes_everything_and_is_idempotent(
    driver: Any, engine: Any, sandbox: Callable[..., SandboxContext]
) -> None:
    from devs_sandbox.leases import LeaseRegistry

    ctx = sandbox()
    cid = ctx.labels["container_id"]
    assert ctx.workspace.is_dir() and LeaseRegistry().read(ctx.id) is not None
    driver.destroy(ctx)
    driver.destroy(ctx)
    assert not ctx.workspace.exists()
    assert LeaseRegistry().read(ctx.id) is None
    assert cid not in {c["Id"] for c in session_containers(engine)}
    assert not list(Path("/sys/fs/cgroup/freezer/docker").glob(f"{cid}*"))


def test_destroy_after_a_partial_provision_by_id(
    driver: Any, engine: Any, docker_image: str
) -> None:
    """A crash between create and start leaves a container only its name can find."""
    from devs_sandbox.drivers.docker import CONTAINER_PREFIX, HOST_DIR_PREFIX

    sandbox_id = "devs-test-partial-1"
    name = f"{CONTAINER_PREFIX}{sandbox_id}"
    host_dir = driver.workspace_root / f"{HOST_DIR_PREFIX}{sandbox_id}"
    engine.api.create_container(
        docker_image, ["true"], name=name, labels={**LABELS, "devs.managed": "true"}
    )
    host_dir.mkdir()
    driver.destroy(SandboxContext(id=sandbox_id, driver="docker", workspace=host_dir, isolation=()))
    assert not host_dir.exists()
    assert not [c for c in session_containers(engine) if f"/{name}" in c["Names"]]


def test_a_colliding_fixed_id_never_touches_the_other_sandbox(
    driver: Any, sandbox: Callable[..., SandboxContext], docker_image: str
) -> None:
    from devs_sandbox.drivers.docker import DockerDriver
    from devs_sandbox.errors import ProvisionError

    ctx = sandbox(sandbox_id="devs-test-collide-1")
    other = DockerDriver(extra_labels=LABELS, watch_oom=False)
    try:
        with pytest.raises(ProvisionError, match="in use"):
            other.provision(dconfig(sandbox_id="devs-test-collide-1"))
    finally:
        other.close()
    assert driver.is_running(ctx) and ctx.workspace.is_dir()
    assert driver.exec(ctx, ExecRequest.of(["echo", "untouched"])).stdout.text == "untouched\n"
