"""The ``devs-sandbox`` entry point, and the fast path of ``devs-sandbox run``.

Agents call the CLI once per command, so its start-up is part of every sandboxed run. A
Python process that imports the library (configuration models, drivers, probes) spends
far longer getting ready than the sandbox costs. So ``run`` is handed to a warm local
server (``cli/server.py``) when one answers on this user's socket; this module, which
every invocation executes first, imports only builtin modules for that: no ``socket``,
no ``json``, not even the package's own code.

What crosses the socket: the arguments, the working directory, the environment (the
server applies the same configuration trust rules and environment sanitizer with them)
and the client's stdin, stdout and stderr themselves (SCM_RIGHTS), so output streams
straight from the sandbox to the client's terminal or pipe. The client waits for the exit
status; SIGINT, SIGTERM and SIGHUP are forwarded (the server cancels the sandbox, whose
destroy it owns), and a client that dies cancels it too (the server sees the socket close).

Trust: the socket lives in a directory only this user can enter (``/run/devs-sandbox``
for root, ``$XDG_RUNTIME_DIR`` otherwise, else a 0700 directory in /tmp that must be
ours), both ends check the other's uid (SO_PEERCRED), and the socket's name carries a
fingerprint of the interpreter and of the package's files, so a client never talks to a
server running other code. Anything unusual (no server, a global option such as
``--log-level``, ``DEVS_SANDBOX_DAEMON=0``, a directory not ours) runs the command in
this process instead; a missing server is started in the background for the next call.
"""

import _signal
import _socket
import marshal
import os
import sys

PROTOCOL = 1
DAEMON_ENV = "DEVS_SANDBOX_DAEMON"  # "0": never use or start the local server
RUNTIME_ENV = "DEVS_SANDBOX_RUNTIME_DIR"  # another directory for the socket (tests, packaging)
HEADER_LIMIT = 16 << 20  # a request's arguments and environment, at most
_FRAME_LEN = 4


def main(argv: "list[str] | None" = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--version"]:  # what argparse's version action prints, without argparse
        from devs_sandbox import __version__  # noqa: PLC0415

        sys.stdout.write(f"devs-sandbox {__version__}\n")
        return 0
    # A run placed on a Ray cluster connects from this process: Ray's client belongs to
    # its caller, not to a server shared by every client of this user.
    ray = "--ray-address" in args or "--driver=ray" in args or _pair(args, "--driver", "ray")
    if args[:1] == ["run"] and not ray and os.environ.get(DAEMON_ENV, "1") != "0":
        status = _via_server(args)
        if status is not None:
            return status
    from devs_sandbox.cli.main import main as in_process  # noqa: PLC0415

    return in_process(args)


def _pair(args: "list[str]", flag: str, value: str) -> bool:
    """``flag value`` among the options (before ``--``)."""
    for i, arg in enumerate(args[:-1]):
        if arg == "--":
            return False
        if arg == flag and args[i + 1] == value:
            return True
    return False


# -- where the server listens --------------------------------------------------------------
def fingerprint() -> int:
    """Of this interpreter and every source file of the package: a server only ever serves
    clients of exactly its own code (an edited checkout gets a new server)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    acc = 0
    for text in (sys.version, sys.executable, package):
        for ch in text:
            acc = (acc * 1_000_003 + ord(ch)) & 0xFFFF_FFFF_FFFF_FFFF
    stack = [package]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if entry.is_dir(follow_symlinks=False):
                    if entry.name != "__pycache__":
                        stack.append(entry.path)
                elif entry.name.endswith((".py", ".json")):
                    st = entry.stat(follow_symlinks=False)
                    for value in (st.st_mtime_ns, st.st_size, len(entry.path)):
                        acc = (acc * 1_000_003 + value) & 0xFFFF_FFFF_FFFF_FFFF
    return acc


def runtime_dir() -> "str | None":
    """This user's directory for the socket, made if needed; None when it is not safely
    ours (then the command runs in-process).

    Not platformdirs' user_runtime_dir: importing it costs ~18 ms on a path that imports
    builtins only, it knows nothing of root's /run, and its /tmp fallback is not checked."""
    uid = os.geteuid()
    chosen = os.environ.get(RUNTIME_ENV)
    if chosen and chosen.startswith("/"):
        base, path = os.path.dirname(chosen), chosen
    elif uid == 0:
        base = "/run/devs-sandbox"
        path = base + "/cli"
    else:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        path = (
            (xdg + "/devs-sandbox")
            if xdg and xdg.startswith("/")
            else f"/tmp/devs-sandbox-cli-{uid}"
        )
        base = os.path.dirname(path)
    try:
        os.makedirs(base, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(path)
    except OSError:
        return None
    if st.st_uid != uid or (st.st_mode & 0o077) or (st.st_mode & 0o170000) != 0o040000:
        return None  # somebody else's, or a symlink, or open to others: not a place to talk
    return path


def socket_path(directory: str) -> str:
    return f"{directory}/cli-{fingerprint():016x}.sock"


# -- the client -----------------------------------------------------------------------------
def _frame(obj: "dict[str, object]") -> bytes:
    data = marshal.dumps(obj)
    return len(data).to_bytes(_FRAME_LEN, "big") + data


def _read_frame(sock: "_socket.socket") -> "object | None":
    header = _recv_exact(sock, _FRAME_LEN)
    if header is None:
        return None
    size = int.from_bytes(header, "big")
    if size > HEADER_LIMIT:
        return None
    body = _recv_exact(sock, size)
    return None if body is None else marshal.loads(body)


def _recv_exact(sock: "_socket.socket", size: int) -> "bytes | None":
    chunks = []
    while size:
        try:
            chunk = sock.recv(size)
        except InterruptedError:
            continue
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def peer_uid(sock: "_socket.socket") -> int:
    raw = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)  # struct ucred
    return int.from_bytes(raw[4:8], sys.byteorder)


def _via_server(args: "list[str]") -> "int | None":
    directory = runtime_dir()
    if directory is None:
        return None
    path = socket_path(directory)
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.connect(path)
        if peer_uid(sock) != os.geteuid():
            sock.close()
            return None
    except OSError:
        sock.close()
        _start_server(path)
        return None
    request = {
        "protocol": PROTOCOL,
        "argv": args,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
    }
    fds = b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in (0, 1, 2))
    try:
        sock.sendmsg([_frame(request)], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fds)])
    except OSError:
        sock.close()
        return None
    forwarded = []

    def forward(signum: int, _frame_obj: object) -> None:
        forwarded.append(signum)
        try:
            sock.sendall(_frame({"signal": signum}))
        except OSError:
            pass

    for sig in (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP):
        _signal.signal(sig, forward)
    reply = _read_frame(sock)
    sock.close()
    if isinstance(reply, dict):
        if "exit" in reply:
            return int(reply["exit"])
        if "fallback" in reply:  # declined before touching anything: run it here
            return None
    os.write(2, b"devs-sandbox: lost the local server during the run; its sandbox is destroyed\n")
    return 125


def _start_server(path: str) -> None:
    """Start this user's server in the background for the next call (this one runs in-process)."""
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        try:
            os.posix_spawn(
                sys.executable,
                [sys.executable, "-m", "devs_sandbox.cli.server", path],
                dict(os.environ),
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, devnull, 0),
                    (os.POSIX_SPAWN_DUP2, devnull, 1),
                    (os.POSIX_SPAWN_DUP2, devnull, 2),
                ],
                setsid=True,
            )
        finally:
            os.close(devnull)
    except OSError:
        pass  # no server, then: every call runs in-process, as it would without one
