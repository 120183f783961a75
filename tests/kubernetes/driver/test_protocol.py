"""The exec protocol as the driver speaks it: channel-3 statuses, WebSocket frames over a
real socket pair, the exec loop on top, and the shim's quoting through a real /bin/sh.

No cluster: the "server" side is a socket the test writes frames to, as a kubelet's stream
server would; the shim runs in this host's /bin/sh exactly as it runs in a pod.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devs_sandbox.drivers import exec_io
from devs_sandbox.drivers.kubernetes import shim
from devs_sandbox.drivers.kubernetes.runner import _Process
from devs_sandbox.drivers.kubernetes.transport import (
    OP_BINARY,
    OP_CLOSE,
    OP_PING,
    OP_PONG,
    V4,
    V5,
    ExecChannel,
    FrameDecoder,
    encode_frame,
    parse_status,
)

pytestmark = pytest.mark.kubernetes


def server_frame(opcode: int, payload: bytes, *, fin: bool = True) -> bytes:
    """A frame as a server sends it: unmasked."""
    size = len(payload)
    first = (0x80 if fin else 0) | opcode
    if size < 126:
        return bytes([first, size]) + payload
    if size < 1 << 16:
        return bytes([first, 126]) + size.to_bytes(2, "big") + payload
    return bytes([first, 127]) + size.to_bytes(8, "big") + payload


# -- channel 3 ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("payload", "code", "reason"),
    [
        (b'{"metadata":{},"status":"Success"}', 0, "Success"),
        (
            json.dumps(
                {
                    "status": "Failure",
                    "reason": "NonZeroExitCode",
                    "message": "command terminated with non-zero exit code: 7",
                    "details": {"causes": [{"reason": "ExitCode", "message": "7"}]},
                }
            ).encode(),
            7,
            "NonZeroExitCode",
        ),
        (None, None, "Missing"),
        (b"", None, "Missing"),
        (b"{not json", None, "Malformed"),
        (b'{"status":"Failure","reason":"NonZeroExitCode"}', None, "Malformed"),
        (
            b'{"status":"Failure","reason":"NonZeroExitCode","details":{"causes":'
            b'[{"reason":"ExitCode","message":"300"}]}}',
            None,
            "Malformed",
        ),
        (
            b'{"status":"Failure","reason":"InternalError","message":"error executing command '
            b'in container: container not found"}',
            None,
            "InternalError",
        ),
    ],
    ids=["success", "exit-7", "missing", "empty", "garbage", "no-code", "bad-code", "internal"],
)
def test_channel_3_gives_the_exit_status_and_nothing_else_is_an_exit(
    payload: bytes | None, code: int | None, reason: str
) -> None:
    status = parse_status(payload)
    assert (status.code, status.reason) == (code, reason)
    assert status.lost == (code is None)


# -- frames ---------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [0, 1, 125, 126, 65_535, 65_536, 200_000])
def test_frames_of_every_length_encoding_round_trip(size: int) -> None:
    payload = os.urandom(size)
    decoder = FrameDecoder()
    wire = encode_frame(OP_BINARY, payload)  # ours are masked, as RFC 6455 wants of clients
    assert wire[1] & 0x80
    got: list[tuple[int, bytes]] = []
    for at in range(0, len(wire), 7_001):  # any split of the byte stream
        got += decoder.feed(wire[at : at + 7_001])
    assert got == [(OP_BINARY, payload)]
    assert FrameDecoder().feed(server_frame(OP_BINARY, payload)) == [(OP_BINARY, payload)]


def test_fragmented_messages_are_joined_around_control_frames() -> None:
    wire = (
        server_frame(OP_BINARY, b"\x01hel", fin=False)
        + server_frame(OP_PING, b"p")
        + server_frame(0x0, b"lo", fin=True)
    )
    assert FrameDecoder().feed(wire) == [(OP_PING, b"p"), (OP_BINARY, b"\x01hello")]


# -- the channel over a real socket -------------------------------------------------------
@pytest.fixture
def pair() -> Any:
    client, server = socket.socketpair()
    yield client, server
    for s in (client, server):
        s.close()


def recv_frames(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    decoder = FrameDecoder()
    frames: list[tuple[int, bytes]] = []
    sock.settimeout(5)
    while len(frames) < count:
        frames += decoder.feed(sock.recv(65536))
    return frames


def test_a_channel_reads_output_status_and_the_close_and_answers_pings(pair: Any) -> None:
    client, server = pair
    channel = ExecChannel(client, V5)
    server.sendall(
        server_frame(OP_BINARY, b"\x01out")
        + server_frame(OP_BINARY, b"\x02err")
        + server_frame(OP_PING, b"hi")
        + server_frame(OP_BINARY, b'\x03{"status":"Success"}')
    )
    frames: list[tuple[int, bytes]] = []
    while not channel.status_seen:
        got = channel.read()
        assert got is not None
        frames += got
    assert frames == [(1, b"out"), (2, b"err")]
    assert channel.status.code == 0
    assert recv_frames(server, 1) == [(OP_PONG, b"hi")]
    server.sendall(server_frame(OP_CLOSE, b"\x03\xe8"))
    while channel.read() is not None:
        pass
    assert channel.eof
    assert recv_frames(server, 1)[0][0] == OP_CLOSE  # the close is answered


def test_a_stream_that_ends_without_a_status_is_lost(pair: Any) -> None:
    client, server = pair
    channel = ExecChannel(client, V5)
    server.sendall(server_frame(OP_BINARY, b"\x01partial output"))
    server.shutdown(socket.SHUT_WR)
    seen: list[tuple[int, bytes]] = []
    while (got := channel.read()) is not None:
        seen += got
    assert seen == [(1, b"partial output")]
    assert channel.eof and channel.status.lost and channel.status.reason == "Missing"


def test_stdin_goes_on_channel_0_and_v5_ends_it_by_closing_channel_0(pair: Any) -> None:
    client, server = pair
    channel = ExecChannel(client, V5)
    assert channel.write(memoryview(b"line\n")) == 5
    channel.close()
    assert recv_frames(server, 2) == [(OP_BINARY, b"\x00line\n"), (OP_BINARY, b"\xff\x00")]
    v4 = ExecChannel(socket.socketpair()[0], V4)
    assert not v4.can_close_stdin  # v4 cannot say "end of stdin": the shim counts bytes


def test_the_exec_loop_runs_over_a_channel_to_the_status(pair: Any) -> None:
    """exec_io.run with the channel as source and sink: stdin is fed and closed, output
    arrives, the exit is channel 3's; a kill is requested once the timeout passes."""
    client, server = pair
    channel = ExecChannel(client, V5)

    def kubelet() -> None:
        frames = recv_frames(server, 2)
        assert frames == [(OP_BINARY, b"\x00ping"), (OP_BINARY, b"\xff\x00")]
        server.sendall(server_frame(OP_BINARY, b"\x01pong"))
        server.sendall(server_frame(OP_BINARY, b'\x03{"status":"Success"}'))
        server.sendall(server_frame(OP_CLOSE, b""))

    t = threading.Thread(target=kubelet)
    t.start()
    result = exec_io.run(
        exec_io.ExecIO(
            sources=[channel],
            process=_Process(channel, None),
            stdin=channel,
            stdin_data=b"ping",
            exit_grace_s=0.05,
            exit_poll_s=0.01,
        ),
        timeout_s=20,
        idle_timeout_s=None,
        max_output_bytes=1024,
    )
    t.join(5)
    assert result.exited and not result.killed
    assert result.stdout.text == "pong"
    assert channel.status.code == 0

    killed = threading.Event()
    client2, server2 = socket.socketpair()
    quiet = ExecChannel(client2, V5)
    process = _Process(quiet, killed.set)
    process.on_kill = killed.set
    result = exec_io.run(
        exec_io.ExecIO(sources=[quiet], process=process, kill_grace_s=0.2, exit_poll_s=0.01),
        timeout_s=0.2,
        idle_timeout_s=None,
        max_output_bytes=1024,
    )
    assert result.timed_out and result.killed and killed.wait(5)
    client2.close()
    server2.close()


