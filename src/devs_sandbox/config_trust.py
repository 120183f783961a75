"""Where configuration comes from, and what a file the workload brings may change.

Layers, lowest to highest precedence:

1. the built-in defaults (``config.py``);
2. the host's ``/etc/devs-sandbox/config.json``;
3. the user's ``$XDG_CONFIG_HOME/devs-sandbox/config.json`` (``~/.config/...``);
4. an explicit ``--config PATH``, else ``$DEVS_SANDBOX_CONFIG``;
5. ``./devs.config.json`` in the working directory, read only when no explicit file was
   given: the one layer a workload can bring (agents run ``cd repo && devs-sandbox
   run ...`` in repositories they just cloned, and MCP servers start in project
   directories), so it is **untrusted**: it may only tighten.

Layers 1-4 are the operator's and merge key by key (objects deeply, lists and values
replace). The untrusted file is merged on top, and every key it sets is judged against
the operator's value by that key's rule (``RULES``: lower numbers, more hidden paths,
more required mechanisms are tighter; the user, namespaces, network, images, copy-in,
the store and the host variables let in are the operator's alone). One weakening key
refuses the whole file: ``UntrustedConfigError`` names the key and the file, and the
CLI exits 125. Every leaf of the model has a rule; a unit test walks the model so a
new field cannot forget one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Final

from pydantic import BaseModel

from devs_sandbox.config import (
    CONFIG_FILE_NAME,
    DevsConfig,
    parse_config,
    read_config_file,
    user_dir,
)
from devs_sandbox.errors import ConfigError, UntrustedConfigError

SYSTEM_CONFIG: Final = Path("/etc/devs-sandbox/config.json")
ENV_SYSTEM_CONFIG: Final = "DEVS_SANDBOX_SYSTEM_CONFIG"  # another host file (packaging, tests)
ENV_CONFIG: Final = "DEVS_SANDBOX_CONFIG"
DEFAULT_SOURCE: Final = "default"
OPERATOR_SOURCES: Final = (
    "--config, DEVS_SANDBOX_CONFIG, ~/.config/devs-sandbox/config.json, "
    "/etc/devs-sandbox/config.json"
)


class Rule(StrEnum):
    """How a key set by an untrusted file compares with the operator's value."""

    FREE = "free"  # anything: it acts inside the sandbox only
    LOWER = "lower"  # a number that may only go down (None = unlimited, the loosest)
    HIGHER = "higher"  # a number that may only go up (a look-ahead where 0 disables)
    SUPERSET = "superset"  # a list that may only grow (hidden paths, required mechanisms)
    SUBSET = "subset"  # a list that may only shrink (host variables let in)
    TRUE_TIGHT = "true-tight"  # a switch that may only be turned on
    FALSE_TIGHT = "false-tight"  # a switch that may only be turned off
    OPERATOR = "operator"  # the operator's alone: any change is refused


