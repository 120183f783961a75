"""Making a container sandbox: its user, its HostConfig and environment (the plan, whose
hash is its warm-pool shape), then lease, host directory, create, start and attach, each
step recorded on the box so that a failure undoes exactly what was made; and seeding the
workspace (``copy_in``)."""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from devs_sandbox.base import ExecRequest
from devs_sandbox.config import SandboxLifecycleConfig
from devs_sandbox.drivers.docker.hardening import build_host_config, validate_host_config
from devs_sandbox.drivers.docker.launcher import LAUNCHER, LAUNCHER_NAME, raw_socket
from devs_sandbox.drivers.docker.state import (
    EXEC_START_TIMEOUT_S,
    LABEL_MANAGED,
    LABEL_OWNER_BOOT,
    LABEL_OWNER_PID,
    LABEL_OWNER_START,
    LABEL_POOL,
    LABEL_SANDBOX,
    TMP,
    WORKSPACE,
    Box,
    Plan,
    is_container_pid,
    pidfd,
    wait_child,
)
from devs_sandbox.drivers.linux import DEFAULT_PATH
from devs_sandbox.engine import engine_errors, is_not_found
from devs_sandbox.errors import ProvisionError
from devs_sandbox.images import ResolvedImage
from devs_sandbox.isolation import NOBODY_GID, NOBODY_UID
from devs_sandbox.isolation.cgroups import SandboxCgroup, cgroup_dirs_of
from devs_sandbox.leases import Lease
from devs_sandbox.workspace import WorkspaceScanner

if TYPE_CHECKING:
    from devs_sandbox.drivers.docker.driver import DockerDriver

COPY_SPOOL_BYTES: Final = 8 * 1024 * 1024  # copy-in tar kept in memory below this


