"""The process driver: sandboxes made of host processes, layered with whatever the host offers.

Layers, each detected and reported (``SandboxContext.isolation``):
- ``rlimits`` always: RLIMIT_FSIZE, NOFILE, CORE=0; NPROC and AS only as fallbacks
  (RLIMIT_NPROC is per uid and ignored for root; RLIMIT_AS turns an OOM into a
  MemoryError and breaks runtimes that reserve address space);
- ``cgroup`` (v2 or v1) when writable: the memory and pids caps, CPU accounting,
  and the total kill;
- ``pid-namespace``, ``mount-namespace``, ``net-namespace`` through bubblewrap, or our
  unshare(2) launcher where bwrap cannot (``isolation/nsinit``);
- ``seccomp``: a deny-list filter of kernel surfaces a task has no business with;
- ``tmpfs-workspace`` when root: the workspace's bytes and inodes capped by the kernel;
- ``unprivileged-user``: as root, each sandbox runs as a uid of its own.

How a command starts, without ``preexec_fn`` (unsafe with our watchdog threads): see
``spawn``. One concern per module:

- ``state``: a sandbox's live state (``Box``) and the plan it was made from;
- ``plan``: who it runs as, which mechanism gives each layer, refusals;
- ``areas``: its private root (workspace, /tmp, /var/tmp, /dev/shm, secrets, copy-in);
- ``spawn``: one exec's launch (shim, bwrap or nsinit argv, environment, rlimits, fds);
- ``network``: pasta for ``--network``;
- ``usage``: metrics and per-exec resource use, from the cgroup and the tmpfs;
- ``reaper``: removal by id and orphan reaping;
- ``driver``: ``ProcessDriver``, which drives them through the exec loop
  (``drivers/exec_io``).

Invariant: ``destroy`` leaves no process, cgroup, mount, directory or lease, is
idempotent, works after a partial ``provision`` and after a crash (by id).
"""

from devs_sandbox.drivers.linux import DEFAULT_PATH
from devs_sandbox.drivers.process.driver import ProcessDriver
from devs_sandbox.drivers.process.state import (
    MECHANISMS,
    NAMESPACES,
    PROMISED,
    SECRETS_DIR_IN_WORKSPACE,
    WORKSPACE_PREFIX,
)

__all__ = [
    "DEFAULT_PATH",
    "MECHANISMS",
    "NAMESPACES",
    "PROMISED",
    "SECRETS_DIR_IN_WORKSPACE",
    "WORKSPACE_PREFIX",
    "ProcessDriver",
]
