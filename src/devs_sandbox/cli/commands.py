"""The other subcommands: violations, doctor, cleanup, config, mcp, image."""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import IO, Any, Final

from devs_sandbox.cli.console import EXIT_CANNOT_RUN, EXIT_USAGE, PROG, Console, UsageError
from devs_sandbox.cli.parser import build_parser, cluster_changes
from devs_sandbox.cli.run import db_path, load_file_config, run_config
from devs_sandbox.config import override, render_schema
from devs_sandbox.errors import ConfigError, DevsSandboxError


def cmd_violations(args: argparse.Namespace, con: Console) -> int:
    from devs_sandbox.store import ViolationStore  # noqa: PLC0415

    file_cfg = load_file_config(args, con)
    with ViolationStore(db_path(args, file_cfg, con)) as store:
        rows = store.list(sandbox_id=args.sandbox_id, limit=args.limit)
    if args.json:
        json.dump(rows, con.out, indent=None)
        con.out.write("\n")
        return 0
    if not rows:
        print("no violations recorded", file=con.out)
        return 0
    header = ("terminated_at", "sandbox_id", "violation_type", "observed", "limit", "rule")
    table = [header] + [
        (
            r["terminated_at"],
            r["sandbox_id"],
            r["violation_type"],
            str(r["observed_value"]),
            str(r["limit_value"]),
            r["rule"],
        )
        for r in rows
    ]
    if con.out.isatty():
        from devs_sandbox.cli.pretty import print_violations  # noqa: PLC0415

        print_violations(con.out, header, table[1:])
        return 0
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip(),
            file=con.out,
        )
    return 0


def cmd_doctor(args: argparse.Namespace, con: Console) -> int:
    from devs_sandbox.cli.doctor import diagnose, render  # noqa: PLC0415

    file_cfg = load_file_config(args, con)
    report = diagnose(file_cfg)
    if args.json:
        json.dump(report, con.out, indent=2)
        con.out.write("\n")
    elif con.out.isatty():
        from devs_sandbox.cli.pretty import print_doctor  # noqa: PLC0415

        print_doctor(con.out, report)
    else:
        con.out.write(render(report))
    return 0


def cmd_cleanup(args: argparse.Namespace, con: Console) -> int:
    from devs_sandbox.cli.doctor import cleanup_all  # noqa: PLC0415

    file_cfg = load_file_config(args, con)
    if cluster_changes(args):
        sandbox = override(file_cfg.sandbox, kubernetes=cluster_changes(args))
        file_cfg = file_cfg.model_copy(update={"sandbox": sandbox})
    drivers = (args.driver,) if args.driver else None
    reaped = cleanup_all(file_cfg, drivers)
    if args.json:
        json.dump({"reaped": reaped}, con.out)
        con.out.write("\n")
    elif reaped:
        for driver, ids in reaped.items():
            for sandbox_id in ids:
                print(f"reaped {driver} sandbox {sandbox_id}", file=con.out)
    else:
        print("nothing to clean up", file=con.out)
    return 0


def cmd_config(args: argparse.Namespace, con: Console) -> int:
    if args.config_cmd == "schema":
        con.out.write(render_schema())
        return 0
    if args.config_cmd == "show":
        from devs_sandbox.config_trust import describe, load_layered_config  # noqa: PLC0415

        explicit = con.path(args.config) if args.config else None
        loaded = load_layered_config(explicit, cwd=con.cwd, env=con.env)
        rows = describe(loaded)
        if args.json:
            json.dump(
                {
                    "config": loaded.config.model_dump(mode="json", by_alias=True),
                    "sources": {key: source for key, _value, source in rows},
                },
                con.out,
                indent=2,
            )
            con.out.write("\n")
            return 0
        width = max(len(key) for key, _v, _s in rows)
        for key, value, source in rows:
            print(f"{key:<{width}} = {json.dumps(value)}  ({source})", file=con.out)
        return 0
    raise UsageError(f"{PROG} config: choose 'schema' or 'show'", EXIT_USAGE)


MCP_INSTALL_HINT: Final = "pip install 'devs-sandbox[mcp]'"


def cmd_mcp(args: argparse.Namespace, con: Console) -> int:
    try:
        from devs_sandbox import mcp_server  # noqa: PLC0415 - the SDK is an optional extra
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in {"mcp", "mcp_types"}:
            raise
        raise DevsSandboxError(
            f"the MCP server needs the MCP SDK, which is not installed: {MCP_INSTALL_HINT}"
        ) from None
    if args.auth_token_file is not None and not args.http:
        raise UsageError(f"{PROG} mcp: --auth-token-file needs --http", EXIT_USAGE)
    file_cfg = load_file_config(args, con)
    token = None
    if args.http and args.auth_token_file is not None:
        try:
            token = mcp_server.read_auth_token(con.path(args.auth_token_file))
        except ConfigError as exc:
            raise UsageError(f"{PROG} mcp: {exc}", EXIT_CANNOT_RUN) from None
    if args.http and token is None and not mcp_server.is_loopback(args.host):
        raise UsageError(
            f"{PROG} mcp: refusing to listen on {args.host} without --auth-token-file: anyone "
            "who can reach it could run commands on this host",
            EXIT_CANNOT_RUN,
        )
    if token is not None and not mcp_server.is_loopback(args.host):
        print(
            f"{PROG} mcp: WARNING: plain HTTP on {args.host} carries the token and every "
            "command in clear text; put a TLS proxy in front of it",
            file=con.err,
        )
    return mcp_server.serve(
        file_cfg,
        db_path=db_path(args, file_cfg, con),
        http=args.http,
        host=args.host,
        port=args.port,
        auth_token=token,
    )


