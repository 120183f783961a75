"""Removing a container sandbox: what a failed provision made (and only that), a
destroyed sandbox (stopped, then removed by id, else by name, with its host directory and
lease), orphans whose owner process died (found by label even if the lease is lost), and
background removals in warm-pool mode."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from devs_sandbox.drivers.docker.state import (
    CONTAINER_PREFIX,
    HOST_DIR_PREFIX,
    LABEL_MANAGED,
    LABEL_SANDBOX,
    REMOVE_FLUSH_S,
    Box,
    owner_from_labels,
)
from devs_sandbox.engine import docker_sdk, engine_errors
from devs_sandbox.errors import DevsSandboxError
from devs_sandbox.leases import Lease, Owner
from devs_sandbox.models import validate_sandbox_id

if TYPE_CHECKING:
    from devs_sandbox.drivers.docker.driver import DockerDriver

logger = logging.getLogger(__name__)


class Removal:
    """The removal side of one ``DockerDriver``."""

    def __init__(self, driver: DockerDriver) -> None:
        self.d = driver

    def undo(self, box: Box) -> None:
        """Tear down what a failed provision made, and only that: when the id collided with
        another process's sandbox, its container, directory and lease are not ours."""
        with self.d.lock:
            if self.d.boxes.get(box.id) is box:
                del self.d.boxes[box.id]
        with box.lock:
            sock, box.launcher_sock, box.launcher_keep = box.launcher_sock, None, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        left: list[str] = []
        if box.container_id:
            try:
                self.remove_container(box.container_id)
            except DevsSandboxError as exc:
                left.append(f"container {box.name}: {exc}")
        if box.init_pidfd is not None:
            os.close(box.init_pidfd)
            box.init_pidfd = None
        for cg in box.exec_cgroups:
            left += cg.remove()
        if box.made_dir:
            shutil.rmtree(box.host_dir, ignore_errors=True)
            if box.host_dir.exists():
                left.append(f"{box.host_dir}: still present")
        if box.leased:
            self.settle_lease(box.id, box.host_dir, left)

    def remove_if_ours(self, name: str) -> None:
        """Remove the container called ``name`` if its labels say this process made it."""
        try:
            with engine_errors("inspect container"):
                labels = self.d.client.api.inspect_container(name)["Config"]["Labels"] or {}
            if owner_from_labels(labels) == self.d.owner:
                self.remove_container(name)
        except DevsSandboxError:
            pass

    def finish(self, box: Box) -> None:
        if box.init_pidfd is not None and self.d.alive(box):
            self.d.stop_box(box)  # a stopped container is removed faster than a running one
        left = self.remove_by_id(
            box.id,
            box.host_dir,
            box.container_id or None,
            lease=False,
            container_gone=box.container_removed,
        )
        if box.init_pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(box.init_pidfd)
            box.init_pidfd = None
        for cg in box.exec_cgroups:
            left += cg.remove()
        self.settle_lease(box.id, box.host_dir, left)

    def remove_by_id(
        self,
        sandbox_id: str,
        host_dir: Path,
        container: str | None,
        *,
        lease: bool = True,
        container_gone: bool = False,
    ) -> list[str]:
        """Remove the container (by id, else by name) and the host dir; what could not go."""
        left: list[str] = []
        ref = container or f"{CONTAINER_PREFIX}{sandbox_id}"
        if not container_gone:
            try:
                self.remove_container(ref)
            except DevsSandboxError as exc:
                left.append(f"container {ref}: {exc}")
        if host_dir.exists() or host_dir.is_symlink():
            if host_dir.is_symlink():
                host_dir.unlink()
            else:
                shutil.rmtree(host_dir, ignore_errors=True)
            if host_dir.exists():
                left.append(f"{host_dir}: still present")
        if lease:
            self.settle_lease(sandbox_id, host_dir, left)
        return left

    def settle_lease(self, sandbox_id: str, host_dir: Path, left: list[str]) -> None:
        if left:
            logger.warning("sandbox %s: could not remove %s", sandbox_id, "; ".join(left))
            # Keep the lease but hand it to nobody, so the next reaper retries.
            self.d.leases.write(Lease(sandbox_id, self.d.name, Owner(0, None, ""), str(host_dir)))
        else:
            self.d.leases.remove(sandbox_id)

    def reap_orphans(self) -> list[str]:
        """Remove containers labelled ``devs.managed=true`` whose owner process is gone, and
        docker leases whose owner is gone; never another driver's, never a live owner's."""
        try:
            with engine_errors("list containers"):
                found = self.d.client.api.containers(
                    all=True, filters={"label": f"{LABEL_MANAGED}=true"}
                )
        except DevsSandboxError as exc:
            logger.debug("no docker orphans reaped: %s", exc)
            return []
        with self.d.lock:
            mine = set(self.d.boxes) | self.d.pool.ids()
        reaped: list[str] = []
        for c in found:
            labels = c.get("Labels") or {}
            sandbox_id = str(labels.get(LABEL_SANDBOX) or "")
            if sandbox_id in mine:
                continue
            if owner_from_labels(labels).alive():
                continue
            try:
                sandbox_id = validate_sandbox_id(sandbox_id)
            except DevsSandboxError:  # not one of ours to name a path after: container only
                with contextlib.suppress(DevsSandboxError):
                    self.remove_container(str(c["Id"]))
                    reaped.append(str(c["Id"])[:12])
                continue
            host_dir = self.d.workspace_root / f"{HOST_DIR_PREFIX}{sandbox_id}"
            if not self.remove_by_id(sandbox_id, host_dir, str(c["Id"])):
                reaped.append(sandbox_id)
        for sandbox_id, lease in self.d.leases.orphans(driver=self.d.name):
            if lease is None or sandbox_id in mine or sandbox_id in reaped:
                continue
            if not self.remove_by_id(sandbox_id, Path(lease.workspace), None):
                reaped.append(sandbox_id)
        return reaped

    def remove_container(self, container_id: str) -> None:
        """``docker rm -f``: a container that is already gone (or going) is fine."""
        docker = docker_sdk()
        with engine_errors(f"remove container {container_id[:24]}"):
            try:
                self.d.client.api.remove_container(container_id, force=True)
            except docker.errors.APIError as exc:
                if exc.status_code == 404:
                    return
                if exc.status_code == 409 and "already in progress" in str(exc):
                    return  # another remover (the OOM handler, a reaper) got there first
                raise


class Remover:
    """Removes killed containers in the background (warm-pool mode); ``close`` drains it."""

    def __init__(self, driver: DockerDriver) -> None:
        self.driver = driver
        self._queue: queue.Queue[Box | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, box: Box) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._work, name="devs-docker-remover", daemon=True
                )
                self._thread.start()
        self._queue.put(box)

    def _work(self) -> None:
        while True:
            box = self._queue.get()
            try:
                if box is None:
                    return
                self.driver.removal.finish(box)
            except Exception:
                logger.exception("background removal failed")
            finally:
                self._queue.task_done()

    def close(self) -> None:
        with self._lock:
            thread = self._thread
            self._thread = None
        if thread is None:
            return
        self._queue.put(None)
        thread.join(REMOVE_FLUSH_S)
        if thread.is_alive():
            logger.error("background container removals did not finish in %.0f s", REMOVE_FLUSH_S)
