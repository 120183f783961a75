"""Sandbox images without a registry: resolve what is local, pull with a deadline, fall back,
and as the last resort rebuild the default image on this host.

No registry may be reachable (air-gapped CI, a laptop on a plane): ``docker pull``
then fails at once (no DNS) or hangs (a dropped route). So
``ImageResolver.resolve`` tries, in order:

1. the image already present in the engine;
2. a pull, abandoned after ``docker.pullTimeoutS``;
3. the configured ``docker.fallbackImages`` that are present;
4. ``ImageRebuilder``: the default image, rebuilt from the recipe shipped in
   ``devs_sandbox/images/default.json`` (Debian minbase with python3, made by
   ``debootstrap`` from the Debian mirror, imported with ``docker import``).

The rebuild is cached by content: the image carries the recipe's hash as a label
(``devs.recipe.sha256``) and its tag, so a second ``ensure`` is one inspect, and a
changed recipe yields a new image rather than a stale one. Builds in concurrent
processes are serialised by a lock file; the second finds the first's image.

A build directory can hold the target's ``/proc`` mounted by debootstrap: it is
unmounted (lazily, deepest first) before anything is deleted, so a failed build
can never make ``rmtree`` walk into a live ``/proc`` or ``/dev``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.resources
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from devs_sandbox.engine import connect, docker_sdk, engine_errors
from devs_sandbox.errors import DriverError, ImageUnavailableError
from devs_sandbox.security.environment import tool_environment

if TYPE_CHECKING:
    from docker.models.images import Image

    from docker import DockerClient

logger = logging.getLogger(__name__)

RECIPE_PACKAGE: Final = "devs_sandbox"
DEFAULT_RECIPE: Final = "default.json"
# Bump when the build procedure changes what an image contains: it is part of the hash.
BUILDER_VERSION: Final = 1
RECIPE_LABEL: Final = "devs.recipe.sha256"
RUNTIMES_LABEL: Final = "devs.runtimes"
DEFAULT_MIRROR: Final = "http://deb.debian.org/debian"
MIRROR_ENV: Final = "DEVS_SANDBOX_DEBIAN_MIRROR"
DEBOOTSTRAP_TIMEOUT_S: Final = 1800.0  # a slow mirror takes minutes; a dead one must not hang CI
IMPORT_TIMEOUT_S: Final = 600.0  # docker import of ~120 MB takes seconds; bound a wedged engine
KILL_WAIT_S: Final = 10.0  # after SIGKILL to debootstrap's session
PULL_JOIN_AFTER_CLOSE_S: Final = 5.0  # a pull thread whose connection we closed returns at once
LOCK_NAME: Final = "devs-sandbox.image-build.lock"

Source = Literal["local", "pulled", "fallback", "rebuilt"]


# -- the recipe -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ImageRecipe:
    """How the default image is made; the file's canonical JSON (plus the builder version)
    is hashed into the image's tag and label."""

    name: str
    suite: str
    variant: str
    include: tuple[str, ...]
    runtimes: tuple[str, ...]
    prune: tuple[str, ...] = ()
    mkdirs: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    workdir: str = "/"
    cmd: tuple[str, ...] = ("/bin/sh",)
    mirror: str | None = None
    description: str = ""
    digest: str = ""

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ImageRecipe:
        canonical = json.dumps(
            {"builder": BUILDER_VERSION, **data}, sort_keys=True, separators=(",", ":")
        )
        return cls(
            name=str(data["name"]),
            suite=str(data["suite"]),
            variant=str(data.get("variant", "minbase")),
            include=tuple(str(p) for p in data.get("include", ())),
            runtimes=tuple(str(r) for r in data.get("runtimes", ())),
            prune=tuple(str(p) for p in data.get("prune", ())),
            mkdirs=tuple(str(p) for p in data.get("mkdirs", ())),
            env={str(k): str(v) for k, v in dict(data.get("env", {})).items()},
            workdir=str(data.get("workdir", "/")),
            cmd=tuple(str(c) for c in data.get("cmd", ("/bin/sh",))),
            mirror=None if data.get("mirror") is None else str(data["mirror"]),
            description=str(data.get("description", "")),
            digest=hashlib.sha256(canonical.encode()).hexdigest(),
        )

    @classmethod
    def load(cls, path: Path | None = None) -> ImageRecipe:
        """The recipe at ``path``, or the default one shipped as package data."""
        if path is not None:
            text = path.read_text(encoding="utf-8")
        else:
            text = (
                importlib.resources.files(RECIPE_PACKAGE)
                .joinpath("images", DEFAULT_RECIPE)
                .read_text(encoding="utf-8")
            )
        return cls.from_json(json.loads(text))

    @property
    def tag(self) -> str:
        return self.digest[:12]

    @property
    def reference(self) -> str:
        """``name:<hash>``: the image this exact recipe produces."""
        return f"{self.name}:{self.tag}"

    def changes(self) -> list[str]:
        """Dockerfile instructions applied by ``docker import``."""
        out = [f"ENV {k}={v}" for k, v in sorted(self.env.items())]
        out.append(f"WORKDIR {self.workdir}")
        out.append(f"CMD {json.dumps(list(self.cmd))}")
        out.append(f"LABEL {RECIPE_LABEL}={self.digest}")
        out.append(f"LABEL {RUNTIMES_LABEL}={','.join(self.runtimes)}")
        if self.description:
            out.append(f"LABEL org.opencontainers.image.description={json.dumps(self.description)}")
        return out


