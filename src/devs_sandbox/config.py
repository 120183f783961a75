"""``devs.config.json``: one frozen, validated model, from which the JSON Schema is generated.

Keys in the file are camelCase, as the specification names them
(``sandbox.quotas.fileCountLimit``); Python code uses the snake_case attribute
names. Every field has a docstring, a default and a range; a bad value, a string
where a number belongs, or an unknown key raises ``ConfigError`` naming the key.

``SandboxLifecycleConfig`` is both the ``sandbox`` section of the file and the
per-run configuration passed to ``run_in_sandbox``: the CLI and the MCP server
derive a run's config from the file's with :func:`override`, which re-validates.

Size (~680 lines, over the house's ~600): it is the schema itself, one model per section
with a docstring per field (the schema's descriptions are read from them); splitting the
sections over files would only make the schema harder to read whole.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from devs_sandbox.errors import ConfigError
from devs_sandbox.models import ENV_NAME, validate_sandbox_id

CONFIG_FILE_NAME = "devs.config.json"
SCHEMA_FILE_NAME = "devs.config.json.schema"

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

DEFAULT_TIMEOUT_MS = 300_000
DEFAULT_FILE_COUNT_LIMIT = 10_000
DEFAULT_PROCESS_COUNT_LIMIT = 512
DEFAULT_DIRECTORY_DEPTH_LIMIT = 20
DEFAULT_POLL_INTERVAL_MS = 2_000
DEFAULT_MAX_OUTPUT_BYTES = 1 * MiB

# Bounds shared by ``McpConfig``, ``MonitoredShellOptions`` and the MCP tools' input schemas,
# so a value the config file accepts is one a tool call accepts, and the other way round.
MIN_RSS_LIMIT_BYTES = 1 * MiB  # below this even the shim and bwrap (~1-4 MiB) trip it
MIN_POLL_INTERVAL_MS = 10
MAX_POLL_INTERVAL_MS = 60_000
MAX_CPU_SUSTAINED_MS = 86_400_000
MAX_CALL_TIMEOUT_S = 86_400.0  # sandbox.timeoutMs allows one day; a call cannot outlive it

# Isolation mechanisms a run may require (``sandbox.isolation.required``).
Mechanism = Literal[
    "rlimits",
    "cgroup",
    "pid-namespace",
    "net-namespace",
    "mount-namespace",
    "seccomp",
    "tmpfs-workspace",
    "unprivileged-user",
]
# What ``--strict`` requires: everything that makes the kill total and the host unreachable.
STRICT_MECHANISMS: tuple[Mechanism, ...] = (
    "cgroup",
    "pid-namespace",
    "net-namespace",
    "mount-namespace",
    "seccomp",
)
DEFAULT_CPU_CORES = 1.0

DriverName = Literal["process", "docker", "kubernetes", "ray", "fake"]


def ms_from_s(seconds: float) -> int:
    """Seconds (the Python API's unit) as the config's whole milliseconds: rounded up, so a
    budget is never shortened, and at least 1."""
    return max(1, math.ceil(seconds * 1000))


class _Model(BaseModel):
    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        validate_default=True,
    )


class QuotaConfig(_Model):
    """Hard limits of one sandbox. The kernel enforces what it can; the detector polls the rest."""

    file_count_limit: Annotated[StrictInt, Field(ge=1, le=100_000_000)] = DEFAULT_FILE_COUNT_LIMIT
    """Most files and directories the workspace may hold (tmpfs nr_inodes where available)."""

    process_count_limit: Annotated[StrictInt, Field(ge=1, le=4_194_304)] = (
        DEFAULT_PROCESS_COUNT_LIMIT
    )
    """Most processes and threads alive at once (pids cgroup where available)."""

    directory_depth_limit: Annotated[StrictInt, Field(ge=1, le=4096)] = (
        DEFAULT_DIRECTORY_DEPTH_LIMIT
    )
    """Deepest directory nesting allowed below the workspace."""

    max_file_size_bytes: Annotated[StrictInt, Field(ge=1)] = 1 * GiB
    """Largest single file a process may write (RLIMIT_FSIZE)."""

    memory_bytes: Annotated[StrictInt, Field(ge=4 * MiB)] = 2 * GiB
    """Memory cap of the whole sandbox (memory cgroup; RLIMIT_AS only without a cgroup)."""

    disk_bytes: Annotated[StrictInt, Field(ge=1 * MiB)] = 1 * GiB
    """Size of the tmpfs workspace. tmpfs lives in RAM and is charged to the memory cap."""

    cpu_cores: Annotated[float, Field(gt=0, le=1024)] | None = DEFAULT_CPU_CORES
    """CPU bandwidth cap in cores (cpu cgroup quota), 1 by default so one runaway task never
    holds the whole host until its timeout; null leaves CPU uncapped (`--cpus 0`)."""

    max_open_files: Annotated[StrictInt, Field(ge=16, le=1_048_576)] = 1024
    """RLIMIT_NOFILE of every process in the sandbox."""

    address_space_bytes: Annotated[StrictInt, Field(ge=16 * MiB)] | None = None
    """Explicit RLIMIT_AS; by default only set when no memory cgroup is available."""

    poll_interval_ms: Annotated[StrictInt, Field(ge=10, le=600_000)] = DEFAULT_POLL_INTERVAL_MS
    """How often the resource drain detector samples each sandbox."""

    growth_lookahead_ticks: Annotated[StrictInt, Field(ge=0, le=100)] = 2
    """Growth rule: terminate early when the current trend crosses a limit within this many
    ticks; 0 disables the growth rule and leaves only the threshold rule."""

    growth_min_samples: Annotated[StrictInt, Field(ge=2, le=100)] = 3
    """Growth rule: how many consecutive growing samples make a sustained trend."""

    growth_metrics: tuple[Literal["fileCount", "processCount"], ...] = ("fileCount",)
    """Growth rule: which counts it watches. Process count is off by default: builds spawn
    short bursts of processes, and the pids cgroup already holds that line."""

    depth_scan_budget_ms: Annotated[StrictInt, Field(ge=1, le=60_000)] = 200
    """Most time one tick may spend walking the workspace for depth and file sizes."""

    @property
    def poll_interval_s(self) -> float:
        return self.poll_interval_ms / 1000

    @property
    def depth_scan_budget_s(self) -> float:
        return self.depth_scan_budget_ms / 1000


class IsolationConfig(_Model):
    """Which host mechanisms the process driver uses, and which a run refuses to go without."""

    required: tuple[Mechanism, ...] = ()
    """Mechanisms without which a run refuses to start (exit 125); --strict adds the four
    that make the kill total and the host unreachable."""

    run_as_user: Literal["auto", "current", "nobody"] | Annotated[StrictInt, Field(ge=1)] = "auto"
    """Uid the sandbox runs as. "auto": as root, a uid of its own per sandbox (from
    1600000000 up), so sandboxes cannot read or signal each other even without namespaces
    (docker: the image's non-root USER if it names one, else nobody); otherwise the
    caller's. "nobody": 65534 for every sandbox. "current": the caller's uid. A number:
    that uid for every sandbox."""

    tmpfs_workspace: StrictBool = True
    """Mount the workspace as a tmpfs sized by quotas.diskBytes and quotas.fileCountLimit
    when the host allows (root)."""

    namespaces: StrictBool = True
    """Give each sandbox its own pid, mount, network, ipc, uts and cgroup namespaces (host
    read-only, private /tmp, no network): through bubblewrap, or unshare(2) where bwrap is
    missing or cannot create them. false needs allowWeakerIsolation."""

    use_bwrap: StrictBool = True
    """Prefer bubblewrap for the namespaces when it works here; false uses our unshare(2)
    launcher (as root, or in a user namespace of the caller's)."""

    seccomp: StrictBool = True
    """Filter the sandbox's syscalls (keyrings, new user namespaces, io_uring, bpf,
    perf_event_open, userfaultfd, mounts, kexec, ...) as Docker's default profile does.
    false needs allowWeakerIsolation."""

    allow_weaker_isolation: StrictBool = False
    """Run even when a layer the defaults promise (namespaces, the syscall filter) cannot be
    had here; each missing layer is then named in the run's warnings. Only an operator
    config or --allow-weaker-isolation can set it."""

    use_cgroups: StrictBool = True
    """Use a cgroup per sandbox (memory, pids, cpu, freezer) when the host allows."""

    hide_paths: tuple[str, ...] = ("/home", "/root", "/run/user", "/var/run/docker.sock")
    """Host paths replaced by an empty tmpfs (or hidden) inside a mount namespace."""

    @field_validator("hide_paths")
    @classmethod
    def _absolute(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for p in v:
            if not p.startswith("/"):
                raise ValueError(f"hide path {p!r} must be absolute")
        return v


class EnvironmentConfig(_Model):
    """Host environment passed through the sanitizer into sandboxes and external tools."""

    extra_allow: tuple[str, ...] = ()
    """Extra host variable names (or NAME* prefixes) to pass through; the deny rule still wins."""

    extra_deny: tuple[str, ...] = ()
    """Extra host variable names (or NAME* prefixes) never to pass through."""


class DockerConfig(_Model):
    """The docker driver: where its image comes from, the warm pool, container-only limits."""

    default_image: str | None = None
    """Image used when sandbox.image is null; null = the image rebuilt offline from the recipe
    shipped with devs-sandbox (devs-sandbox/default, Debian minbase with python3)."""

    fallback_images: tuple[str, ...] = ()
    """Images tried in order, local ones only, when the requested image is neither present nor
    pullable; after them the default image is rebuilt (see rebuildDefaultImage)."""

    pull: StrictBool = True
    """Try `docker pull` for an image that is not present locally (bounded by pullTimeoutS)."""

    pull_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    """Most seconds one pull may take before it is abandoned: an unreachable registry may
    fail at once (no DNS) or never answer (a dropped route)."""

    rebuild_default_image: StrictBool = True
    """As the last resort, build the default image on this host without a registry
    (debootstrap, as root; about a minute once, then cached)."""

    warm_pool_size: Annotated[StrictInt, Field(ge=0, le=64)] = 0
    """Containers created and started ahead of time per configuration, so a run skips the
    engine's create and start (about 250 ms); 0 disables. Runs with a fixed sandboxId never
    take a pooled container."""

    tmp_bytes: Annotated[StrictInt, Field(ge=1 * MiB, le=64 * GiB)] = 64 * MiB
    """Size of the container's /tmp tmpfs (the root filesystem is read-only). Like the
    workspace it lives in RAM and is charged to the memory cap."""


_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class KubernetesConfig(_Model):
    """The kubernetes driver: which cluster and namespace, what runs the pods, the warm pool.
    (Several of these choose the isolation itself: runtimeClassName, hostUsers, the
    namespace, the image, verifyNetworkIsolation; see docs/deploy/kubernetes.md.)"""

    kubeconfig: Path | None = None
    """Kubeconfig file; null = $KUBECONFIG, else ~/.kube/config, else the pod's service
    account when devs-sandbox itself runs in a cluster."""

    context: str | None = None
    """Kubeconfig context; null = its current-context."""

    namespace: str | None = None
    """Namespace of every pod, NetworkPolicy and Lease the driver makes; null = the
    context's namespace, else (in a cluster) the pod's own, else "default"."""

    image: str = "python:3.12-slim"
    """Image of the sandbox pods when sandbox.image is null. It needs /bin/sh, and python3
    for the per-exec supervisor (without it, an exec timeout kills every task process of
    the sandbox, not only that exec's)."""

    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """The pods' imagePullPolicy."""

    runtime_class_name: str | None = None
    """RuntimeClass of the pods ("gvisor", "kata", ...): a kernel of their own under each
    sandbox; null = the cluster's default runtime (runc, the node's kernel)."""

    host_users: StrictBool = True
    """false: a user namespace per pod (hostUsers: false; Kubernetes 1.30+ and a runtime
    that supports it): uids in the pod map to an unprivileged range of its own on the node."""

    app_armor: StrictBool = False
    """Name the runtime's default AppArmor profile in the pod (appArmorProfile on 1.30+,
    the annotation before): the kubelet then refuses to run it on a node without AppArmor
    rather than run it without. (Nodes with AppArmor apply that profile either way.)"""

    node_selector: dict[str, str] = Field(default_factory=dict)
    """Labels a node must carry to run the sandboxes (e.g. the nodes with gVisor)."""

    warm_pool_size: Annotated[StrictInt, Field(ge=0, le=64)] = 0
    """Pods created, started and checked ahead of time per configuration, claimed with one
    conflict-checked patch and refilled in the background; 0 disables. Runs with a fixed
    sandboxId or copyIn never take a pooled pod."""

    tmp_bytes: Annotated[StrictInt, Field(ge=1 * MiB, le=64 * GiB)] = 64 * MiB
    """Size of the pod's /tmp and /dev/shm (Memory emptyDirs, charged to the memory cap)."""

    start_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 120.0
    """Most seconds from create until the pod runs (scheduling, image pull). A pod that
    cannot be scheduled or pulled is reported earlier, with the cluster's reason."""

    api_timeout_s: Annotated[float, Field(gt=0, le=600)] = 30.0
    """Most seconds one API request (and an exec's WebSocket handshake) may take."""

    deadline_margin_s: Annotated[StrictInt, Field(ge=1, le=86_400)] = 60
    """The pod's activeDeadlineSeconds is sandbox.timeoutMs plus this: the kubelet's
    backstop behind our own total timeout, should this process die."""

    lease_duration_s: Annotated[StrictInt, Field(ge=2, le=3600)] = 30
    """Validity of this process's owner Lease, renewed every third of it. A lease left
    unrenewed twice this long (once more for clock skew) is expired: the reaper deletes it,
    its pods and policies."""

    verify_network_isolation: StrictBool = True
    """Before a pod without network is used, check from inside it that the deny-all
    NetworkPolicy holds (only loopback, or the API server unreachable); refuse otherwise.
    false trusts the policy: a CNI that ignores NetworkPolicy leaves the network open."""

    @field_validator("namespace")
    @classmethod
    def _valid_namespace(cls, v: str | None) -> str | None:
        if v is not None and not _DNS1123_LABEL.fullmatch(v):
            raise ValueError(f"invalid namespace {v!r}: a lowercase RFC 1123 label")
        return v

    @field_validator("image")
    @classmethod
    def _valid_image(cls, v: str) -> str:
        if not v.strip() or any(c.isspace() for c in v):
            raise ValueError(f"invalid image reference {v!r}")
        return v


# A Ray custom resource name, as `ray start --resources` takes it.
RAY_RESOURCE_PATTERN: Final = r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$"


class RayConfig(_Model):
    """The ray driver: which cluster, what confines a sandbox on its node, how capacity is
    counted. Each field decides where a sandbox's command, files and secrets go or what
    confines them there: only an operator config should set them."""

    address: Annotated[str, Field(min_length=1, max_length=512)] = "auto"
    """Ray cluster to place sandboxes on: "auto" (the cluster this process belongs to:
    $RAY_ADDRESS, or the one started on this host with `ray start`), "local" (start a
    one-node Ray inside this process, to try it out), or HOST:PORT. Inside a Ray task or
    actor the cluster it runs in is used, whatever this says."""

    node_driver: Literal["process", "docker"] = "process"
    """What confines a sandbox on its node: that node's process driver (namespaces,
    cgroups, seccomp, tmpfs, own uid) or its docker driver. The sandbox's quotas, isolation
    and docker settings apply on the node as they would locally; a node that cannot give
    a promised layer refuses, as a local run would."""

    slot_resource: Annotated[str, Field(pattern=RAY_RESOURCE_PATTERN)] = "devs_sandbox_slots"
    """Ray custom resource a sandbox holds one unit of while it lives: a node holds as many
    sandboxes as it declares (`ray start --resources '{"devs_sandbox_slots": 8}'`). When
    every slot is taken a new sandbox waits for one, at most the total timeout."""

    namespace: Annotated[str, Field(min_length=1, max_length=128)] = "devs-sandbox"
    """Ray namespace of the host actors (one per node and nodeDriver)."""

    connect_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 60.0
    """Most seconds to connect to the cluster, and to start a node's host actor."""


class SandboxLifecycleConfig(_Model):
    """One sandbox run: driver, timeouts, quotas, isolation. Also the file's ``sandbox``."""

    driver: DriverName = "process"
    """Backend that runs the sandbox: "process" (this host), "docker", "kubernetes" (a pod
    of a cluster), or "ray" (a node of a Ray cluster, confined there by sandbox.ray.nodeDriver)."""

    sandbox_id: str | None = None
    """Fixed id for the sandbox (letters, digits, '.', '_', '-'; at most 64); null = random."""

    timeout_ms: Annotated[StrictInt, Field(ge=1, le=86_400_000)] = DEFAULT_TIMEOUT_MS
    """Total time budget of a run, preflight included; on expiry every process is SIGKILLed."""

    preflight_timeout_ms: Annotated[StrictInt, Field(ge=1, le=86_400_000)] = 60_000
    """Time budget of all preflight commands together."""

    idle_timeout_ms: Annotated[StrictInt, Field(ge=1, le=86_400_000)] | None = None
    """Kill a run that prints nothing on stdout or stderr for this long; null disables."""

    preflight_commands: tuple[str, ...] = ()
    """Shell commands (sh -c) run in the sandbox before the task; the first failure aborts."""

    max_output_bytes: Annotated[StrictInt, Field(ge=64, le=1 * GiB)] = DEFAULT_MAX_OUTPUT_BYTES
    """Bytes kept of each of stdout and stderr (head and tail); the middle is counted, not kept."""

    env: dict[str, str] = Field(default_factory=dict)
    """Variables set in the sandbox on top of the minimal environment."""

    network: StrictBool = False
    """Give the sandbox the host's network; false = loopback only (net namespace)."""

    copy_in: Path | None = None
    """Directory whose contents seed the workspace."""

    image: str | None = None
    """Container image for the docker and kubernetes drivers; null = docker.defaultImage,
    kubernetes.image."""

    fallback_driver: Literal["docker"] | None = None
    """When a command needs a runtime (python, node, go, rust) that the configured driver
    does not provide, run it with this driver instead; null = refuse with exit 125."""

    docker: DockerConfig = Field(default_factory=DockerConfig)
    """Docker driver settings."""

    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig)
    """Kubernetes driver settings."""

    ray: RayConfig = Field(default_factory=RayConfig)
    """Ray driver settings."""

    quotas: QuotaConfig = Field(default_factory=QuotaConfig)
    """Hard limits."""

    isolation: IsolationConfig = Field(default_factory=IsolationConfig)
    """Host isolation mechanisms."""

    # The Python API speaks seconds; the file speaks the specification's milliseconds.
    @property
    def timeout_s(self) -> float:
        return self.timeout_ms / 1000

    @property
    def idle_timeout_s(self) -> float | None:
        return None if self.idle_timeout_ms is None else self.idle_timeout_ms / 1000

    @property
    def preflight_timeout_s(self) -> float:
        return self.preflight_timeout_ms / 1000

    @field_validator("sandbox_id")
    @classmethod
    def _valid_id(cls, v: str | None) -> str | None:
        return None if v is None else validate_sandbox_id(v)

    @field_validator("env")
    @classmethod
    def _valid_env(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not ENV_NAME.fullmatch(name):
                raise ValueError(
                    f"invalid environment variable name {name!r}: use letters, digits and '_'"
                )
        for value in v.values():
            if "\0" in value:
                raise ValueError("environment values cannot contain NUL")
        return v

    @field_validator("preflight_commands")
    @classmethod
    def _nonempty(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(not c.strip() for c in v):
            raise ValueError("preflight commands cannot be empty")
        return v


class StoreConfig(_Model):
    """Where violations are recorded."""

    path: Path | None = None
    """SQLite file; null = $DEVS_SANDBOX_DB, else $XDG_DATA_HOME/devs-sandbox/devs.db."""


class McpConfig(_Model):
    """Defaults of the MCP server's tools (each call may override the run_shell_monitored and
    sandbox_exec ones), and the life of the sandboxes agents keep between calls."""

    rss_limit_bytes: Annotated[StrictInt, Field(ge=MIN_RSS_LIMIT_BYTES)] = 4 * GiB
    """run_shell_monitored, sandbox_exec: kill when the command's process tree RSS exceeds this.
    The sandbox's own memory cap (sandbox.quotas.memoryBytes) still holds underneath."""

    cpu_sustained_ms: Annotated[StrictInt, Field(ge=1, le=MAX_CPU_SUSTAINED_MS)] = 10_000
    """run_shell_monitored, sandbox_exec: kill after this long at or above 100% of one core."""

    poll_interval_ms: Annotated[
        StrictInt, Field(ge=MIN_POLL_INTERVAL_MS, le=MAX_POLL_INTERVAL_MS)
    ] = 1_000
    """run_shell_monitored, sandbox_exec: sampling interval of the RSS and CPU monitor."""

    timeout_s: Annotated[float, Field(gt=0, le=MAX_CALL_TIMEOUT_S)] = 300.0
    """run_shell_monitored and sandbox_exec: default per-call timeout."""

    max_output_bytes: Annotated[StrictInt, Field(ge=64, le=1 * GiB)] = 64 * KiB
    """run_shell_monitored and sandbox_exec: default bytes kept of each of stdout and stderr
    (head and tail), sized for an agent's context; a call may ask for up to
    sandbox.maxOutputBytes."""

    max_timeout_s: Annotated[float, Field(gt=0, le=MAX_CALL_TIMEOUT_S)] = 3_600.0
    """Most an agent may ask for in a call's timeout_s; the tools refuse more. (The
    sandbox's quotas cap memory, processes and disk whatever a call asks; time has only
    this.)"""

    session_idle_timeout_s: Annotated[float, Field(gt=0, le=86_400)] = 900.0
    """Destroy an agent's sandbox after this long without a call."""

    session_timeout_s: Annotated[float, Field(gt=0, le=MAX_CALL_TIMEOUT_S)] = 3_600.0
    """Destroy an agent's sandbox this long after it was created, whatever it is doing. At most
    one day: it is the sandbox's total timeout (sandbox.timeoutMs), which stops there."""

    max_sessions: Annotated[StrictInt, Field(ge=1, le=1_000)] = 16
    """Most sandboxes one server keeps alive at once: the agents' sessions plus the
    run_shell_monitored calls in flight."""

    max_sessions_per_client: Annotated[StrictInt, Field(ge=1, le=1_000)] | None = None
    """Most of those one MCP client session may hold at once, so that over HTTP one client
    cannot take every slot from the others. Unset: no share, any client may use all of
    maxSessions."""

    @model_validator(mode="after")
    def _default_within_max(self) -> McpConfig:
        if self.timeout_s > self.max_timeout_s:
            raise ValueError(
                f"timeoutS ({self.timeout_s:g}) must not exceed "
                f"maxTimeoutS ({self.max_timeout_s:g})"
            )
        return self


class DevsConfig(_Model):
    """The whole ``devs.config.json``."""

    schema_: str | None = Field(default=None, alias="$schema")
    """Optional path or URL of the JSON Schema, for editors."""

    sandbox: SandboxLifecycleConfig = Field(default_factory=SandboxLifecycleConfig)
    """Defaults of every sandbox run."""

    store: StoreConfig = Field(default_factory=StoreConfig)
    """Violation store."""

    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    """Host environment sanitizer."""

    mcp: McpConfig = Field(default_factory=McpConfig)
    """MCP server defaults."""


def _format_errors(exc: ValidationError, prefix: str = "") -> tuple[str, str | None]:
    """One line naming the first bad key (in camelCase, as written in the file)."""
    parts: list[str] = []
    first_key: str | None = None
    for err in exc.errors():
        # Name keys as they are written in the file (camelCase), whichever side we validated.
        loc = ".".join(to_camel(p) if isinstance(p, str) else str(p) for p in err["loc"])
        key: str = f"{prefix}{loc}" if loc else (prefix.rstrip(".") or "(root)")
        if first_key is None:
            first_key = key
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        given = err.get("input")
        shown = "" if err["type"] == "missing" else f" (got {given!r})"
        if isinstance(given, dict):
            shown = ""
        parts.append(f"{key}: {msg}{shown}")
    return "; ".join(parts), first_key


def parse_config(data: Any, *, source: str = "config") -> DevsConfig:
    """Validate already-decoded JSON into a ``DevsConfig``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a JSON object", key="(root)")
    try:
        return DevsConfig.model_validate(data)
    except ValidationError as exc:
        msg, key = _format_errors(exc)
        raise ConfigError(f"{source}: {msg}", key=key) from None


def read_config_file(path: Path | str) -> Any:
    """The decoded JSON of one config file; ``ConfigError`` naming the file otherwise."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}", key="--config") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}", key="--config") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}",
            key="(root)",
        ) from None
    return data


def override(config: SandboxLifecycleConfig, **changes: Any) -> SandboxLifecycleConfig:
    """A copy of ``config`` with ``changes`` (snake_case; ``quotas``, ``isolation``, ``docker``,
    ``kubernetes`` and ``ray`` as dicts merged into the existing ones), re-validated so an
    override cannot smuggle in a bad value.
    """
    data = config.model_dump()
    for key in ("quotas", "isolation", "docker", "kubernetes", "ray"):
        if key in changes:
            nested = changes.pop(key)
            if isinstance(nested, BaseModel):
                nested = nested.model_dump()
            data[key] = {**data[key], **nested}
    data.update(changes)
    try:
        return SandboxLifecycleConfig.model_validate(data)
    except ValidationError as exc:
        msg, bad_key = _format_errors(exc, prefix="sandbox.")
        raise ConfigError(msg, key=bad_key) from None


def _attribute_docstrings() -> dict[str, dict[str, str]]:
    """Each model's fields' docstrings (class name -> field -> text), read from this module's
    source with ``ast``: what pydantic's ``use_attribute_docstrings`` would do, but only when
    the schema is generated, not on every import (it cost ~35 ms of each CLI start)."""
    import ast  # noqa: PLC0415 - schema generation only
    import inspect  # noqa: PLC0415

    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    docs: dict[str, dict[str, str]] = {}
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        fields: dict[str, str] = {}
        for prev, node in zip(cls.body, cls.body[1:], strict=False):
            if (
                isinstance(prev, ast.AnnAssign)
                and isinstance(prev.target, ast.Name)
                and isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                fields[prev.target.id] = inspect.cleandoc(node.value.value)
        docs[cls.name] = fields
    return docs


def config_json_schema() -> dict[str, Any]:
    """The JSON Schema of ``devs.config.json``, generated from the models (never hand-edited)."""
    schema = DevsConfig.model_json_schema(by_alias=True, mode="validation")
    docs = _attribute_docstrings()
    for name, definition in [("DevsConfig", schema), *schema.get("$defs", {}).items()]:
        model = globals().get(name)
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        props = definition.get("properties", {})
        for field, info in model.model_fields.items():
            text = docs.get(name, {}).get(field)
            key = info.alias or field
            if text and key in props and "description" not in props[key]:
                props[key]["description"] = text
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "devs.config.json"
    return schema


def render_schema() -> str:
    return json.dumps(config_json_schema(), indent=2, sort_keys=True) + "\n"


APP_NAME: Final = "devs-sandbox"
_XDG_USER_DIRS: Final = {
    "data": ("XDG_DATA_HOME", ".local/share"),
    "config": ("XDG_CONFIG_HOME", ".config"),
}


def user_dir(kind: Literal["data", "config"], env: Mapping[str, str] | None = None) -> Path:
    """This user's devs-sandbox data or config directory, by the XDG base directory spec.

    Our own process's environment is platformdirs' business (its Unix flavour on every OS,
    so macOS keeps the XDG paths it has always had). An explicit ``env`` is another
    process's: the warm server computes paths for its client's environment, and
    platformdirs reads ``os.environ`` only, so that case is resolved here the same way
    (a relative or empty XDG_* is ignored, as the spec says; tests check that both agree).
    """
    if env is None:
        from platformdirs.unix import Unix  # noqa: PLC0415  # lazy: ~18 ms of imports

        unix = Unix(APP_NAME)
        return Path(unix.user_data_dir if kind == "data" else unix.user_config_dir)
    var, fallback = _XDG_USER_DIRS[kind]
    base = env.get(var, "")
    if not base.startswith("/"):
        home = env.get("HOME", "")
        base = str((Path(home) if home.startswith("/") else Path.home()) / fallback)
    return Path(base) / APP_NAME


def default_db_path(env: Mapping[str, str] | None = None) -> Path:
    """$DEVS_SANDBOX_DB, else the XDG data directory (of ``env``, default ours)."""
    explicit = (os.environ if env is None else env).get("DEVS_SANDBOX_DB")
    if explicit:
        return Path(explicit)
    return user_dir("data", env) / "devs.db"
