"""The trust boundary, attacked from inside a sandbox at every isolation level the host offers.

Each test plays a hostile task against one kernel surface a sandbox must not share with its
host or with other sandboxes: the caller's keyring, nested user namespaces and the other
filtered syscalls, the cgroup hierarchy, /tmp, /var/tmp and /dev/shm, the host's loopback
with --network, ptrace without a pid namespace, and the whole CPU. Where it makes the test
more convincing, a control run with the layer switched off (allowWeakerIsolation) shows
that the attack works without it, so the assertion cannot pass by accident.

Levels: ``bwrap`` (bubblewrap) and ``unshare`` (our unshare(2) launcher, what a host without
a working bubblewrap gets). Both are required on CI (DEVS_SANDBOX_REQUIRE_ALL=1).
"""

from __future__ import annotations

import json
import platform
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devs_sandbox.errors import QuotaExceededError, WeakerIsolationError
from devs_sandbox.models import ViolationType
from tests.conftest import run_cli
from tests.integration.helpers import LAUNCHERS, config, manager

pytestmark = [pytest.mark.integration, pytest.mark.root, pytest.mark.cgroups, pytest.mark.tmpfs]
PY = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else "python3"
WEAKER = {"allow_weaker_isolation": True}
X86_64 = platform.machine() == "x86_64"

LEVELS = [
    pytest.param(LAUNCHERS["bwrap"], id="bwrap", marks=pytest.mark.bwrap),
    pytest.param(LAUNCHERS["unshare"], id="unshare", marks=pytest.mark.unshare),
]


@pytest.fixture(params=LEVELS)
def level(request: pytest.FixtureRequest) -> dict[str, Any]:
    iso: dict[str, Any] = request.param
    return iso


def _syscall_probe(calls: dict[str, tuple[int, tuple[int, ...]]]) -> str:
    """Python run in the sandbox: each raw syscall's errno (0 = it worked), as JSON."""
    return (
        "import ctypes, json\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"calls = {calls!r}\n"
        "out = {}\n"
        "for name, (nr, args) in calls.items():\n"
        "    ctypes.set_errno(0)\n"
        "    rc = libc.syscall(nr, *[ctypes.c_long(a) for a in args])\n"
        "    out[name] = 0 if rc >= 0 else ctypes.get_errno()\n"
        "print(json.dumps(out))\n"
    )


# -- keyrings ---------------------------------------------------------------------------------
KEYRING_CALLER = r"""
import ctypes, json, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
KEYCTL_JOIN, KEYCTL_READ, KEYCTL_SEARCH, SESSION = 1, 11, 10, -3
# A login shell's session keyring (pam_keyinit gives one), holding one of the caller's keys.
ring = libc.syscall(250, KEYCTL_JOIN, ctypes.c_char_p(sys.argv[1].encode()))
key = libc.syscall(248, b"user", b"devs-caller-key", b"caller-secret-42", 16, SESSION)
assert ring > 0 and key > 0, ctypes.get_errno()
cli = [sys.executable, "-m", "devs_sandbox", "run", "--json", "--env", f"KEY_ID={key}"]
r = subprocess.run(cli + sys.argv[2:], capture_output=True, text=True)
buf = ctypes.create_string_buffer(64)
n = libc.syscall(250, KEYCTL_READ, key, buf, 64)
found = libc.syscall(250, KEYCTL_SEARCH, SESSION, b"user", b"devs-planted-key", 0)
print(json.dumps({"rc": r.returncode, "stdout": r.stdout, "stderr": r.stderr,
                  "after": buf.raw[:max(n, 0)].decode(), "planted": found > 0}))
"""

KEYRING_TASK = r"""
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
key = int(os.environ["KEY_ID"])
buf = ctypes.create_string_buffer(64)
out = {}
ctypes.set_errno(0)
n = libc.syscall(250, 11, key, buf, 64)  # KEYCTL_READ the caller's key
out["read"] = buf.raw[:n].decode() if n > 0 else "errno %d" % ctypes.get_errno()
ctypes.set_errno(0)
planted = libc.syscall(248, b"user", b"devs-planted-key", b"x", 1, -3)  # add_key to @s
out["plant"] = "ok" if planted > 0 else "errno %d" % ctypes.get_errno()
ctypes.set_errno(0)
rc = libc.syscall(250, 3, key)  # KEYCTL_REVOKE
out["revoke"] = "ok" if rc == 0 else "errno %d" % ctypes.get_errno()
print(json.dumps(out))
"""


