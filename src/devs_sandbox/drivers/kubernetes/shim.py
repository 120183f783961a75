"""What runs inside a sandbox pod for each exec, and how we read what it says.

The exec API has no environment, no limits and no kill: everything per-exec is done by a
POSIX sh shim, sent as the exec's command (constant text), which reads one header line
from the exec's stdin and ``eval``s it. The header (``exec_header``) travels on stdin so
that nothing of it reaches the exec URL (the API server's audit log): it sets the limits
Kubernetes has no field for (``ulimit``: processes, file size, open files, core dumps;
RLIMIT_NPROC holds per sandbox because each sandbox has a uid of its own), exports the
exec's environment, writes the secrets on the first exec (``printf`` is a builtin: the
values are in no argv), changes directory, and execs the supervisor with the command.

The supervisor (``SUPERVISOR``, python3 from the image, ``-I -S``) makes itself a child
subreaper, so every orphaned descendant of the command (double forks, setsid'd
grandchildren) stays its child; it relays the command's output through pipes of its own,
so the exec ends when the command does (a background process holding stdout cannot keep
the exec, and so its exit status, waiting); and on SIGUSR1 (``KILL``, a second exec) it
SIGKILLs its whole tree, round after round until none is left, and exits 137. Without
python3 in the image the command is exec'd directly and a per-exec kill falls back to
``kill -KILL -1`` as the sandbox's uid: every task process, pid 1 spared.

``PROBE`` learns once per pod what its image and node offer; ``SAMPLE`` is the metrics
exec (cgroup counters, task count, tmpfs usage, depth); both print ``key=value`` lines
parsed here. Only builtins run in the loops (a sandbox at its process cap must not make
the sampler's own forks fail).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from devs_sandbox.drivers.kubernetes.manifest import TMP, WORKSPACE
from devs_sandbox.models import ENV_NAME

SHIM_NAME: Final = "devs-sandbox-shim"
SECRETS_DIR: Final = f"{TMP}/.devs-secrets"
PIDFILE_PREFIX: Final = f"{TMP}/.devs-x."
SUPERVISOR_COMM: Final = "devs-supervisor"
EXIT_CANNOT_RUN: Final = 125
INFRA_TASKS: Final = 2  # pid 1 (sh) and its sleep
EXIT_DRAIN_GRACE_S: Final = 0.2  # after the command exits, how long the supervisor relays

# The exec's command. N holds a newline for arguments that contain one ('"$N"').
SHIM: Final = """N='
'
IFS= read -r h || exit 125
eval "$h"
exit 125"""

SUPERVISOR: Final = r"""
import errno, os, select, signal, sys, time
GRACE = @GRACE@
class Kill(Exception):
    pass
def on_usr1(*_):
    raise Kill()
def tree(me):
    kids = {}
    for name in os.listdir('/proc'):
        if not name.isdigit():
            continue
        try:
            with open('/proc/%s/stat' % name, 'rb') as f:
                ppid = int(f.read().rsplit(b')', 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    out, todo = [], [me]
    while todo:
        for k in kids.get(todo.pop(), ()):
            out.append(k)
            todo.append(k)
    return out
def reap():
    got = []
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return got
        if pid == 0:
            return got
        got.append((pid, st))
def kill_all(me):
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    for _ in range(1000):
        found = tree(me)
        if not found:
            return
        for p in found:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        reap()
        time.sleep(0.002)
def main():
    nonce, argv = sys.argv[2], sys.argv[3:]
    me = os.getpid()
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        libc.prctl(36, 1, 0, 0, 0)
        libc.prctl(15, b'devs-supervisor', 0, 0, 0)
    except Exception:
        pass
    pidfile = '/tmp/.devs-x.' + nonce
    try:  # the shim wrote its pid (ours, after exec); a v4 stdin pipeline's is the shell's
        with open(pidfile, 'w') as f:
            f.write('%d\n' % me)
    except OSError:
        pass
    signal.signal(signal.SIGUSR1, on_usr1)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)
            for s in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGUSR1, signal.SIGINT,
                      signal.SIGCHLD):
                signal.signal(s, signal.SIG_DFL)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            for fd in (out_r, out_w, err_r, err_w, wake_r, wake_w):
                os.close(fd)
            os.execvp(argv[0], argv)
        except OSError as e:
            os.write(2, ('%s: %s\n' % (argv[0], e.strerror)).encode())
            os._exit(127 if e.errno == errno.ENOENT else 126)
        os._exit(126)
    os.close(out_w)
    os.close(err_w)
    streams = {out_r: 1, err_r: 2}
    status = end = None
    try:
        while True:
            for p, st in reap():
                if p == pid:
                    status, end = st, time.monotonic() + GRACE
            if status is not None and (not streams or time.monotonic() >= end):
                break
            wait = None if end is None else max(0.0, end - time.monotonic())
            ready = select.select(list(streams) + [wake_r], [], [], wait)[0]
            for fd in ready:
                if fd == wake_r:
                    os.read(wake_r, 512)
                    continue
                data = os.read(fd, 65536)
                if not data:
                    del streams[fd]
                    os.close(fd)
                    continue
                view = memoryview(data)
                while view:
                    try:
                        view = view[os.write(streams[fd], view):]
                    except OSError:
                        break
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        code = (128 + os.WTERMSIG(status)) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    except Kill:
        kill_all(me)
        code = 137
    try:
        os.unlink(pidfile)
    except OSError:
        pass
    os._exit(code)