# -- the shim ---------------------------------------------------------------------------------
PROBE_PY = "import json, os, sys; print(json.dumps([sys.argv[1:], dict(os.environ)]))"
LIMITS = shim.Limits(nproc=4096, nofile=321, fsize_bytes=3 * 512 + 100)


def run_header(header: bytes, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["/bin/sh", "-c", shim.SHIM, shim.SHIM_NAME],
        input=header + stdin,
        capture_output=True,
        timeout=30,
        check=False,
        env={"PATH": os.environ["PATH"]},
    )


def nproc_flag() -> str:
    ok = subprocess.run(["/bin/sh", "-c", "ulimit -u"], capture_output=True, check=False)
    return "-u" if ok.returncode == 0 else "-p"


words = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=24)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    args=st.lists(words, max_size=5),
    env=st.dictionaries(st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True), words, max_size=3),
)
def test_the_header_quotes_any_argument_and_value_exactly(
    args: list[str], env: dict[str, str]
) -> None:
    env = {k: v for k, v in env.items() if k not in ("PATH", "PWD", "N", "IFS", "PS4", "h")}
    header = shim.exec_header(
        nonce="n1",
        argv=[sys.executable, "-c", PROBE_PY, *args],
        env=env,
        limits=LIMITS,
        nproc_flag=nproc_flag(),
        supervisor=False,
    )
    assert header.count(b"\n") == 1  # one line, whatever the arguments hold
    done = run_header(header)
    assert done.returncode == 0, done.stderr
    got_args, got_env = json.loads(done.stdout)
    assert got_args == args
    for key, value in env.items():
        assert got_env[key] == value