def _keyring_attack(isolation: dict[str, Any], tmp_path: Path) -> tuple[dict[str, Any], Any]:
    """The caller (a process in a session keyring of its own, as after pam_keyinit) runs the
    CLI; the task tries to read, plant and revoke keys there. Returns (caller, task)."""
    cfg = tmp_path / f"operator-{uuid.uuid4().hex[:6]}.json"
    cfg.write_text(json.dumps({"sandbox": {"isolation": isolation}}))
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            KEYRING_CALLER,
            f"devs-test-{uuid.uuid4().hex[:8]}",
            *("--config", str(cfg), "--", PY, "-c", KEYRING_TASK),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    caller: dict[str, Any] = json.loads(r.stdout)
    assert caller["rc"] == 0, caller["stderr"]
    return caller, json.loads(json.loads(caller["stdout"])["stdout"])


@pytest.mark.skipif(not X86_64, reason="raw syscall numbers of x86_64")
@pytest.mark.parametrize(
    "isolation",
    [
        pytest.param({}, id="bwrap", marks=pytest.mark.bwrap),
        pytest.param({"useBwrap": False}, id="unshare", marks=pytest.mark.unshare),
    ],
)
def test_the_callers_session_keyring_is_out_of_reach(
    isolation: dict[str, Any], tmp_path: Path
) -> None:
    caller, task = _keyring_attack(isolation, tmp_path)
    assert task["read"].startswith("errno"), task
    assert task["plant"].startswith("errno") and task["revoke"].startswith("errno"), task
    assert caller["after"] == "caller-secret-42" and not caller["planted"]

    # Control: without the filter the task possesses the caller's keyring (keyrings(7),
    # "possession": inherited, whatever the uid), so this test can see the hole.
    _, leaked = _keyring_attack(
        {**isolation, "seccomp": False, "allowWeakerIsolation": True}, tmp_path
    )
    assert leaked["read"] == "caller-secret-42", "the control should show the hole"


# -- filtered syscalls ---------------------------------------------------------------------------
@pytest.mark.skipif(not X86_64, reason="raw syscall numbers of x86_64")
def test_filtered_syscalls_are_refused(level: dict[str, Any]) -> None:
    calls = {
        "unshare(CLONE_NEWUSER)": (272, (0x10000000,)),
        "io_uring_setup": (425, (8, 0)),
        "bpf": (321, (0, 0, 0)),
        "perf_event_open": (298, (0, 0, -1, -1, 0)),
        "userfaultfd": (323, (0,)),
        "keyctl": (250, (0, -3, 0)),
        "mount": (165, (0, 0, 0, 0, 0)),
        "setns": (308, (0, 0)),
        "kexec_load": (246, (0, 0, 0, 0)),
    }
    out = manager().run_in_sandbox([PY, "-c", _syscall_probe(calls)], config(isolation=level))
    assert "seccomp" in out.isolation
    errnos = json.loads(out.result.stdout.text)
    assert errnos == dict.fromkeys(calls, 1), errnos  # EPERM, from the filter, for each
    nested = manager().run_in_sandbox("unshare -U true; echo rc=$?", config(isolation=level))
    assert "rc=1" in nested.result.stdout.text


# -- cgroups ------------------------------------------------------------------------------------
def test_a_sandbox_cannot_enumerate_other_sandboxes_through_cgroupfs(
    level: dict[str, Any],
) -> None:
    m = manager()
    look = (
        "find /sys/fs/cgroup -maxdepth 3 2>/dev/null; cat /proc/self/cgroup;"
        " cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/memory.max 2>/dev/null"
    )
    with m.open_sandbox(config(isolation=level)) as victim:
        victim.exec("sleep 0.1")
        out = m.run_in_sandbox(
            ["sh", "-c", look], config(isolation=level, quotas={"memory_bytes": 96 << 20})
        )
        text = out.result.stdout.text
        assert victim.id not in text, "another sandbox's cgroup is visible"
        assert out.sandbox_id not in text, "the host's cgroup paths leak through"
        assert "devs-sandbox" not in text
        assert str(96 << 20) in text, "the sandbox's own memory limit should be readable"
        host_only = [
            c
            for c in ("devices", "blkio", "freezer", "systemd")
            if Path(f"/sys/fs/cgroup/{c}").is_dir()
        ]
        for hierarchy in host_only:
            assert f"/sys/fs/cgroup/{hierarchy}" not in text, "a host hierarchy is in view"

        # Control: without namespaces the hierarchy, and the victim's id in it, are in view.
        control = m.run_in_sandbox(
            ["sh", "-c", look],
            config(isolation={"namespaces": False, **WEAKER}),
        )
        assert victim.id in control.result.stdout.text