# One line per leaf of DevsConfig, by its camelCase path; tests/unit/test_config_trust.py
# fails when a field has none. Non-obvious choices say why.
RULES: Final[Mapping[str, Rule]] = {
    "$schema": Rule.FREE,
    "sandbox.driver": Rule.OPERATOR,  # a repository must not pick the boundary it runs in
    "sandbox.sandboxId": Rule.OPERATOR,  # a fixed id could collide with another sandbox
    "sandbox.timeoutMs": Rule.LOWER,
    "sandbox.preflightTimeoutMs": Rule.LOWER,
    "sandbox.idleTimeoutMs": Rule.LOWER,
    "sandbox.preflightCommands": Rule.FREE,  # run inside the sandbox, like the task
    "sandbox.maxOutputBytes": Rule.LOWER,
    "sandbox.env": Rule.FREE,  # the sandbox's own environment; host variables are apart
    "sandbox.network": Rule.FALSE_TIGHT,
    "sandbox.copyIn": Rule.OPERATOR,  # a repository could copy ~/.ssh into the sandbox
    "sandbox.image": Rule.OPERATOR,
    "sandbox.fallbackDriver": Rule.OPERATOR,
    "sandbox.docker.defaultImage": Rule.OPERATOR,
    "sandbox.docker.fallbackImages": Rule.OPERATOR,
    "sandbox.docker.pull": Rule.FALSE_TIGHT,
    "sandbox.docker.pullTimeoutS": Rule.LOWER,
    "sandbox.docker.rebuildDefaultImage": Rule.FALSE_TIGHT,
    "sandbox.docker.warmPoolSize": Rule.LOWER,  # containers kept running on the host
    "sandbox.docker.tmpBytes": Rule.LOWER,
    # Which cluster, namespace, image and runtime a pod gets: the operator's alone.
    "sandbox.kubernetes.kubeconfig": Rule.OPERATOR,
    "sandbox.kubernetes.context": Rule.OPERATOR,
    "sandbox.kubernetes.namespace": Rule.OPERATOR,
    "sandbox.kubernetes.image": Rule.OPERATOR,
    "sandbox.kubernetes.imagePullPolicy": Rule.OPERATOR,
    "sandbox.kubernetes.runtimeClassName": Rule.OPERATOR,
    "sandbox.kubernetes.nodeSelector": Rule.OPERATOR,
    "sandbox.kubernetes.hostUsers": Rule.FALSE_TIGHT,  # false: a user namespace per pod
    "sandbox.kubernetes.appArmor": Rule.TRUE_TIGHT,
    "sandbox.kubernetes.verifyNetworkIsolation": Rule.TRUE_TIGHT,
    "sandbox.kubernetes.warmPoolSize": Rule.LOWER,  # pods kept running in the cluster
    "sandbox.kubernetes.tmpBytes": Rule.LOWER,
    "sandbox.kubernetes.startTimeoutS": Rule.LOWER,
    "sandbox.kubernetes.apiTimeoutS": Rule.LOWER,
    "sandbox.kubernetes.deadlineMarginS": Rule.LOWER,  # the activeDeadlineSeconds backstop
    "sandbox.kubernetes.leaseDurationS": Rule.LOWER,  # a dead owner's pods go sooner
    # Which cluster, and what confines a sandbox on its node: the operator's alone.
    "sandbox.ray.address": Rule.OPERATOR,
    "sandbox.ray.nodeDriver": Rule.OPERATOR,
    "sandbox.ray.slotResource": Rule.OPERATOR,
    "sandbox.ray.namespace": Rule.OPERATOR,
    "sandbox.ray.connectTimeoutS": Rule.LOWER,
    "sandbox.quotas.fileCountLimit": Rule.LOWER,
    "sandbox.quotas.processCountLimit": Rule.LOWER,
    "sandbox.quotas.directoryDepthLimit": Rule.LOWER,
    "sandbox.quotas.maxFileSizeBytes": Rule.LOWER,
    "sandbox.quotas.memoryBytes": Rule.LOWER,
    "sandbox.quotas.diskBytes": Rule.LOWER,
    "sandbox.quotas.cpuCores": Rule.LOWER,
    "sandbox.quotas.maxOpenFiles": Rule.LOWER,
    # null is not "unlimited" here: without a cgroup RLIMIT_AS then follows memoryBytes.
    "sandbox.quotas.addressSpaceBytes": Rule.OPERATOR,
    # Both ways cost the operator: faster polling burns the host's CPU outside the
    # sandbox's cgroup, slower polling watches less.
    "sandbox.quotas.pollIntervalMs": Rule.OPERATOR,
    "sandbox.quotas.growthLookaheadTicks": Rule.HIGHER,  # 0 disables the growth rule
    "sandbox.quotas.growthMinSamples": Rule.LOWER,
    "sandbox.quotas.growthMetrics": Rule.SUPERSET,
    "sandbox.quotas.depthScanBudgetMs": Rule.OPERATOR,  # host CPU per tick, or less seen
    "sandbox.isolation.required": Rule.SUPERSET,
    "sandbox.isolation.runAsUser": Rule.OPERATOR,
    "sandbox.isolation.tmpfsWorkspace": Rule.TRUE_TIGHT,
    "sandbox.isolation.namespaces": Rule.TRUE_TIGHT,
    "sandbox.isolation.useBwrap": Rule.TRUE_TIGHT,  # the mechanism is the operator's choice
    "sandbox.isolation.seccomp": Rule.TRUE_TIGHT,
    "sandbox.isolation.allowWeakerIsolation": Rule.FALSE_TIGHT,
    "sandbox.isolation.useCgroups": Rule.TRUE_TIGHT,
    "sandbox.isolation.hidePaths": Rule.SUPERSET,
    "store.path": Rule.OPERATOR,  # the audit trail
    "environment.extraAllow": Rule.SUBSET,  # host variables let into the sandbox
    "environment.extraDeny": Rule.SUPERSET,
    "mcp.rssLimitBytes": Rule.LOWER,
    "mcp.cpuSustainedMs": Rule.LOWER,
    "mcp.pollIntervalMs": Rule.OPERATOR,  # as sandbox.quotas.pollIntervalMs
    "mcp.timeoutS": Rule.LOWER,
    "mcp.maxOutputBytes": Rule.LOWER,
    "mcp.maxTimeoutS": Rule.LOWER,
    "mcp.sessionIdleTimeoutS": Rule.LOWER,
    "mcp.sessionTimeoutS": Rule.LOWER,
    "mcp.maxSessions": Rule.LOWER,
    # One HTTP client's share of maxSessions: null (no share) is the loosest.
    "mcp.maxSessionsPerClient": Rule.LOWER,
}