def host_debian_mirror(suite: str, sources_dir: Path = Path("/etc/apt")) -> str | None:
    """The first Debian mirror this host's apt uses for ``suite`` (deb822 or one-line)."""
    files = sorted((sources_dir / "sources.list.d").glob("*.sources"))
    for f in files:
        with contextlib.suppress(OSError):
            for stanza in f.read_text().split("\n\n"):
                fields: dict[str, str] = {}
                for line in stanza.splitlines():
                    if line.startswith("#") or ":" not in line:
                        continue
                    key, _, value = line.partition(":")
                    fields[key.strip().lower()] = value.strip()
                if fields.get("enabled", "yes").lower() == "no":
                    continue
                if "deb" not in fields.get("types", "").split():
                    continue
                if suite in fields.get("suites", "").split() and fields.get("uris"):
                    return fields["uris"].split()[0]
    one_line = [
        sources_dir / "sources.list",
        *sorted((sources_dir / "sources.list.d").glob("*.list")),
    ]
    for f in one_line:
        with contextlib.suppress(OSError):
            for line in f.read_text().splitlines():
                words = [w for w in line.split() if not w.startswith("[")]
                if len(words) >= 3 and words[0] == "deb" and words[2] == suite:
                    return words[1]
    return None


# -- building ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BuildProgress:
    """One step of a build, for a progress display (``devs-sandbox image build``)."""

    phase: str  # check, debootstrap, prune, import, done
    message: str
    elapsed_s: float
    packages: int = 0  # packages debootstrap has fetched/unpacked/configured so far


ProgressCallback = Callable[[BuildProgress], None]


@dataclass(frozen=True, slots=True)
class BuiltImage:
    reference: str
    image_id: str
    cached: bool
    build_s: float
    size_bytes: int | None = None
    runtimes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "image_id": self.image_id,
            "cached": self.cached,
            "build_s": round(self.build_s, 3),
            "size_bytes": self.size_bytes,
            "runtimes": list(self.runtimes),
        }


