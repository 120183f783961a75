"""Pure logic of the Docker driver: the HostConfig and its validator, and the launcher
protocol's framing. No engine: everything here is data in, data out."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from devs_sandbox.config import SandboxLifecycleConfig, override
from devs_sandbox.drivers.docker import (
    MANDATORY_HOST_CONFIG,
    Demux,
    Trailer,
    build_host_config,
    launcher_request,
    validate_host_config,
)
from devs_sandbox.errors import SecurityConfigError

pytestmark = pytest.mark.unit
MiB = 2**20


def hc(**config: Any) -> dict[str, Any]:
    return build_host_config(override(SandboxLifecycleConfig(), driver="docker", **config))


# -- the HostConfig -------------------------------------------------------------------------
def test_built_config_carries_every_mandatory_setting_and_passes() -> None:
    built = hc(quotas={"memory_bytes": 64 * MiB, "process_count_limit": 32, "cpu_cores": 0.5})
    for key, value in MANDATORY_HOST_CONFIG.items():
        assert built[key] == value
    assert built["Memory"] == built["MemorySwap"] == 64 * MiB
    assert built["PidsLimit"] == 32 + 2  # docker-init and the launcher
    assert built["NetworkMode"] == "none"
    assert built["ReadonlyRootfs"] is True and built["Init"] is True
    assert built["CpuQuota"] == 50_000 and built["CpuPeriod"] == 100_000
    assert "size=" in built["Tmpfs"]["/workspace"] and "nr_inodes=" in built["Tmpfs"]["/workspace"]
    assert "exec" in built["Tmpfs"]["/workspace"].split(",")
    assert {u["Name"] for u in built["Ulimits"]} >= {"nofile", "nproc", "fsize", "core"}
    assert built["LogConfig"]["Type"] == "none"
    validate_host_config(built)


def test_network_is_bridge_only_when_asked() -> None:
    built = hc(network=True)
    assert built["NetworkMode"] == "bridge"
    validate_host_config(built, network_allowed=True)
    with pytest.raises(SecurityConfigError, match="NetworkMode"):
        validate_host_config(built, network_allowed=False)


def test_mandatory_settings_are_not_shared_mutable_state() -> None:
    built = hc()
    built["CapDrop"].append("NET_RAW")
    assert MANDATORY_HOST_CONFIG["CapDrop"] == ["ALL"]
    assert hc()["CapDrop"] == ["ALL"]


DEVIATIONS: list[tuple[str, dict[str, Any] | None, str]] = [
    ("Privileged", {"Privileged": True}, "Privileged"),
    ("Privileged missing", {"Privileged": None}, "Privileged"),
    ("CapDrop missing", {"CapDrop": None}, "CapDrop"),
    ("CapDrop partial", {"CapDrop": ["NET_RAW"]}, "CapDrop"),
    ("CapAdd", {"CapAdd": ["SYS_ADMIN"]}, "CapAdd"),
    ("SecurityOpt missing", {"SecurityOpt": None}, "SecurityOpt"),
    ("SecurityOpt empty", {"SecurityOpt": []}, "no-new-privileges"),
    ("no-new-privileges false", {"SecurityOpt": ["no-new-privileges:false"]}, "SecurityOpt"),
    (
        "seccomp unconfined",
        {"SecurityOpt": ["no-new-privileges:true", "seccomp=unconfined"]},
        "seccomp=unconfined",
    ),
    (
        "apparmor unconfined",
        {"SecurityOpt": ["no-new-privileges:true", "apparmor:unconfined"]},
        "apparmor",
    ),
    ("label disable", {"SecurityOpt": ["no-new-privileges:true", "label=disable"]}, "label"),
    ("writable root", {"ReadonlyRootfs": False}, "ReadonlyRootfs"),
    ("no init", {"Init": False}, "Init"),
    ("no memory cap", {"Memory": 0}, "Memory"),
    ("swap escape", {"MemorySwap": -1}, "MemorySwap"),
    ("oom killer off", {"OomKillDisable": True}, "OomKillDisable"),
    ("no pids limit", {"PidsLimit": None}, "PidsLimit"),
    ("unlimited pids", {"PidsLimit": -1}, "PidsLimit"),
    ("host network", {"NetworkMode": "host"}, "NetworkMode"),
    ("bridge unasked", {"NetworkMode": "bridge"}, "NetworkMode"),
    ("another container's network", {"NetworkMode": "container:abc"}, "NetworkMode"),
    ("host pid namespace", {"PidMode": "host"}, "PidMode"),
    ("host ipc", {"IpcMode": "host"}, "IpcMode"),
    ("host uts", {"UTSMode": "host"}, "UTSMode"),
    ("host userns", {"UsernsMode": "host"}, "UsernsMode"),
    ("host cgroupns", {"CgroupnsMode": "host"}, "CgroupnsMode"),
    ("bind mount", {"Binds": ["/:/host"]}, "Binds"),
    ("docker socket mount", {"Mounts": [{"Source": "/var/run/docker.sock"}]}, "Mounts"),
    ("device", {"Devices": [{"PathOnHost": "/dev/kmsg"}]}, "Devices"),
    ("sysctl", {"Sysctls": {"kernel.shm_rmid_forced": "1"}}, "Sysctls"),
    ("unmasked proc", {"MaskedPaths": []}, "MaskedPaths"),
    ("writable proc", {"ReadonlyPaths": []}, "ReadonlyPaths"),
    ("no workspace tmpfs", {"Tmpfs": {}}, "Tmpfs"),
    ("unbounded workspace", {"Tmpfs": {"/workspace": "rw,exec"}}, "Tmpfs"),
    ("no ulimits", {"Ulimits": None}, "Ulimits"),
    ("no nproc", {"Ulimits": [{"Name": "nofile", "Soft": 1, "Hard": 1}]}, "nproc"),
    ("json log", {"LogConfig": {"Type": "json-file"}}, "LogConfig"),
]


@pytest.mark.parametrize(
    ("change", "needle"), [(d[1], d[2]) for d in DEVIATIONS], ids=[d[0] for d in DEVIATIONS]
)
def test_every_deviation_is_rejected(change: dict[str, Any], needle: str) -> None:
    bad = copy.deepcopy(hc())
    for key, value in change.items():
        if value is None:
            bad.pop(key, None)
        else:
            bad[key] = value
    with pytest.raises(SecurityConfigError, match=needle) as err:
        validate_host_config(bad)
    assert err.value.key is not None and err.value.key.startswith("HostConfig.")
    assert isinstance(err.value, ValueError)  # ConfigError: callers may catch ValueError


def test_all_problems_are_named_at_once() -> None:
    bad = {**hc(), "Privileged": True, "CapDrop": [], "ReadonlyRootfs": False}
    with pytest.raises(SecurityConfigError) as err:
        validate_host_config(bad)
    for key in ("Privileged", "CapDrop", "ReadonlyRootfs"):
        assert key in str(err.value)


# -- the launcher protocol ---------------------------------------------------------------
def test_launcher_request_is_one_line_whatever_the_arguments() -> None:
    req = launcher_request("n0", ["printf", "%s\n", "a'b\nc d", "$HOME `x`"], {"A": "1\n2"})
    assert req.endswith(b"\n") and req.count(b"\n") == 1
    assert req.startswith(b"n0 export A=")
    assert b"</dev/null" in req and b"unset PWD" in req


def test_trailer_is_found_across_chunks_and_stripped() -> None:
    t = Trailer("abc")
    whole = b"hello\n\0devs-exit:abc:042\0late"
    out = b"".join(t.feed(whole[i : i + 3]) for i in range(0, len(whole), 3))
    assert out == b"hello\n" and t.done and t.status == 42
    assert t.feed(b"more") == b""


def test_trailer_holds_back_only_a_possible_prefix() -> None:
    t = Trailer("abc")
    assert t.feed(b"plain text") == b"plain text"  # nothing held: no NUL
    assert t.feed(b"x\0dev") == b"x"
    assert t.feed(b"il") == b"\0devil"  # not the trailer after all
    other = b"\0devs-exit:other:001\0"  # another nonce: output, though its last NUL waits
    assert t.feed(other) == other[:-1]
    assert t.flush() == b"\0" and not t.done


def test_unfinished_trailer_is_flushed_as_output() -> None:
    t = Trailer("abc")
    assert t.feed(b"out\0devs-exit:abc:0") == b"out"
    assert t.flush() == b"\0devs-exit:abc:0" and not t.done


def test_demux_splits_frames_across_reads() -> None:
    d = Demux()
    frame = bytes([1, 0, 0, 0]) + (5).to_bytes(4, "big") + b"hello"
    frame += bytes([2, 0, 0, 0]) + (3).to_bytes(4, "big") + b"err"
    got = [f for i in range(len(frame)) for f in d.feed(frame[i : i + 1])]
    assert got == [(1, b"hello"), (2, b"err")]