# -- /tmp, /var/tmp, /dev/shm ---------------------------------------------------------------
def test_tmp_var_tmp_and_dev_shm_are_private_and_leave_nothing(level: dict[str, Any]) -> None:
    tag = f"devs-test-{uuid.uuid4().hex[:10]}"
    planted = [Path(d) / f"{tag}-host" for d in ("/tmp", "/var/tmp", "/dev/shm")]
    for p in planted:
        p.write_text("host file")
    try:
        script = (
            f"ls /tmp /var/tmp /dev/shm | grep -c {tag}-host;"
            f" for d in /tmp /var/tmp /dev/shm; do echo x > $d/{tag}-task || echo FAIL $d; done;"
            " ipcmk -M 4096 >/dev/null 2>&1; echo done"
        )
        out = manager().run_in_sandbox(["sh", "-c", script], config(isolation=level))
        lines = out.result.stdout.text.split()
        assert lines[0] == "0", "the host's temporary files are visible"
        assert "FAIL" not in out.result.stdout.text and lines[-1] == "done"
        for d in ("/tmp", "/var/tmp", "/dev/shm"):
            assert not list(Path(d).glob(f"{tag}-task*")), f"a task's file outlived it in {d}"
        shm = subprocess.run(["ipcs", "-m"], capture_output=True, text=True, check=False).stdout
        uid_rows = [ln for ln in shm.splitlines() if ln.split()[2:3] and "1600" in ln]
        assert not uid_rows, f"a SysV segment outlived the sandbox: {uid_rows}"
    finally:
        for p in planted:
            p.unlink(missing_ok=True)


@pytest.mark.parametrize("where", ["/tmp", "/var/tmp", "/dev/shm"])
def test_files_in_tmp_and_shm_count_against_the_file_quota(
    level: dict[str, Any], where: str
) -> None:
    bomb = (
        "import os\nmade = 0\n"
        "for i in range(5000):\n"
        "    try:\n"
        f"        open(f'{where}/f{{i}}', 'w').close(); made += 1\n"
        "    except OSError:\n        break\n"
        "print('made', made, flush=True)\nimport time; time.sleep(60)\n"
    )
    with pytest.raises(QuotaExceededError) as info:
        manager().run_in_sandbox(
            [PY, "-c", bomb],
            config(
                isolation=level,
                timeout_ms=30_000,
                quotas={"file_count_limit": 300, "poll_interval_ms": 200},
            ),
        )
    assert info.value.violation.type == ViolationType.FILE_COUNT_EXCEEDED
    assert info.value.outcome is not None
    assert info.value.outcome.result.stdout.text.split()[1] == "300"


def test_bytes_in_dev_shm_count_against_the_disk_quota(level: dict[str, Any]) -> None:
    fill = (
        "import os\nn = 0\n"
        "try:\n"
        "    with open('/dev/shm/fill', 'wb') as f:\n"
        "        while n < 64 << 20:\n"
        "            f.write(b'x' * 65536); f.flush(); n += 65536\n"
        "except OSError as e:\n    print('stopped', n, e.errno, flush=True)\n"
        "import time; time.sleep(60)\n"
    )
    with pytest.raises(QuotaExceededError) as info:
        manager().run_in_sandbox(
            [PY, "-c", fill],
            config(
                isolation=level,
                timeout_ms=30_000,
                quotas={"disk_bytes": 8 << 20, "poll_interval_ms": 200},
            ),
        )
    assert info.value.violation.type == ViolationType.DISK_QUOTA_EXCEEDED
    assert info.value.outcome is not None
    stopped = info.value.outcome.result.stdout.text.split()
    assert stopped[0] == "stopped" and int(stopped[1]) <= 8 << 20 and stopped[2] == "28"