def test_the_shim_sets_the_limits_the_cluster_has_no_field_for() -> None:
    header = shim.exec_header(
        nonce="n2",
        argv=["/bin/sh", "-c", f"ulimit -n; ulimit -f; ulimit {nproc_flag()}; ulimit -c"],
        env={"ODD.NAME": "x"},
        limits=LIMITS,
        nproc_flag=nproc_flag(),
        supervisor=False,
        cwd=None,
    )
    done = run_header(header)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [b"321", b"3", b"4096", b"0"]  # -f counts 512-byte blocks


def test_the_shim_refuses_to_run_without_its_limits() -> None:
    impossible = shim.Limits(nproc=10, nofile=1 << 40, fsize_bytes=1 << 20)
    header = shim.exec_header(
        nonce="n3",
        argv=["touch", "/nonexistent/ran"],
        env={},
        limits=impossible,
        nproc_flag=nproc_flag(),
        supervisor=False,
    )
    done = run_header(header)
    assert done.returncode == 125 and b"cannot set the sandbox limits" in done.stderr


def test_stdin_follows_the_header_and_v4_reads_exactly_its_length() -> None:
    cat = ["/bin/sh", "-c", "cat; echo end"]
    common: dict[str, Any] = {"env": {}, "limits": LIMITS, "nproc_flag": nproc_flag()}
    header = shim.exec_header(nonce="a", argv=cat, supervisor=False, stdin=True, **common)
    assert run_header(header, b"one\ntwo").stdout == b"one\ntwoend\n"
    none = shim.exec_header(nonce="b", argv=cat, supervisor=False, **common)
    assert run_header(none, b"ignored").stdout == b"end\n"  # no stdin: /dev/null
    counted = shim.exec_header(
        nonce="c", argv=cat, supervisor=False, stdin=True, stdin_length=3, **common
    )
    assert run_header(counted, b"abcdef").stdout == b"abcend\n"


@pytest.mark.skipif(shutil.which("python3") is None, reason="python3 not on PATH")
def test_the_supervisor_relays_output_keeps_exit_status_and_does_not_wait_for_holders() -> None:
    """A background process holding stdout does not keep the exec (or its status) open;
    a signal death is 128+N; a missing command is 127."""
    header = shim.exec_header(
        nonce="s1",
        argv=["/bin/sh", "-c", "echo out; echo err >&2; (sleep 5 &); exit 7"],
        env={},
        limits=LIMITS,
        nproc_flag=nproc_flag(),
        supervisor=True,
    )
    done = run_header(header)
    assert (done.returncode, done.stdout, done.stderr) == (7, b"out\n", b"err\n")
    killed = shim.exec_header(
        nonce="s2",
        argv=["/bin/sh", "-c", "kill -XFSZ $$"],
        env={},
        limits=LIMITS,
        nproc_flag=nproc_flag(),
        supervisor=True,
    )
    assert run_header(killed).returncode == 128 + 25  # SIGXFSZ is not ignored in the child
    missing = shim.exec_header(
        nonce="s3",
        argv=["no-such-command-here"],
        env={},
        limits=LIMITS,
        nproc_flag=nproc_flag(),
        supervisor=True,
    )
    assert run_header(missing).returncode == 127


