"""The trust boundary attacked from inside a container sandbox, where each class applies.

The same classes as tests/integration/test_boundary.py, played against the Docker driver:
the keyring (Docker's default seccomp profile refuses keyctl), other sandboxes' cgroups
(a cgroup namespace of its own, which the engine does not give by default on cgroup v1),
/tmp and /dev/shm private to the container, the host's loopback with --network (a bridge
network namespace), and the default CPU cap.
"""

from __future__ import annotations

import json
import platform
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from devs_sandbox.lifecycle import SandboxLifecycleManager
from tests.docker.conftest import dconfig

pytestmark = pytest.mark.docker
X86_64 = platform.machine() == "x86_64"


@pytest.mark.skipif(not X86_64, reason="raw syscall numbers of x86_64")
def test_keyrings_and_nested_user_namespaces_are_refused(
    manager: SandboxLifecycleManager,
) -> None:
    probe = (
        "import ctypes, json\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "out = {}\n"
        "for name, nr, args in [('keyctl', 250, (0, -3, 0)), ('add_key', 248, (0, 0, 0, 0, -3)),"
        " ('unshare-user', 272, (0x10000000,))]:\n"
        "    ctypes.set_errno(0)\n"
        "    rc = libc.syscall(nr, *[ctypes.c_long(a) for a in args])\n"
        "    out[name] = 0 if rc >= 0 else ctypes.get_errno()\n"
        "print(json.dumps(out))\n"
    )
    out = manager.run_in_sandbox(["python3", "-c", probe], dconfig())
    errnos = json.loads(out.result.stdout.text)
    assert all(e in (1, 38) for e in errnos.values()), errnos  # EPERM or ENOSYS, never 0


def test_a_container_sandbox_cannot_see_other_sandboxes_cgroups(
    manager: SandboxLifecycleManager, engine: Any
) -> None:
    with manager.open_sandbox(dconfig()) as victim:
        victim_container = victim.context.labels["container_id"]
        out = manager.run_in_sandbox(
            ["sh", "-c", "cat /proc/self/cgroup; find /sys/fs/cgroup -maxdepth 2 | head -200"],
            dconfig(),
        )
        text = out.result.stdout.text
        assert victim_container not in text and victim.id not in text
        assert "/docker/" not in text, "the engine's cgroup path of the container leaks"
        host = engine.api.inspect_container(victim_container)["HostConfig"]
        assert host["CgroupnsMode"] == "private"


def test_tmp_and_dev_shm_are_the_containers_own_and_sized(
    manager: SandboxLifecycleManager,
) -> None:
    out = manager.run_in_sandbox(
        ["sh", "-c", "df -k /tmp /dev/shm | tail -2; echo x > /var/tmp/f; echo rc=$?"],
        dconfig(docker={"tmp_bytes": 8 << 20}),
    )
    lines = out.result.stdout.text.splitlines()
    sizes = [int(line.split()[1]) for line in lines[:2]]
    assert sizes == [8 << 10, 8 << 10], lines
    assert "rc=0" not in out.result.stdout.text, "/var/tmp should be read-only"


@pytest.fixture
def loopback_service() -> Iterator[int]:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.sendall(b"loopback-service")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        t.join(2)
        server.close()


def test_network_does_not_reach_the_hosts_loopback(
    manager: SandboxLifecycleManager, loopback_service: int
) -> None:
    probe = (
        "import json, socket, struct\n"
        "gw = None\n"
        "for line in open('/proc/net/route').read().splitlines()[1:]:\n"
        "    f = line.split()\n"
        "    if f[1] == '00000000':\n"
        "        gw = socket.inet_ntoa(struct.pack('<L', int(f[2], 16)))\n"
        "out = {}\n"
        f"for name, host in [('loopback', '127.0.0.1'), ('gateway', gw)]:\n"
        "    s = socket.socket(); s.settimeout(2)\n"
        "    try:\n"
        f"        s.connect((host, {loopback_service})); out[name] = s.recv(64).decode()\n"
        "    except Exception as e:\n"
        "        out[name] = 'refused: %s' % e\n"
        "print(json.dumps(out))\n"
    )
    out = manager.run_in_sandbox(["python3", "-c", probe], dconfig(network=True))
    seen = json.loads(out.result.stdout.text)
    assert seen["loopback"].startswith("refused") and seen["gateway"].startswith("refused"), seen


def test_one_runaway_container_gets_one_core_by_default(
    manager: SandboxLifecycleManager, engine: Any
) -> None:
    with manager.open_sandbox(dconfig()) as sb:
        host = engine.api.inspect_container(sb.context.labels["container_id"])["HostConfig"]
    assert host["NanoCpus"] == 1_000_000_000 or host["CpuQuota"] == host["CpuPeriod"], host