class Provisioner:
    """The provision side of one ``DockerDriver``."""

    def __init__(self, driver: DockerDriver) -> None:
        self.d = driver

    def user(
        self, config: SandboxLifecycleConfig, image: ResolvedImage | None
    ) -> tuple[str, int | None, int | None]:
        """(the container's User, its numeric uid and gid when known)."""
        want = config.isolation.run_as_user
        if want == "current":
            return f"{os.geteuid()}:{os.getegid()}", os.geteuid(), os.getegid()
        if isinstance(want, int):
            return f"{want}:{want}", want, want
        configured = image.user if image is not None else ""
        if configured and configured.split(":")[0] not in {"0", "root"}:
            uid_text, _, gid_text = configured.partition(":")
            if uid_text.isdigit():
                uid = int(uid_text)
                gid = int(gid_text) if gid_text.isdigit() else uid
                return f"{uid}:{gid}", uid, gid
            return configured, None, None  # a name only the image's passwd resolves
        return f"{NOBODY_UID}:{NOBODY_GID}", NOBODY_UID, NOBODY_GID

    def plan(self, config: SandboxLifecycleConfig) -> Plan:
        image = self.d.resolve_image(config)
        user, uid, gid = self.user(config, image)
        pids_ok = bool(self.d.engine_info().get("PidsLimit", True))
        hc = build_host_config(config, uid=uid, gid=gid, pids_limit_supported=pids_ok)
        hc.update(self.d.host_config_overrides)
        validate_host_config(hc, network_allowed=config.network)
        host_env = os.environ
        env = {
            "PATH": DEFAULT_PATH,
            "HOME": WORKSPACE,
            "LANG": host_env.get("LANG") or "C.UTF-8",
            "TERM": host_env.get("TERM") or "dumb",
            "TMPDIR": TMP,
            **config.env,
        }
        shape = hashlib.sha256(
            json.dumps(
                [image.image_id, user, hc, env, sorted(self.d.extra_labels.items())],
                sort_keys=True,
                default=str,
            ).encode()
        ).hexdigest()[:16]
        return Plan(config, image, user, uid, gid, hc, env, shape)

    def labels(self, box: Box, pool: bool) -> dict[str, str]:
        owner = self.d.owner
        labels = {
            **self.d.extra_labels,
            LABEL_MANAGED: "true",
            LABEL_SANDBOX: box.id,
            LABEL_OWNER_PID: str(owner.pid),
            LABEL_OWNER_START: str(owner.start_ticks or ""),
            LABEL_OWNER_BOOT: owner.boot_id,
        }
        if pool:
            labels[LABEL_POOL] = box.plan.shape
        return labels

    def create(self, box: Box, *, pool: bool = False) -> None:
        """Lease, host dir, create, start, attach; each step recorded on ``box`` for _undo."""
        plan = box.plan
        if self.d.leases.is_live(box.id):
            raise ProvisionError(f"sandbox id {box.id} is in use by a live process")
        # The lease comes first, so a crash at any later step leaves a findable orphan.
        self.d.leases.write(Lease(box.id, self.d.name, self.d.owner, str(box.host_dir)))
        box.leased = True
        try:
            box.host_dir.mkdir(mode=0o700)
        except FileExistsError:
            raise ProvisionError(
                f"{box.host_dir} already exists (sandbox id in use? run `devs-sandbox cleanup`)"
            ) from None
        box.made_dir = True
        # Checked again here, on the final dict, right before the engine sees it.
        validate_host_config(plan.host_config, network_allowed=plan.config.network)
        api = self.d.client.api
        env = [f"{k}={v}" for k, v in {**plan.env, "DEVS_SANDBOX_ID": box.id}.items()]
        untyped: Any = api  # the stubs want a HostConfig object; the API takes the dict
        with engine_errors(f"create container {box.name}"):
            create = untyped.create_container_config(
                plan.image.image_id,
                ["/bin/sh", "-c", LAUNCHER, LAUNCHER_NAME],
                hostname="sandbox",
                user=plan.user,
                stdin_open=True,
                environment=env,
                working_dir=WORKSPACE,
                labels=self.labels(box, pool),
                stop_signal="SIGKILL",
                host_config=plan.host_config,
            )
            create["StdinOnce"] = False  # the SDK sets it with stdin_open; detaching must not
            # close the launcher's stdin (that would stop the container)
            try:
                created = untyped.create_container_from_config(create, name=box.name)
            except Exception as exc:
                if is_not_found(exc):
                    self.d.forget_image()  # the resolved image vanished: resolve it again
                else:  # a timeout may hide a container that was made after all
                    self.d.removal.remove_if_ours(box.name)
                raise
        box.container_id = str(created["Id"])
        with self.d.lock:
            self.d.by_container[box.container_id] = box.id
        with engine_errors(f"start container {box.name}"):
            api.start(box.container_id)
            state = api.inspect_container(box.container_id)["State"]
        init_pid = int(state.get("Pid") or 0)
        if not state.get("Running") or init_pid <= 0:
            raise ProvisionError(
                f"container {box.name} did not start: {state.get('Error') or state}"
            )
        box.init_pid = init_pid
        box.init_pidfd = pidfd(init_pid)
        if box.init_pidfd is not None and not is_container_pid(init_pid, box.container_id):
            raise ProvisionError(f"container {box.name} exited right after it started")
        # docker-init's only child is the launcher; without it every exec is a docker exec.
        box.launcher_pid = wait_child(init_pid, EXEC_START_TIMEOUT_S)
        support = self.d.cgroups
        if support.available:
            dirs = cgroup_dirs_of(init_pid, support)
            wanted = {
                k: v for k, v in dirs.items() if k in {"memory", "pids", "cpuacct", "unified"}
            }
            if wanted:
                box.cgroup = SandboxCgroup(support, box.id, dirs=wanted)
            if not self.d.exec_cgroup_reason():
                for ctrl in ("unified", "freezer", "pids"):
                    if ctrl in dirs and os.access(dirs[ctrl], os.W_OK):
                        box.exec_parent = {ctrl: dirs[ctrl]}
                        break
        if box.launcher_pid is not None:
            with engine_errors(f"attach to {box.name}"):
                params = {"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
                box.launcher_keep = api.attach_socket(box.container_id, params=params)
                box.launcher_sock = raw_socket(box.launcher_keep)
        root = Path(f"/proc/{init_pid}/root{WORKSPACE}")
        box.scanner = WorkspaceScanner(
            root, budget_s=plan.config.quotas.depth_scan_budget_ms / 1000
        )
        (box.host_dir / "container-id").write_text(box.container_id + "\n")

    def copy_in(self, box: Box, source: Path) -> None:
        """Seed the workspace through tar in the container, as the sandbox user, so the
        tmpfs limits apply and ownership is right (the engine cannot copy into a tmpfs)."""
        if not source.is_dir():
            raise ProvisionError(f"--copy-in {source}: not a directory")
        with tempfile.SpooledTemporaryFile(
            max_size=COPY_SPOOL_BYTES, dir=str(box.host_dir)
        ) as spool:
            with tarfile.open(fileobj=spool, mode="w") as tar:
                for entry in sorted(source.iterdir()):
                    tar.add(entry, arcname=entry.name, recursive=True)
            spool.seek(0)
            result = self.d.execs.run(
                box,
                ExecRequest(("tar", "-x", "-o", "-f", "-", "-C", WORKSPACE)),
                stdin_file=spool,
                launcher=False,
            )
        if result.exit_code != 0:
            raise ProvisionError(
                f"--copy-in {source}: tar in the container exited {result.exit_code} "
                "(more files than quotas.fileCountLimit or bytes than quotas.diskBytes? "
                f"no tar in the image?): {result.stderr.text.strip()[-300:]}"
            )