class ImageRebuilder:
    """Builds the default sandbox image from its recipe, offline, once per recipe."""

    def __init__(
        self,
        client: DockerClient,
        *,
        recipe: ImageRecipe | None = None,
        mirror: str | None = None,
        work_root: Path | None = None,
        debootstrap: str | None = None,
    ) -> None:
        self.client = client
        self.recipe = recipe or ImageRecipe.load()
        self._mirror = mirror
        self.work_root = work_root or Path(tempfile.gettempdir())
        self._debootstrap = debootstrap
        self._thread_lock = threading.Lock()

    @property
    def reference(self) -> str:
        return self.recipe.reference

    def mirror(self) -> str:
        return (
            self._mirror
            or self.recipe.mirror
            or os.environ.get(MIRROR_ENV)
            or host_debian_mirror(self.recipe.suite)
            or DEFAULT_MIRROR
        )

    def cached(self) -> BuiltImage | None:
        """The image for this recipe if the engine has it (one inspect)."""
        img = self._get(self.recipe.reference)
        if img is None or (img.labels or {}).get(RECIPE_LABEL) != self.recipe.digest:
            return None
        return self._built(img, cached=True, build_s=0.0)

    def ensure(self, *, on_progress: ProgressCallback | None = None) -> BuiltImage:
        """The recipe's image: the cached one, or a fresh build (serialised across processes)."""
        hit = self.cached()
        if hit is not None:
            return hit
        with self._thread_lock, self._build_lock():
            hit = self.cached()  # another process may have built it while we waited
            if hit is not None:
                return hit
            return self.build(on_progress=on_progress)

    def build(self, *, on_progress: ProgressCallback | None = None) -> BuiltImage:
        """Build unconditionally. Needs root and debootstrap; ``ImageUnavailableError`` else."""
        started = time.monotonic()

        def report(phase: str, message: str, packages: int = 0) -> None:
            logger.info("image build: %s: %s", phase, message)
            if on_progress is not None:
                try:
                    on_progress(BuildProgress(phase, message, time.monotonic() - started, packages))
                except Exception:
                    logger.exception("progress callback failed")

        report("check", f"recipe {self.recipe.reference}")
        debootstrap = self._debootstrap or shutil.which("debootstrap")
        if debootstrap is None:
            raise ImageUnavailableError(
                "cannot rebuild the default image: debootstrap not found "
                "(apt-get install debootstrap), and no registry or fallback image was usable"
            )
        if os.geteuid() != 0:
            raise ImageUnavailableError(
                "cannot rebuild the default image: debootstrap needs root "
                "(run `devs-sandbox image build` as root once, or set docker.fallbackImages)"
            )
        build_dir = Path(tempfile.mkdtemp(prefix="devs-image-build.", dir=self.work_root))
        try:
            rootfs = build_dir / "rootfs"
            self._debootstrap_into(debootstrap, rootfs, report)
            report("prune", "removing caches, writing image metadata")
            self._prune(rootfs)
            report("import", "docker import")
            tarball = build_dir / "rootfs.tar"
            self._tar(rootfs, tarball)
            image = self._import(tarball)
        finally:
            _remove_build_dir(build_dir)
        built = self._built(image, cached=False, build_s=time.monotonic() - started)
        report("done", f"{built.reference} ({built.image_id[:19]}) in {built.build_s:.1f} s")
        return built

    # -- steps -----------------------------------------------------------------------
    def _debootstrap_into(
        self, debootstrap: str, rootfs: Path, report: Callable[[str, str, int], None]
    ) -> None:
        r = self.recipe
        argv = [
            debootstrap,
            f"--variant={r.variant}",
            *([f"--include={','.join(r.include)}"] if r.include else []),
            r.suite,
            str(rootfs),
            self.mirror(),
        ]
        report("debootstrap", " ".join(argv[1:]), 0)
        # The host environment, through the sanitizer's tool profile (PATH, proxies; never a
        # credential): debootstrap and the dpkg it runs need nothing else of ours.
        env = tool_environment({"LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive"})
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # so a timeout kills dpkg and its children too
        )
        deadline = time.monotonic() + DEBOOTSTRAP_TIMEOUT_S
        timer = threading.Timer(DEBOOTSTRAP_TIMEOUT_S, _killpg, args=(proc.pid,))
        timer.daemon = True
        timer.start()
        tail: list[str] = []
        packages = 0
        try:
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = raw.decode("utf-8", "replace").rstrip()
                tail = [*tail[-19:], line]
                if line.startswith(("I: Retrieving ", "I: Unpacking ", "I: Configuring ")):
                    packages += 1
                    report("debootstrap", line[3:], packages)
            proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _killpg(proc.pid)
            proc.wait(KILL_WAIT_S)
        finally:
            timer.cancel()
        if proc.returncode != 0:
            why = "timed out" if time.monotonic() >= deadline else f"exited {proc.returncode}"
            raise ImageUnavailableError(
                f"debootstrap {why} building {r.reference} from {self.mirror()} "
                f"(set {MIRROR_ENV} to a reachable Debian mirror): " + " | ".join(tail[-5:])
            )

    def _prune(self, rootfs: Path) -> None:
        for pattern in self.recipe.prune:
            for p in rootfs.glob(pattern):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
        for d in self.recipe.mkdirs:
            (rootfs / d).mkdir(mode=0o755, parents=True, exist_ok=True)
        meta = {
            "recipe": self.recipe.name,
            "sha256": self.recipe.digest,
            "runtimes": list(self.recipe.runtimes),
        }
        (rootfs / "etc" / "devs-sandbox-image.json").write_text(json.dumps(meta) + "\n")

    def _tar(self, rootfs: Path, tarball: Path) -> None:
        r = subprocess.run(
            ["tar", "--numeric-owner", "--xattrs", "-C", str(rootfs), "-cf", str(tarball), "."],
            env=tool_environment(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=IMPORT_TIMEOUT_S,
            check=False,
        )
        if r.returncode != 0:
            raise ImageUnavailableError(
                f"tar of the image rootfs failed: {r.stderr.decode()[-300:]}"
            )

    def _import(self, tarball: Path) -> Image:
        r = self.recipe
        try:
            with engine_errors("docker import"):
                self.client.api.import_image(
                    src=str(tarball), repository=r.name, tag=r.tag, changes=r.changes()
                )
                image = self.client.images.get(r.reference)
                image.tag(r.name, "latest")
        except DriverError as exc:
            raise ImageUnavailableError(f"importing {r.reference} failed: {exc}") from exc
        return image

    # -- helpers ---------------------------------------------------------------------
    def _get(self, reference: str) -> Image | None:
        docker = docker_sdk()
        try:
            with engine_errors(f"inspect image {reference}"):
                return self.client.images.get(reference)
        except DriverError as exc:
            if isinstance(exc.__cause__, docker.errors.ImageNotFound):
                return None
            raise

    def _built(self, image: Image, *, cached: bool, build_s: float) -> BuiltImage:
        size = image.attrs.get("Size")
        return BuiltImage(
            reference=self.recipe.reference,
            image_id=str(image.id),
            cached=cached,
            build_s=build_s,
            size_bytes=int(size) if isinstance(size, int) else None,
            runtimes=self.recipe.runtimes,
        )

    @contextlib.contextmanager
    def _build_lock(self) -> Iterator[None]:
        path = self.work_root / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock


def _killpg(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _mounts_under(path: Path) -> list[Path]:
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    found: list[Path] = []
    prefix = str(path).rstrip("/") + "/"
    for line in lines:
        fields = line.split()
        if len(fields) > 4:
            mnt = fields[4].replace("\\040", " ")
            if mnt.startswith(prefix):
                found.append(Path(mnt))
    return found


def _remove_build_dir(build_dir: Path) -> None:
    """Unmount whatever debootstrap left mounted inside, deepest first, then delete."""
    from devs_sandbox.isolation.mounts import unmount  # noqa: PLC0415 - libc via ctypes

    for mnt in sorted(_mounts_under(build_dir), key=lambda p: len(p.parts), reverse=True):
        try:
            unmount(mnt)
        except OSError as exc:
            logger.warning("could not unmount %s: %s", mnt, exc)
    if _mounts_under(build_dir):
        logger.error("leaving %s in place: something is still mounted inside it", build_dir)
        return
    shutil.rmtree(build_dir, ignore_errors=True)


# -- resolving ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ResolvedImage:
    """The image a sandbox will run, and how it was found."""

    requested: str | None
    reference: str
    image_id: str
    source: Source
    user: str = ""  # the image's configured USER ("" = root)
    runtimes: tuple[str, ...] | None = None  # from the devs.runtimes label; None = unknown


class ImageResolver:
    """Local first, then a bounded pull, then local fallbacks, then the offline rebuild."""

    def __init__(
        self,
        client: DockerClient,
        *,
        rebuilder: ImageRebuilder | None = None,
        fallback_images: Sequence[str] = (),
        pull: bool = True,
        pull_timeout_s: float = 30.0,
        rebuild: bool = True,
        base_url: str | None = None,
    ) -> None:
        """``base_url`` names the engine of ``client`` (None: the environment's, as
        ``docker.from_env``): a pull gets a connection of its own, to cut at the deadline."""
        self.client = client
        self.base_url = base_url
        self.rebuilder = rebuilder or ImageRebuilder(client)
        self.fallback_images = tuple(fallback_images)
        self.pull = pull
        self.pull_timeout_s = pull_timeout_s
        self.rebuild = rebuild

    def resolve(self, name: str | None) -> ResolvedImage:
        """The image to run for ``name`` (None = the default image); ImageUnavailableError
        lists every step that failed."""
        tried: list[str] = []
        if name is None:
            hit = self.rebuilder.cached()
            if hit is not None:
                return self._resolved(None, hit.reference, "local")
        else:
            image = self.rebuilder._get(name)
            if image is not None:
                return self._from(name, name, image, "local")
            tried.append(f"{name}: not present locally")
            if self.pull:
                error = self._pull(name)
                if error is None:
                    image = self.rebuilder._get(name)
                    if image is not None:
                        return self._from(name, name, image, "pulled")
                    error = "pull reported success but the image is absent"
                tried.append(f"pull {name}: {error}")
            for fallback in self.fallback_images:
                image = self.rebuilder._get(fallback)
                if image is not None:
                    logger.warning("image %s unavailable; using fallback %s", name, fallback)
                    return self._from(name, fallback, image, "fallback")
                tried.append(f"fallback {fallback}: not present locally")
        if not self.rebuild:
            raise ImageUnavailableError(
                "no usable image (" + "; ".join(tried or ["default image not built"]) + "); "
                "run `devs-sandbox image build` or enable docker.rebuildDefaultImage"
            )
        if name is not None:
            logger.warning(
                "image %s unavailable (%s); using the default image %s",
                name,
                "; ".join(tried),
                self.rebuilder.reference,
            )
        try:
            built = self.rebuilder.ensure()
        except ImageUnavailableError as exc:
            raise ImageUnavailableError("; ".join([*tried, str(exc)])) from exc
        return self._resolved(name, built.reference, "local" if name is None else "rebuilt")

    def _resolved(self, requested: str | None, reference: str, source: Source) -> ResolvedImage:
        image = self.rebuilder._get(reference)
        if image is None:
            raise ImageUnavailableError(f"image {reference} vanished while resolving it")
        return self._from(requested, reference, image, source)

    @staticmethod
    def _from(requested: str | None, reference: str, image: Image, source: Source) -> ResolvedImage:
        config = image.attrs.get("Config") or {}
        labels = config.get("Labels") or {}
        runtimes_label = labels.get(RUNTIMES_LABEL)
        runtimes = (
            tuple(r for r in str(runtimes_label).split(",") if r)
            if runtimes_label is not None
            else None
        )
        return ResolvedImage(
            requested=requested,
            reference=reference,
            image_id=str(image.id),
            source=source,
            user=str(config.get("User") or ""),
            runtimes=runtimes,
        )

    def _pull(self, name: str) -> str | None:
        """Pull ``name`` on a connection of its own, closed at the deadline; None = pulled."""
        docker = docker_sdk()
        repository, tag = docker.utils.parse_repository_tag(name)
        outcome: dict[str, str | None] = {}
        try:
            api = connect(max(1.0, self.pull_timeout_s), self.base_url).api
        except DriverError as exc:
            return str(exc)

        def work() -> None:
            try:
                for msg in api.pull(repository, tag=tag or "latest", stream=True, decode=True):
                    if isinstance(msg, dict) and msg.get("error"):
                        outcome["error"] = str(msg["error"])
                        return
                outcome["error"] = None
            except Exception as exc:
                outcome["error"] = str(getattr(exc, "explanation", None) or exc).splitlines()[0]

        worker = threading.Thread(target=work, name="devs-image-pull", daemon=True)
        worker.start()
        worker.join(self.pull_timeout_s)
        if worker.is_alive():
            api.close()  # the blocked read fails; the engine cancels the pull with the request
            worker.join(PULL_JOIN_AFTER_CLOSE_S)
            return f"timed out after {self.pull_timeout_s:g} s (docker.pullTimeoutS)"
        api.close()
        return outcome.get("error", "pull thread ended without a result")