def progress_line(p: Any) -> str:
    line = f"[{p.elapsed_s:6.1f}s] {p.phase:<11}"
    if p.packages:
        line += f" {p.packages:>4} steps"
    return line + f"  {p.message}"


class _BuildProgress:
    """One line per phase (and every 50 steps) on a pipe; a terminal gets rich's live
    display instead (cli/pretty.py)."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.phase = ""
        self.shown = 0

    def __enter__(self) -> _BuildProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __call__(self, p: Any) -> None:
        if p.phase != self.phase or p.packages - self.shown >= 50:
            self.out.write(progress_line(p) + "\n")
            self.shown = p.packages
        self.phase = p.phase
        self.out.flush()


def cmd_image(args: argparse.Namespace, con: Console) -> int:
    if args.image_cmd != "build":
        raise UsageError(f"{PROG} image: choose 'build'", EXIT_USAGE)
    from devs_sandbox.engine import connect, docker_sdk  # noqa: PLC0415
    from devs_sandbox.images import ImageRebuilder  # noqa: PLC0415

    client = connect()
    rebuilder = ImageRebuilder(client)
    progress: Any = contextlib.nullcontext()
    if not args.json:
        if con.err.isatty():
            from devs_sandbox.cli.pretty import BuildProgress  # noqa: PLC0415

            progress = BuildProgress(con.err)
        else:
            progress = _BuildProgress(con.err)
    with progress as on_progress:
        built = (
            rebuilder.build(on_progress=on_progress)
            if args.force
            else rebuilder.ensure(on_progress=on_progress)
        )
    payload = built.to_json()
    if args.tag:
        repository, tag = docker_sdk().utils.parse_repository_tag(args.tag)
        client.images.get(built.reference).tag(repository, tag or "latest")
        payload["tag"] = f"{repository}:{tag or 'latest'}"
    client.close()
    if args.json:
        json.dump(payload, con.out)
        con.out.write("\n")
    else:
        how = "cached" if built.cached else f"built in {built.build_s:.1f} s"
        size = f", {built.size_bytes / 2**20:.0f} MiB" if built.size_bytes else ""
        print(f"{built.reference} ({built.image_id[:19]}{size}): {how}", file=con.out)
        if args.tag:
            print(f"tagged {payload['tag']}", file=con.out)
    return 0


# -- kubernetes -----------------------------------------------------------------------------
def cmd_kubernetes(args: argparse.Namespace, con: Console) -> int:
    """``kubernetes manifest [run options]``: the objects a run would create, no cluster."""
    if args.k8s_cmd != "manifest":
        raise UsageError(f"{PROG} kubernetes: choose 'manifest'", EXIT_USAGE)
    from devs_sandbox.drivers.kubernetes import manifest as mf  # noqa: PLC0415
    from devs_sandbox.models import new_sandbox_id  # noqa: PLC0415

    run_args = build_parser().parse_args(["run", *args.run_options, "--", "true"])
    major, _, minor = str(args.server_version).partition(".")
    if not (major.isdigit() and minor.isdigit()):
        raise UsageError(f"{PROG} kubernetes manifest: --server-version MAJOR.MINOR", EXIT_USAGE)
    cfg = run_config(run_args, load_file_config(run_args, con), con)
    made = mf.build_manifest(
        cfg,
        sandbox_id=cfg.sandbox_id or new_sandbox_id(),
        namespace=cfg.kubernetes.namespace or "default",
        uid=mf.pick_uid(cfg),
        server=(int(major), int(minor)),
    )
    mf.validate_pod_spec(made.pod, mf.PodPolicy.of(cfg))
    mf.validate_network_policy(made.network_policy, made.pod, network=cfg.network)
    if args.output == "json":
        objects = {"apiVersion": "v1", "kind": "List", "items": made.objects()}
        con.out.write(json.dumps(objects, indent=2) + "\n")
        return 0
    try:
        import yaml  # noqa: PLC0415 - PyYAML comes with the kubernetes extra
    except ImportError:
        raise DevsSandboxError(
            "--output yaml needs PyYAML: pip install 'devs-sandbox[kubernetes]', or --output json"
        ) from None
    con.out.write(yaml.safe_dump_all(made.objects(), sort_keys=False))
    return 0