def test_samples_and_probes_parse() -> None:
    text = (
        "tasks=9\nsupervisors=1\nmem=1048576\npeak=2097152\noom=1\ncpu_ns=1500000000\n"
        "fs=/workspace 100 90 2000 4096 4000 2000\nfs=/tmp 50 49 0 4096 10 0\n"
        "depth=3\nlargest=12345\n"
    )
    s = shim.parse_sample(text)
    assert s.task_processes == 9 - shim.INFRA_TASKS - 1 - 1
    assert (s.memory_bytes, s.peak_memory_bytes, s.oom_kills) == (1 << 20, 2 << 20, 1)
    assert s.cpu_time_s == 1.5
    assert (s.file_count, s.disk_bytes) == (100 - 90 - 1, 2000 * 4096)
    assert (s.inodes_free, s.disk_free_bytes) == (49, 0)
    assert (s.directory_depth, s.largest_file_bytes) == (3, 12345)
    assert shim.parse_sample("garbage\n").tasks is None
    probe = shim.ProbeInfo.parse("supervisor=1\nnproc=-p\ncgroup=2\nfind=1\nnetwork=none\n")
    assert probe == shim.ProbeInfo(True, "-p", "2", "none", True)
    assert shim.ProbeInfo.from_json(probe.to_json()) == probe
    assert shim.ProbeInfo.from_json("not json") is None
    assert shim.ProbeInfo.parse("nproc=-x\n").nproc_flag == ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _descendants(pid: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(entry.name))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.add(k)
            todo.append(k)
    return out


@pytest.mark.skipif(shutil.which("python3") is None, reason="python3 not on PATH")
def test_killing_one_exec_takes_its_whole_tree_and_nothing_else() -> None:
    """The per-exec kill, proved on this host's kernel: setsid'd and double-forked
    descendants stay the supervisor's (a child subreaper) and die with SIGUSR1 to it; a
    bystander (another exec's process) survives; a kill for an exec that is over is a
    no-op, not a kill of everything."""
    bystander = subprocess.Popen(["sleep", "60"])
    header = shim.exec_header(
        nonce="tree1",
        argv=[
            "/bin/sh",
            "-c",
            "setsid sleep 61 & (sleep 62 &); sh -c 'sleep 63 & sleep 64' & sleep 65",
        ],
        env={},
        limits=LIMITS,
        nproc_flag=nproc_flag(),
        supervisor=True,
    )
    shim_proc = subprocess.Popen(
        ["/bin/sh", "-c", shim.SHIM, shim.SHIM_NAME],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert shim_proc.stdin is not None
        shim_proc.stdin.write(header)
        shim_proc.stdin.close()
        pidfile = Path(f"{shim.PIDFILE_PREFIX}tree1")
        deadline = time.monotonic() + 10
        while len(_descendants(shim_proc.pid)) < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        tree = _descendants(shim_proc.pid)
        assert len(tree) >= 6, tree  # sh, 4 sleeps (one setsid'd, one orphaned), sh -c
        assert int(pidfile.read_text()) == shim_proc.pid  # sh became the supervisor
        kill = subprocess.run(
            ["/bin/sh", "-c", shim.KILL, "kill", "tree1"], check=False, timeout=30
        )
        assert kill.returncode == 0
        assert shim_proc.wait(10) == 137
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not [p for p in tree if _alive(p)]
        assert bystander.poll() is None  # not everything: only that exec's tree
        assert not pidfile.exists()
        again = subprocess.run(
            ["/bin/sh", "-c", shim.KILL, "kill", "tree1"], check=False, timeout=30
        )
        assert again.returncode == 0 and bystander.poll() is None
    finally:
        shim_proc.kill()
        bystander.kill()
        bystander.wait()


# -- what a pod's status means ----------------------------------------------------------------
def _pod(
    phase: str, reason: str = "", message: str = "", term: str | None = None
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase, "reason": reason, "message": message}
    if term is not None:
        status["containerStatuses"] = [{"state": {"terminated": {"reason": term, "exitCode": 137}}}]
    return {"metadata": {"name": "p"}, "status": status}


def test_the_watch_reads_oom_eviction_and_deadline_from_a_pod() -> None:
    from devs_sandbox.drivers.kubernetes.watcher import classify

    oom = classify(_pod("Failed", term="OOMKilled"))
    assert oom.finished and oom.oom and oom.reason == "OOMKilled"
    memory = classify(_pod("Failed", "Evicted", "The node was low on resource: memory."))
    assert memory.oom and not memory.disk_full
    disk = classify(
        _pod("Failed", "Evicted", 'Usage of EmptyDir volume "workspace" exceeds the limit "1Gi".')
    )
    assert disk.disk_full and not disk.oom
    deadline = classify(_pod("Failed", "DeadlineExceeded", "Pod was active too long"))
    assert deadline.finished and not deadline.oom and deadline.reason == "DeadlineExceeded"
    running = classify(
        {
            "metadata": {},
            "status": {"phase": "Running", "containerStatuses": [{"state": {"running": {}}}]},
        }
    )
    assert running.running and not running.finished