# -- network ------------------------------------------------------------------------------------
@pytest.fixture
def host_services() -> Iterator[dict[str, Any]]:
    """A TCP service on the host's loopback, one on all addresses, and an abstract unix
    socket: what a task with --network may and may not reach."""
    loop = socket.create_server(("127.0.0.1", 0))
    wide = socket.create_server(("0.0.0.0", 0))  # noqa: S104 - reachable from the sandbox on purpose
    abstract = socket.socket(socket.AF_UNIX)
    name = f"\0devs-test-{uuid.uuid4().hex[:8]}"
    abstract.bind(name)
    abstract.listen()
    stop = threading.Event()

    def serve(sock: socket.socket, banner: bytes) -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.sendall(banner)

    threads = [
        threading.Thread(target=serve, args=(s, b), daemon=True)
        for s, b in ((loop, b"loopback-service"), (wide, b"wide-service"), (abstract, b"abs"))
    ]
    for t in threads:
        t.start()
    try:
        yield {
            "loopback_port": loop.getsockname()[1],
            "wide_port": wide.getsockname()[1],
            "abstract": name,
        }
    finally:
        stop.set()
        for t in threads:
            t.join(2)
        for s in (loop, wide, abstract):
            s.close()


def _host_address() -> str | None:
    """A non-loopback address of this host that is not copied into the sandbox by pasta
    (pasta gives the sandbox the address of the host's outbound interface): docker0's."""
    r = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=False)
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[1] == "docker0":
            return parts[3].split("/")[0]
    return None


NET_PROBE = """
import json, socket, struct, sys
targets = json.loads(sys.argv[1])
# The default gateway, as the sandbox sees it: pasta maps it to the host unless told not to.
for line in open("/proc/net/route").read().splitlines()[1:]:
    f = line.split()
    if f[1] == "00000000":
        gw = socket.inet_ntoa(struct.pack("<L", int(f[2], 16)))
        targets["gateway"] = ["inet", [gw, targets["loopback"][1][1]]]
out = {}
for name, (family, addr) in targets.items():
    s = socket.socket(socket.AF_UNIX if family == "unix" else socket.AF_INET)
    # The one that should answer gets time for a loaded host; the others fail fast or not.
    s.settimeout(10 if name == "wide" else 2)
    try:
        s.connect(addr if family == "unix" else tuple(addr))
        out[name] = s.recv(64).decode()
    except OSError as e:
        out[name] = "refused: %s" % e
    finally:
        s.close()
print(json.dumps(out))
"""


@pytest.mark.parametrize("network", [False, True], ids=["no-network", "network"])
def test_the_hosts_loopback_and_abstract_sockets_are_out_of_reach(
    level: dict[str, Any], network: bool, host_services: dict[str, Any]
) -> None:
    targets: dict[str, Any] = {
        "loopback": ["inet", ["127.0.0.1", host_services["loopback_port"]]],
        "abstract": ["unix", host_services["abstract"]],
    }
    wide = _host_address()
    if wide is not None:
        targets["wide"] = ["inet", [wide, host_services["wide_port"]]]
        targets["wide-port-on-loopback"] = ["inet", [wide, host_services["loopback_port"]]]
    out = manager().run_in_sandbox(
        [PY, "-c", NET_PROBE, json.dumps(targets)], config(isolation=level, network=network)
    )
    seen = json.loads(out.result.stdout.text)
    assert seen["loopback"].startswith("refused"), seen
    assert seen["abstract"].startswith("refused"), seen
    assert seen.get("gateway", "refused").startswith("refused"), seen
    assert ("gateway" in seen) == network, "a route out only with --network"
    assert "net-namespace" in out.isolation
    if wide is not None:
        assert seen["wide-port-on-loopback"].startswith("refused"), seen
        if network:
            assert "network-pasta" in out.isolation
            assert seen["wide"] == "wide-service", "--network should reach the outside"
        else:
            assert seen["wide"].startswith("refused"), seen


