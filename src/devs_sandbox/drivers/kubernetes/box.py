"""The driver's private state of one sandbox pod, and what is fixed per configuration."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from devs_sandbox.config import SandboxLifecycleConfig
from devs_sandbox.drivers.kubernetes.manifest import Manifest, PodPolicy
from devs_sandbox.drivers.kubernetes.shim import Limits, ProbeInfo, Sample
from devs_sandbox.drivers.kubernetes.watcher import PodState, classify
from devs_sandbox.security.session_keys import Redactor

INFRA_PROCESSES = 3  # pid 1, its sleep, the exec's supervisor: counted by RLIMIT_NPROC


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything a pod is made from apart from its own names and uid."""

    config: SandboxLifecycleConfig
    policy: PodPolicy
    limits: Limits
    template: Manifest  # built for a placeholder id: its shape names the warm pool

    @property
    def shape(self) -> str:
        return self.template.shape

    @classmethod
    def of(cls, config: SandboxLifecycleConfig, template: Manifest) -> Plan:
        q = config.quotas
        # The kernel holds forks at limit + 1 task processes, so the drain detector's
        # threshold (count > limit) sees the attempt; pid 1, its sleep and the supervisor
        # run as the same uid and count too.
        limits = Limits(
            nproc=q.process_count_limit + 1 + INFRA_PROCESSES,
            nofile=q.max_open_files,
            fsize_bytes=q.max_file_size_bytes,
        )
        return cls(config, PodPolicy.of(config), limits, template)


@dataclass
class Box:
    """Live state of one sandbox, private to the driver."""

    id: str
    name: str  # the pod's
    plan: Plan
    uid: int
    isolation: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    probe: ProbeInfo | None = None
    pod_uid: str = ""
    state: PodState = field(default_factory=PodState)
    changed: threading.Event = field(default_factory=threading.Event)
    oom_events: int = 0
    disk_full: bool = False
    gone: bool = False  # the pod object was deleted
    stopped: bool = False  # force_stop killed every task process
    last: Sample | None = None
    peak_processes: int = 0
    secrets: dict[str, bytearray] = field(default_factory=dict)
    redactor: Redactor | None = None
    secret_env: dict[str, str] = field(default_factory=dict)
    secrets_pending: bool = False
    secrets_lock: threading.Lock = field(default_factory=threading.Lock)
    lock: threading.Lock = field(default_factory=threading.Lock)
    exec_seq: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    @property
    def config(self) -> SandboxLifecycleConfig:
        return self.plan.config

    @property
    def dead(self) -> bool:
        """Nothing can run in it any more (finished, or deleted)."""
        return self.gone or self.state.finished

    def observe(self, pod: Mapping[str, Any]) -> tuple[PodState, PodState]:
        """Take the pod's latest object; (previous state, new state)."""
        new = classify(pod)
        with self.lock:
            old, self.state = self.state, new
            uid = (pod.get("metadata") or {}).get("uid")
            if uid:
                self.pod_uid = str(uid)
            if new.oom and not old.oom:
                self.oom_events += 1
            if new.disk_full:
                self.disk_full = True
        self.changed.set()
        return old, new