main()
""".replace("@GRACE@", repr(EXIT_DRAIN_GRACE_S))

# Kill one exec: SIGUSR1 to its supervisor, whose pid the shim wrote first thing (as sh,
# before it became python3). Still starting: wait for it (at most 2 s, then SIGKILL the
# starter, which has no children yet); no pidfile after 0.2 s, or a pid that is no longer
# ours: the exec is over and there is nothing to kill.
KILL: Final = """f=/tmp/.devs-x.$1; i=0
while [ $i -lt 100 ]; do
  if read -r p 2>/dev/null < "$f"; then
    c=; read -r c 2>/dev/null < "/proc/$p/comm"
    case "$c" in
      devs-supervisor) kill -USR1 "$p" 2>/dev/null; exit 0;;
      sh|dash|bash|ash|python3*) ;;
      *) exit 0;;
    esac
  elif [ $i -ge 10 ]; then exit 0
  fi
  sleep 0.02; i=$((i+1))
done
kill -KILL "$p" 2>/dev/null; exit 0"""

# Every task process of the sandbox (kill(2) with -1 spares pid 1 and the caller).
FORCE_STOP: Final = "kill -KILL -1 2>/dev/null; exit 0"

PROBE: Final = """if command -v python3 >/dev/null 2>&1 && python3 -I -S -c '
import ctypes, sys
sys.exit(0 if ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0 else 1)' 2>/dev/null
then echo supervisor=1; py=1; else echo supervisor=0; py=; fi
if ulimit -u >/dev/null 2>&1; then echo nproc=-u
elif ulimit -p >/dev/null 2>&1; then echo nproc=-p; else echo nproc=; fi
if [ -r /sys/fs/cgroup/memory.current ]; then echo cgroup=2
elif [ -r /sys/fs/cgroup/memory/memory.usage_in_bytes ]; then echo cgroup=1
else echo cgroup=; fi
if command -v awk >/dev/null 2>&1 && find /workspace -maxdepth 0 -printf '' >/dev/null 2>&1
then echo find=1; else echo find=0; fi
i=0
while [ "$1" != skip ]; do
  n=0; for x in /sys/class/net/*; do [ -e "$x" ] && n=$((n+1)); done
  if [ "$n" -le 1 ] && [ -e /sys/class/net/lo ]; then echo network=none; break; fi
  if [ -n "$KUBERNETES_SERVICE_HOST" ] && [ -n "$py" ]; then
    python3 -I -S -c '
import os, socket
s = socket.socket(socket.AF_INET6 if ":" in os.environ["KUBERNETES_SERVICE_HOST"]
                  else socket.AF_INET)
s.settimeout(0.3)
try:
    s.connect((os.environ["KUBERNETES_SERVICE_HOST"],
               int(os.environ.get("KUBERNETES_SERVICE_PORT") or 443)))
    print("network=open")
except OSError:
    print("network=blocked")'
    break
  fi
  if [ "$1" != wait ] || [ $i -ge 30 ]; then echo network=unknown; break; fi
  sleep 0.1; i=$((i+1))
done
[ "$1" = skip ] && echo network=unchecked
exit 0"""

SAMPLE: Final = """n=0; s=0
for c in /proc/[0-9]*/task/[0-9]*/comm; do
  read -r x 2>/dev/null < "$c" || continue
  n=$((n+1)); [ "$x" = devs-supervisor ] && s=$((s+1))
done
echo tasks=$n; echo supervisors=$s
g=/sys/fs/cgroup
if [ -r $g/memory.current ]; then
  read -r v < $g/memory.current && echo mem=$v
  [ -r $g/memory.peak ] && read -r v < $g/memory.peak && echo peak=$v
  while read -r k v; do [ "$k" = oom_kill ] && echo oom=$v; done < $g/memory.events
  while read -r k v; do [ "$k" = usage_usec ] && echo cpu_us=$v; done < $g/cpu.stat
