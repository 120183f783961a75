"""The ray driver's boundary without a cluster: errors, frames and copy-in as they cross,
and the host actor's node-side logic in-process around the fake driver."""

from __future__ import annotations

import contextlib
import io
import pickle
import tarfile
import time
import uuid
from pathlib import Path

import pytest

from devs_sandbox import SandboxLifecycleConfig, override
from devs_sandbox.base import ExecRequest
from devs_sandbox.drivers.fake import FakeDriver, ok_result
from devs_sandbox.drivers.ray.wire import (
    RemoteError,
    StreamWants,
    coalesce,
    host_actor_name,
    pack_directory,
    unpack_directory,
)
from devs_sandbox.errors import (
    ConfigError,
    DriverError,
    IsolationUnavailableError,
    ProvisionError,
    SandboxNotFoundError,
    UnsupportedRuntimeError,
    WeakerIsolationError,
)

pytestmark = pytest.mark.unit


def round_trip(exc: BaseException) -> Exception:
    """What the caller raises for ``exc`` raised on a node (through pickle, as Ray sends)."""
    record = pickle.loads(pickle.dumps(RemoteError.capture(exc)))  # noqa: S301 - our own bytes
    return record.rebuild("Ray node abc")


def test_errors_keep_their_type_and_data_and_name_the_node() -> None:
    weaker = round_trip(WeakerIsolationError({"seccomp": "no libseccomp"}))
    assert type(weaker) is WeakerIsolationError
    assert weaker.missing == {"seccomp": "no libseccomp"}
    assert str(weaker).startswith("Ray node abc: ") and "seccomp" in str(weaker)

    strict = round_trip(IsolationUnavailableError({"cgroup": "read-only /sys"}))
    assert type(strict) is IsolationUnavailableError and strict.missing == {
        "cgroup": "read-only /sys"
    }

    gone = round_trip(SandboxNotFoundError("sb-1", "destroyed"))
    assert isinstance(gone, SandboxNotFoundError) and isinstance(gone, KeyError)
    assert gone.sandbox_id == "sb-1" and "Ray node abc" in str(gone)

    runtime = round_trip(UnsupportedRuntimeError("no go", runtime="go", suggested_driver="docker"))
    assert isinstance(runtime, UnsupportedRuntimeError)
    assert (runtime.runtime, runtime.suggested_driver) == ("go", "docker")

    config = round_trip(ConfigError("bad", key="sandbox.timeoutMs"))
    assert isinstance(config, ConfigError) and config.key == "sandbox.timeoutMs"

    assert type(round_trip(ProvisionError("no space"))) is ProvisionError
    assert type(round_trip(ValueError("bad env"))) is ValueError
    other = round_trip(OSError(28, "No space left on device"))
    assert type(other) is DriverError and "OSError" in str(other)


def test_adjacent_output_frames_of_one_stream_are_merged() -> None:
    frames = [
        ("start", 42),
        ("out", 1, b"a"),
        ("out", 1, b"b"),
        ("out", 2, b"x"),
        ("out", 1, b"c"),
        ("end", None),
    ]
    assert coalesce(frames) == [
        ("start", 42),
        ("out", 1, b"ab"),
        ("out", 2, b"x"),
        ("out", 1, b"c"),
        ("end", None),
    ]


def test_host_actor_names_separate_versions_and_node_drivers() -> None:
    names = {
        host_actor_name("0.1.0", "process", "n1"),
        host_actor_name("0.2.0", "process", "n1"),
        host_actor_name("0.1.0", "docker", "n1"),
        host_actor_name("0.1.0", "process", "n2"),
    }
    assert len(names) == 4


def test_copy_in_round_trips_and_refuses_what_the_workspace_cannot_hold(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "b" / "f.txt").write_text("hello")
    (src / "link").symlink_to("a/b/f.txt")
    data = pack_directory(src, 1 << 20)
    out = tmp_path / "out"
    unpack_directory(data, out)
    assert (out / "a" / "b" / "f.txt").read_text() == "hello"
    assert (out / "link").is_symlink()
    (src / "big").write_bytes(b"x" * 4096)
    with pytest.raises(ConfigError, match="diskBytes"):
        pack_directory(src, 1024)