def _unlimited(value: Any) -> float:
    return float("inf") if value is None else float(value)


_CHECKS: Final[dict[Rule, Callable[[Any, Any], bool]]] = {
    Rule.FREE: lambda old, new: True,
    Rule.LOWER: lambda old, new: _unlimited(new) <= _unlimited(old),
    Rule.HIGHER: lambda old, new: _unlimited(new) >= _unlimited(old),
    Rule.SUPERSET: lambda old, new: set(new or ()) >= set(old or ()),
    Rule.SUBSET: lambda old, new: set(new or ()) <= set(old or ()),
    Rule.TRUE_TIGHT: lambda old, new: bool(new) or new == old,
    Rule.FALSE_TIGHT: lambda old, new: not new or new == old,
    Rule.OPERATOR: lambda old, new: new == old,
}


def is_tighter_or_equal(rule: Rule, operator_value: Any, file_value: Any) -> bool:
    return _CHECKS[rule](operator_value, file_value)


# -- the model's leaves ------------------------------------------------------------------------
def leaf_paths(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    """Every leaf of ``model`` by its camelCase path; nested models are walked, dicts and
    lists are leaves."""
    for name, info in model.model_fields.items():
        key = prefix + (info.alias or name)
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from leaf_paths(annotation, key + ".")
        else:
            yield key


def _flatten(data: Any, prefix: str = "", *, leaves: frozenset[str]) -> dict[str, Any]:
    """The leaves set in a JSON object (as written in a file, camelCase)."""
    out: dict[str, Any] = {}
    if not isinstance(data, dict):
        return out
    for key, value in data.items():
        path = prefix + key
        if path in leaves or not isinstance(value, dict):
            out[path] = value
        else:
            out.update(_flatten(value, path + ".", leaves=leaves))
    return out


def _deep_merge(
    base: dict[str, Any], top: Mapping[str, Any], *, leaves: frozenset[str], prefix: str = ""
) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        path = prefix + key
        old = merged.get(key)
        if path not in leaves and isinstance(value, dict) and isinstance(old, dict):
            merged[key] = _deep_merge(old, value, leaves=leaves, prefix=path + ".")
        else:
            merged[key] = value
    return merged


def _leaf_values(config: DevsConfig) -> dict[str, Any]:
    dumped = config.model_dump(mode="json", by_alias=True)
    return {key: _value_at_dump(dumped, key) for key in leaf_paths(DevsConfig)}


def _value_at_dump(node: Any, path: str) -> Any:
    for part in path.split("."):
        node = node[part] if isinstance(node, dict) else None
    return node


def _value_at(config: DevsConfig, path: str) -> Any:
    node: Any = config.model_dump(mode="json", by_alias=True)
    for part in path.split("."):
        node = node[part] if isinstance(node, dict) else None
    return node


# -- loading ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadedConfig:
    """The effective configuration and, per leaf (camelCase path), where its value came from."""

    config: DevsConfig
    sources: dict[str, str] = field(default_factory=dict)
    untrusted: Path | None = None  # the working directory's file, when one was applied

    def source(self, key: str) -> str:
        return self.sources.get(key, DEFAULT_SOURCE)


def user_config_path(env: Mapping[str, str] | None = None) -> Path:
    return user_dir("config", env) / "config.json"


def load_layered_config(
    explicit: Path | str | None = None,
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    system_path: Path | None = None,
    user_path: Path | None = None,
) -> LoadedConfig:
    """The effective configuration for a run started in ``cwd`` (see the module docstring).

    An explicit path (or ``$DEVS_SANDBOX_CONFIG``) that does not exist is an error; the
    host's, the user's and the working directory's files are optional.
    """
    env = os.environ if env is None else env
    leaves = frozenset(leaf_paths(DevsConfig))
    layers: list[tuple[str, Path]] = []
    if system_path is None:
        system_path = Path(env.get(ENV_SYSTEM_CONFIG) or SYSTEM_CONFIG)
    if system_path.is_file():
        layers.append((str(system_path), system_path))
    user = user_path if user_path is not None else user_config_path(env)
    if user.is_file():
        layers.append((str(user), user))
    chosen = explicit if explicit is not None else (env.get(ENV_CONFIG) or None)
    if explicit is None and chosen is not None and not Path(chosen).is_absolute():
        # Relative, it would name whatever file the working directory holds: the workload's.
        raise ConfigError(f"{ENV_CONFIG}={chosen}: must be an absolute path", key=ENV_CONFIG)
    if chosen is not None:
        layers.append((str(chosen), Path(chosen)))
    sources: dict[str, str] = {}
    trusted: dict[str, Any] = {}
    for label, path in layers:
        data = read_config_file(path)
        parse_config(data, source=label)  # each file valid on its own: the error names it
        trusted = _deep_merge(trusted, data, leaves=leaves)
        for key in _flatten(data, leaves=leaves):
            sources[key] = label
    operator = parse_config(trusted, source="configuration")
    implicit = (cwd or Path.cwd()) / CONFIG_FILE_NAME
    if chosen is not None or not implicit.is_file():
        return LoadedConfig(operator, sources)
    label = str(implicit.absolute())  # absolute: an MCP server's log says which project
    data = read_config_file(implicit)
    parse_config(data, source=label)
    effective = parse_config(_deep_merge(trusted, data, leaves=leaves), source=label)
    set_here = set(_flatten(data, leaves=leaves))
    operator_flat = _leaf_values(operator)
    # Every leaf is compared, not only the keys the file names: the models also accept a
    # field's Python name (``use_bwrap``), and a value can change through a parent object.
    for key, new in _leaf_values(effective).items():
        old = operator_flat.get(key)
        if new == old:
            continue
        rule = RULES.get(key, Rule.OPERATOR)
        if not is_tighter_or_equal(rule, old, new):
            raise UntrustedConfigError(
                f"{label}: {key}={json.dumps(new)} would weaken the sandbox (operator value "
                f"{json.dumps(old)}; a file found in the working directory may only tighten: "
                f"{_how(rule)}); only an operator config may set it ({OPERATOR_SOURCES})",
                key=key,
                path=implicit,
            )
        set_here.add(key)
    for key in set_here & set(operator_flat):
        sources[key] = label
    return LoadedConfig(effective, sources, untrusted=implicit)


def _how(rule: Rule) -> str:
    return {
        Rule.LOWER: "lower it or leave it",
        Rule.HIGHER: "raise it or leave it",
        Rule.SUPERSET: "add entries, never remove",
        Rule.SUBSET: "remove entries, never add",
        Rule.TRUE_TIGHT: "it may only be true",
        Rule.FALSE_TIGHT: "it may only be false",
        Rule.OPERATOR: "it is the operator's to set",
        Rule.FREE: "",
    }[rule]


def describe(loaded: LoadedConfig) -> list[tuple[str, Any, str]]:
    """(key, value, source) for every leaf, for ``devs-sandbox config show``."""
    return [
        (key, _value_at(loaded.config, key), loaded.source(key)) for key in leaf_paths(DevsConfig)
    ]


def load_config(path: Path | str | None = None, *, cwd: Path | None = None) -> DevsConfig:
    """The effective configuration: the host's and the user's files, then ``path`` (or
    ``$DEVS_SANDBOX_CONFIG``), or else ``./devs.config.json``, which may only tighten (a
    file found in the working directory is the workload's, not the operator's). An
    explicit path that does not exist is an error; the others are optional.
    """
    return load_layered_config(path, cwd=cwd).config