elif [ -r $g/memory/memory.usage_in_bytes ]; then
  read -r v < $g/memory/memory.usage_in_bytes && echo mem=$v
  read -r v < $g/memory/memory.max_usage_in_bytes && echo peak=$v
  while read -r k v; do [ "$k" = oom_kill ] && echo oom=$v; done < $g/memory/memory.oom_control
  for f in $g/cpuacct/cpuacct.usage $g/cpu,cpuacct/cpuacct.usage; do
    [ -r $f ] && read -r v < $f && echo cpu_ns=$v && break
  done
fi
stat -f -c 'fs=%n %c %d %a %S %b %f' /workspace /tmp 2>/dev/null
if [ "$1" = 1 ]; then
  t=; command -v timeout >/dev/null 2>&1 && t="timeout $2"
  $t find /workspace -xdev -mindepth 1 \\( -type d -printf 'd %d\\n' \\) \\
    -o \\( -type f -printf 'f %s\\n' \\) 2>/dev/null \\
  | awk '$1=="d"&&$2>d{d=$2} $1=="f"&&$2>s{s=$2} END{print "depth="d+0; print "largest="s+0}'
fi
exit 0"""


# -- the header -----------------------------------------------------------------------------
def sh_quote(text: str) -> str:
    """POSIX single quotes, newlines spliced in from $N so the header stays one line."""
    return "'" + text.replace("'", "'\"'\"'").replace("\n", "'\"$N\"'") + "'"


def _b(value: bytes | bytearray) -> str:
    return bytes(value).decode("utf-8", "surrogateescape")


@dataclass(frozen=True, slots=True)
class Limits:
    """What the shim sets with ``ulimit`` before the command runs."""

    nproc: int
    nofile: int
    fsize_bytes: int

    @property
    def fsize_blocks(self) -> int:
        return max(1, self.fsize_bytes // 512)  # sh's ulimit -f counts 512-byte blocks


def exec_header(
    *,
    nonce: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    limits: Limits,
    nproc_flag: str,
    supervisor: bool,
    cwd: str | None = None,
    stdin: bool = False,
    stdin_length: int | None = None,
    secrets: Mapping[str, bytes | bytearray] | None = None,
) -> bytes:
    """The one line the shim evaluates (see the module docstring). ``stdin_length``: a
    server without the v5 protocol cannot end stdin, so the command reads exactly that
    many bytes through ``head -c``. Secret values must not contain NUL (``secret_writer``
    takes those)."""
    if nproc_flag not in ("-u", "-p"):
        raise ValueError(f"unknown ulimit flag {nproc_flag!r}")
    if not re.fullmatch(r"[A-Za-z0-9-]{1,64}", nonce):
        raise ValueError(f"invalid exec nonce {nonce!r}")
    parts = [f"echo $$ > {PIDFILE_PREFIX}{nonce}"] if supervisor else []
    parts += [
        "ulimit -c 0 2>/dev/null",
        f"{{ ulimit -n {limits.nofile} && ulimit -f {limits.fsize_blocks} && "
        f"ulimit {nproc_flag} {limits.nproc}; }} 2>/dev/null || "
        "{ echo 'devs-sandbox: cannot set the sandbox limits (ulimit)' >&2; exit 125; }",
    ]
    shell_env = {k: v for k, v in env.items() if ENV_NAME.fullmatch(k)}
    other_env = {k: v for k, v in env.items() if k not in shell_env}
    if shell_env:
        parts.append("export " + " ".join(f"{k}={sh_quote(v)}" for k, v in shell_env.items()))
    if secrets:
        writes = " && ".join(
            f'(umask 0277 && printf %s {sh_quote(_b(v))} > "$d/{name}")'
            for name, v in secrets.items()
        )
        parts.append(
            f'd={SECRETS_DIR}; {{ mkdir -p "$d" && chmod 0700 "$d" && {writes} && '
            'chmod 0500 "$d"; } || '
            "{ echo 'devs-sandbox: cannot write the secrets' >&2; exit 125; }"
        )
    if cwd is not None:
        parts.append(f"cd -- {sh_quote(f'{WORKSPACE}/{cwd}')} || exit 1")
    parts.append("unset PWD")
    command = [sh_quote(a) for a in argv]
    if other_env:
        command = ["env", *(sh_quote(f"{k}={v}") for k, v in other_env.items()), *command]
    if supervisor:
        command = [
            "python3",
            "-I",
            "-S",
            "-c",
            sh_quote(SUPERVISOR),
            SUPERVISOR_COMM,
            sh_quote(nonce),
            *command,
        ]
    line = " ".join(command)
    if not stdin:
        parts.append(f"exec {line} </dev/null")
    elif stdin_length is not None:
        parts.append(f"head -c {int(stdin_length)} | {line}")
    else:
        parts.append(f"exec {line}")
    text = "; ".join(parts)
    if "\n" in text:  # only $N may carry newlines; a bare one would end the header early
        raise ValueError("the exec header must be one line")
    return (text + "\n").encode("utf-8", "surrogateescape")


def secret_writer(name: str) -> str:
    """For a secret the header cannot carry (a NUL byte): stdin into the file, 0400."""
    return (
        f'd={SECRETS_DIR}; mkdir -p "$d" && chmod 0700 "$d" && '
        f'(umask 0277 && cat > "$d/{name}") && chmod 0500 "$d"'
    )


# -- what the pod says ----------------------------------------------------------------------
def parse_pairs(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and re.fullmatch(r"[a-z_]+", key):
            if key == "fs":
                out[f"fs:{value.split(' ', 1)[0]}"] = value
            else:
                out.setdefault(key, value.strip())
    return out


@dataclass
class ProbeInfo:
    """What a pod's image and node offer, learned once by ``PROBE``."""

    supervisor: bool = False  # python3 with prctl: a per-exec subreaper
    nproc_flag: str = ""  # the image's /bin/sh: bash/ash "-u", dash "-p"; "" none
    cgroup: str = ""  # "1", "2", or "" (no counters readable in the pod)
    network: str = "unknown"  # "none" (only lo), "blocked", "open" or "unknown"
    find_printf: bool = False  # GNU find and awk: depth and largest file in samples

    @classmethod
    def parse(cls, text: str) -> ProbeInfo:
        kv = parse_pairs(text)
        flag = kv.get("nproc", "")
        return cls(
            supervisor=kv.get("supervisor") == "1",
            nproc_flag=flag if flag in ("-u", "-p") else "",
            cgroup=kv.get("cgroup", "") if kv.get("cgroup") in ("1", "2") else "",
            network=kv.get("network", "unknown"),
            find_printf=kv.get("find") == "1",
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "supervisor": self.supervisor,
                "nprocFlag": self.nproc_flag,
                "cgroup": self.cgroup,
                "network": self.network,
                "findPrintf": self.find_printf,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | None) -> ProbeInfo | None:
        """From a pod's annotation; None when absent or not ours."""
        try:
            data = json.loads(text or "")
            flag = str(data["nprocFlag"])
            return cls(
                supervisor=data["supervisor"] is True,
                nproc_flag=flag if flag in ("-u", "-p") else "",
                cgroup=str(data.get("cgroup") or ""),
                network=str(data.get("network") or "unknown"),
                find_printf=data.get("findPrintf") is True,
            )
        except (ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True, slots=True)
