"""The Docker driver: one hardened container per sandbox, on a real engine, through the SDK.

Hardening lives in one place. ``build_host_config`` makes every runtime
HostConfig (CapDrop ALL, no-new-privileges, unprivileged, read-only root, init,
memory with an equal memory-swap, pids limit, CPU quota, no network unless asked,
size- and inode-limited tmpfs workspace, nofile/nproc/fsize/core ulimits, no
json log to fill the host disk), and ``validate_host_config`` rejects any
deviation with ``SecurityConfigError`` right before the create call, whoever
built or amended the config (``host_config_overrides``).

Layout of a sandbox::

    docker-init (pid 1, reaps zombies)
      `-- /bin/sh launcher   (container's stdin, attached by us; serves one request)
    /workspace   tmpfs size=diskBytes nr_inodes=fileCountLimit+1, the working directory
    /tmp         tmpfs size=docker.tmpBytes
    <tmp>/devs-sandbox-<id>/   host side: the copy-in spool and the container id

How a command runs. The first exec that needs no stdin goes through the
launcher: we write one request line (a nonce and a POSIX-quoted command) on its
stdin; it forks a subshell that waits for "go"; we move that subshell into a
cgroup of its own, say "go", and it execs the command; when the command ends the
launcher writes ``\\0devs-exit:<nonce>:<status>\\0`` on stdout and stderr. That
skips the engine's ``runc exec`` (about 45 ms here): a one-shot run costs one
create, start and remove. Every other exec is a ``docker exec`` of the same shim
the process driver uses (wait for "go", then exec), so it too is moved into its
own cgroup before it runs. Either way no output can arrive before we read the
raw stream, and a per-call timeout freezes and SIGKILLs that cgroup: the exec's
whole tree, setsid'd grandchildren included, and nothing else. (The engine has
no API to kill an exec; killing its pid alone would miss the grandchildren.)
Without a writable cgroup tree (not root), a per-call timeout kills the whole
container instead, and ``isolation_report`` says so.

Observation reads the container's cgroup files (memory, pids.events, cpuacct,
memory.oom_control) and its workspace through ``/proc/<init pid>/root``; init is
held by a pidfd, so a recycled pid is never signalled. OOM kills arrive pushed by
the engine (``exhaustion.SandboxManager``), and are remembered here before the
handler removes the container, so the metrics keep reporting them.

One concern per module: ``hardening`` (the HostConfig and its validator), ``launcher``
(the launcher protocol and the attach stream), ``state`` (names, labels, a sandbox's
live state), ``provision`` (plan, create, copy-in), ``execs`` (the exec path and its
cgroups), ``removal`` (undo, destroy, orphans, background removal), ``pool`` (the warm
pool), ``driver`` (``DockerDriver``, which ties them together).

Invariant: ``destroy`` leaves no container, host directory, cgroup or lease; it
is idempotent, works after a partial ``provision`` (by name) and is bounded by
the engine timeout. Every container carries ``devs.managed=true``, its sandbox id
and its owner (pid, start time, boot id), so ``reap_orphans`` finds it even if
the lease file is lost.
"""

from devs_sandbox.drivers.docker.driver import DockerDriver
from devs_sandbox.drivers.docker.hardening import (
    MANDATORY_HOST_CONFIG,
    MECHANISMS,
    build_host_config,
    validate_host_config,
)
from devs_sandbox.drivers.docker.launcher import Demux, Trailer, launcher_request
from devs_sandbox.drivers.docker.state import (
    CONTAINER_PREFIX,
    HOST_DIR_PREFIX,
    LABEL_MANAGED,
    LABEL_SANDBOX,
    WORKSPACE,
    owner_from_labels,
)

__all__ = [
    "CONTAINER_PREFIX",
    "HOST_DIR_PREFIX",
    "LABEL_MANAGED",
    "LABEL_SANDBOX",
    "MANDATORY_HOST_CONFIG",
    "MECHANISMS",
    "WORKSPACE",
    "Demux",
    "DockerDriver",
    "Trailer",
    "build_host_config",
    "launcher_request",
    "owner_from_labels",
    "validate_host_config",
]