def test_unpacking_refuses_paths_out_of_the_target(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escaped")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(tarfile.TarError):
        unpack_directory(buf.getvalue(), tmp_path / "target")
    assert not (tmp_path / "escaped").exists()


# -- the host actor's class, in-process (Ray is a dev dependency) -----------------------
def test_host_provisions_with_the_node_driver_and_labels_the_node() -> None:
    from devs_sandbox.drivers.ray.host import SandboxHost

    fake = FakeDriver()
    host = SandboxHost("process", "node-1", driver=fake, backstop=False)
    cfg = override(SandboxLifecycleConfig(), driver="ray", sandbox_id="sb-h1")
    secret = bytearray(b"s3cret-value")
    reply = host.provision(cfg, {"TOKEN": secret}, None, None, 60.0)
    assert reply.error is None
    ctx = reply.value
    assert ctx.id == "sb-h1" and ctx.labels["node"] == "node-1"
    assert fake.sandboxes["sb-h1"].config.driver == "process"  # the node's driver, not "ray"
    assert secret == bytearray(len(secret))  # our copy wiped once the driver took its own
    missing = host.exec("sb-nope", ExecRequest(("true",)))
    assert missing.error is not None and missing.error.kind == "SandboxNotFoundError"
    assert host.destroy("sb-h1").error is None
    assert host.destroy("sb-h1").error is None  # idempotent
    assert fake.destroyed == ["sb-h1"]


def test_host_streams_output_and_start_as_frames_ending_with_the_result() -> None:
    from devs_sandbox.drivers.ray.host import SandboxHost

    fake = FakeDriver(exec_handler=lambda _sb, _cmd: ok_result("out\n", stderr="err\n"))
    host = SandboxHost("process", "node-1", driver=fake, backstop=False)
    cfg = override(SandboxLifecycleConfig(), sandbox_id="sb-h2")
    assert host.provision(cfg, {}, None, None, 60.0).error is None
    fake.sandboxes["sb-h2"].pid = 4242
    wants = StreamWants(stdout=True, stderr=False, start=True)
    frames = [f for batch in host.exec_stream("sb-h2", ExecRequest(("x",)), wants) for f in batch]
    assert frames[0] == ("start", 4242)
    assert ("out", 1, b"out\n") in frames
    assert not any(f[0] == "out" and f[1] == 2 for f in frames)  # stderr not asked for
    assert frames[-1][0] == "end" and frames[-1][1].value.stdout.text == "out\n"
    host.destroy("sb-h2")


def test_backstop_destroys_a_sandbox_past_its_lifetime_plus_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from devs_sandbox.drivers.ray import host as host_module

    fake = FakeDriver()
    host = host_module.SandboxHost("process", "node-1", driver=fake, backstop=False)
    cfg = override(SandboxLifecycleConfig(), sandbox_id="sb-h3")
    assert host.provision(cfg, {}, None, None, 1.0).error is None
    assert host.sweep() == []  # within its lifetime + grace
    later = time.monotonic() + 1.0 + host_module.BACKSTOP_GRACE_S + 1
    monkeypatch.setattr(host_module.time, "monotonic", lambda: later)
    assert host.sweep() == ["sb-h3"]
    assert fake.destroyed == ["sb-h3"] and host.hosted() == []


@pytest.mark.parametrize("by_hand", [False, True], ids=["tarfile-filter", "by-hand"])
def test_unpacking_refuses_escapes_with_or_without_tarfiles_filter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, by_hand: bool
) -> None:
    """Debian bookworm's Python 3.11.2 has no extraction filters: the same rules by hand."""
    if by_hand:
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    elif not hasattr(tarfile, "data_filter"):
        pytest.skip("this Python's tarfile has no extraction filters")

    def archive(*members: tuple[str, str]) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for name, link in members:
                info = tarfile.TarInfo(name)
                if link:
                    info.type, info.linkname = tarfile.SYMTYPE, link
                    tar.addfile(info)
                else:
                    info.size, info.mode = 1, 0o4777
                    tar.addfile(info, io.BytesIO(b"x"))
        return buf.getvalue()

    for bad in (
        archive(("../escaped", "")),
        archive(
            ("up", "../../.."),
        ),
        archive(("out", str(tmp_path)), ("out/file", "")),
    ):
        target = tmp_path / f"t{uuid.uuid4().hex[:6]}"
        with pytest.raises(tarfile.TarError):
            unpack_directory(bad, target)
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "file").exists()
    # An absolute name is refused, or made relative (tarfile's filter): never written there.
    with contextlib.suppress(tarfile.TarError):
        unpack_directory(archive((f"{tmp_path}/abs", "")), tmp_path / "abs-target")
    assert not (tmp_path / "abs").exists()
    good = tmp_path / "good"
    unpack_directory(archive(("dir/f", ""), ("dir/l", "f")), good)
    mode = (good / "dir" / "f").stat().st_mode
    assert (good / "dir" / "l").read_bytes() == b"x"
    assert not mode & 0o7022, oct(mode)  # no setuid/setgid/sticky, no group/other write