class Sample:
    """One ``SAMPLE`` run, as numbers (None: not readable in this pod)."""

    tasks: int | None = None
    supervisors: int = 0
    memory_bytes: int | None = None
    peak_memory_bytes: int | None = None
    oom_kills: int | None = None
    cpu_time_s: float | None = None
    file_count: int | None = None
    disk_bytes: int | None = None
    inodes_free: int | None = None
    disk_free_bytes: int | None = None
    directory_depth: int | None = None
    largest_file_bytes: int | None = None

    @property
    def task_processes(self) -> int | None:
        """Tasks of the command(s): all of the pod's, less pid 1 and its sleep, the
        supervisors and this sampler's own shell."""
        if self.tasks is None:
            return None
        return max(0, self.tasks - INFRA_TASKS - self.supervisors - 1)


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def parse_sample(text: str) -> Sample:
    kv = parse_pairs(text)
    cpu: float | None = None
    if _int(kv.get("cpu_us")) is not None:
        cpu = (_int(kv.get("cpu_us")) or 0) / 1e6
    elif _int(kv.get("cpu_ns")) is not None:
        cpu = (_int(kv.get("cpu_ns")) or 0) / 1e9
    file_count = disk = inodes_free = disk_free = None
    frees: list[tuple[int, int]] = []
    for mount in (WORKSPACE, TMP):
        fields = (kv.get(f"fs:{mount}") or "").split()
        if len(fields) != 7:
            continue
        try:
            files, ffree, avail, bsize, blocks, bfree = (int(f) for f in fields[1:])
        except ValueError:
            continue
        frees.append((ffree, avail * bsize))
        if mount == WORKSPACE:
            file_count = max(0, files - ffree - 1)  # less the root directory's inode
            disk = (blocks - bfree) * bsize
    if frees:
        inodes_free = min(f[0] for f in frees)
        disk_free = min(f[1] for f in frees)
    return Sample(
        tasks=_int(kv.get("tasks")),
        supervisors=_int(kv.get("supervisors")) or 0,
        memory_bytes=_int(kv.get("mem")),
        peak_memory_bytes=_int(kv.get("peak")),
        oom_kills=_int(kv.get("oom")),
        cpu_time_s=cpu,
        file_count=file_count,
        disk_bytes=disk,
        inodes_free=inodes_free,
        disk_free_bytes=disk_free,
        directory_depth=_int(kv.get("depth")),
        largest_file_bytes=_int(kv.get("largest")),
    )