# -- ptrace without a pid namespace -------------------------------------------------------------
@pytest.mark.skipif(not X86_64, reason="raw syscall numbers of x86_64")
def test_without_a_pid_namespace_ptrace_is_refused() -> None:
    victim = subprocess.Popen(["sleep", "60"])
    try:
        calls = {"ptrace-attach": (101, (16, victim.pid, 0, 0))}  # PTRACE_ATTACH
        out = manager().run_in_sandbox(
            [PY, "-c", _syscall_probe(calls)],
            config(isolation={"namespaces": False, **WEAKER, "run_as_user": "current"}),
        )
        assert "seccomp" in out.isolation and "pid-namespace" not in out.isolation
        assert json.loads(out.result.stdout.text) == {"ptrace-attach": 1}
    finally:
        victim.kill()
        victim.wait()


# -- fail closed ----------------------------------------------------------------------------------
def test_a_missing_promised_layer_refuses_the_run_with_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "operator.json"
    cfg.write_text(json.dumps({"sandbox": {"isolation": {"namespaces": False}}}))
    marker = tmp_path / "ran"
    r = run_cli("run", "--config", str(cfg), "--", "touch", str(marker))
    assert r.returncode == 125, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--allow-weaker-isolation" in lines[0], r.stderr
    assert "mount-namespace" in lines[0] and not marker.exists()
    with pytest.raises(WeakerIsolationError):
        manager().run_in_sandbox(["true"], config(isolation={"namespaces": False}))

    allowed = run_cli(
        "run", "--config", str(cfg), "--allow-weaker-isolation", "--", "sh", "-c", "echo ran"
    )
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stdout == "ran\n"
    warn = allowed.stderr.strip().splitlines()
    assert len(warn) == 1 and "weaker isolation" in warn[0] and "net-namespace" in warn[0]
    as_json = run_cli(
        "run", "--config", str(cfg), "--allow-weaker-isolation", "--json", "--", "true"
    )
    doc = json.loads(as_json.stdout)
    assert any(w.startswith("mount-namespace") for w in doc["warnings"]), doc
    assert as_json.stderr == ""


# -- CPU ------------------------------------------------------------------------------------------
CPU_QUOTA = "cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us /sys/fs/cgroup/cpu.max 2>/dev/null"


def _uncapped(quota: str) -> bool:
    """No CFS quota: no cpu cgroup at all (nothing to read), or one without a limit."""
    return not quota.split() or quota.split(maxsplit=1)[0] in {"-1", "max"}


def test_one_runaway_task_gets_one_core_by_default(level: dict[str, Any]) -> None:
    burn = f"{CPU_QUOTA}; for i in 1 2 3; do (while :; do :; done) & done; sleep 3; kill 0"
    out = manager().run_in_sandbox(["sh", "-c", burn], config(isolation=level))
    r = out.result.resources
    assert r.cpu_time_s is not None
    # Three busy loops on a multi-core host would burn up to 3x the wall time; the cap
    # holds 1x (the machine may be busy, so the uncapped case is checked by its quota).
    assert r.cpu_time_s <= 1.3 * out.result.duration_s, (r.cpu_time_s, out.result.duration_s)
    assert out.result.stdout.text.split()[0] == "100000", out.result.stdout.text
    lifted = manager().run_in_sandbox(
        ["sh", "-c", CPU_QUOTA], config(isolation=level, quotas={"cpu_cores": None})
    )
    assert _uncapped(lifted.result.stdout.text), lifted.result.stdout.text


def test_cli_cpus_zero_lifts_the_cap() -> None:
    capped = run_cli("run", "--json", "--", "sh", "-c", CPU_QUOTA)
    lifted = run_cli("run", "--cpus", "0", "--json", "--", "sh", "-c", CPU_QUOTA)
    half = run_cli("run", "--cpus", "0.5", "--json", "--", "sh", "-c", CPU_QUOTA)
    assert json.loads(capped.stdout)["stdout"].split()[0] == "100000", capped.stdout
    assert _uncapped(json.loads(lifted.stdout)["stdout"]), lifted.stdout
    assert json.loads(half.stdout)["stdout"].split()[0] == "50000", half.stdout
    bad = run_cli("run", "--cpus", "-1", "--", "true")
    assert bad.returncode == 125 and "--cpus" in bad.stderr
