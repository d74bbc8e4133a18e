#!/usr/bin/env python3
"""Build, check and archive the gpushare image with the builder this machine has.

    scripts/build_image.py plan      what would be built, with which builder and stand-ins
    scripts/build_image.py build     build it (making the local Debian base first if needed)
    scripts/build_image.py check     run the image's programs from the image
    scripts/build_image.py archive   write a tar that `ctr -n k8s.io images import` reads

The builder: docker where its engine answers (`docker info`; the client alone is not
enough), else buildah, else podman. None there and root on Debian: buildah is installed
with apt-get (idempotent: nothing is installed that is already there). buildah comes before
podman: it runs the build's steps in a chroot (--isolation=chroot), which needs no OCI
runtime, where podman's checks run containers with its runtime (Debian's crun refuses
hybrid cgroups: "cgroups in hybrid mode not supported").

The Dockerfile's defaults are the published bases: python:*-slim, HAMi's image (or
HAMi-core's source on github.com), manylinux2014 for the memory hook. Each is replaced
by an offline stand-in, passed as a build argument, only where its host cannot be reached
(``--standins auto``, the default), always (``all``: CI, where nothing may be pulled from a
registry) or never (``none``: fail instead):

    python:*-slim          docker.io  PYTHON_IMAGE=localhost/gpushare-debian-python:bookworm,
                                      made here by mmdebstrap from Debian's packages
    projecthami/hami       docker.io  INTERPOSER=source where github.com answers, else stub
    HAMi-core's source     github.com INTERPOSER=stub (hook/libvgpu-stub.c: enforces nothing)
    manylinux2014          quay.io    HOOK_BUILDER=base (the base's gcc; its glibc is the floor)

Deciding is pure (:func:`plan`, over :class:`Facts` gathered by :func:`gather`); the
rest runs commands. Needs only python3. See docs/deploy.md#building-the-image.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("docker", "buildah", "podman")  # the order of preference
ARCHES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
LOCAL_BASE = "localhost/gpushare-debian-python:bookworm"
DEBIAN_SUITE = "bookworm"
# python:*-slim has python and venv; the Dockerfile's stages add what they need with apt-get
BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates")
DEBIAN_MIRRORS = (
    f"deb http://deb.debian.org/debian {DEBIAN_SUITE} main",
    f"deb http://deb.debian.org/debian {DEBIAN_SUITE}-updates main",
    f"deb http://deb.debian.org/debian-security {DEBIAN_SUITE}-security main",
)
# Any HTTP answer (401 from a registry included) means the host is reachable.
PROBES = {
    "docker.io": "https://registry-1.docker.io/v2/",
    "quay.io": "https://quay.io/v2/",
    "github.com": "https://github.com/",
}
INTERPOSERS = ("published", "source", "stub")
# buildah runs each RUN step in a chroot of its own rather than through an OCI runtime:
# Debian's crun refuses a machine whose cgroups are in hybrid mode (v1 controllers and a
# v2 mount, as here: "cgroups in hybrid mode not supported"), and a build step needs no
# cgroup. The image is the same; only the isolation of the build's own steps differs.
BUILDAH_ISOLATION = ("--isolation=chroot",)
STANDIN_MODES = ("auto", "all", "none")


class PlanError(Exception):
    """The image cannot be built as asked on this machine; the message says why."""


@dataclass(frozen=True)
class Facts:
    """What this machine offers: working builders (preference order), docker buildx,
    the hosts that answer, its architecture (uname -m)."""

    engines: tuple[str, ...]
    buildx: bool
    reachable: frozenset[str]
    machine: str
    # the CA bundle pip is told to trust here (PIP_CERT), for a TLS-inspecting proxy
    ca_bundle: str = ""


@dataclass(frozen=True)
class Request:
    image: str
    version: str
    interposer: str = "published"
    standins: str = "auto"
    hami_version: str = ""
    hami_core_commit: str = ""
    platforms: str = "linux/amd64,linux/arm64"
    push: bool = False


@dataclass(frozen=True)
class Plan:
    builder: str
    platforms: str  # one platform unless docker buildx builds every one
    build_args: dict[str, str]
    # (build argument=value, why): each stand-in replacing a published source
    standins: tuple[tuple[str, str], ...] = ()
    local_base: bool = False
    multi_arch: bool = False
    # build secrets, id -> file on this machine (never in a layer)
    secrets: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = field(default=())


def plan(facts: Facts, request: Request) -> Plan:
    """The build this machine can do for the request, or PlanError."""
    if request.interposer not in INTERPOSERS:
        raise PlanError(f"INTERPOSER={request.interposer}: one of {', '.join(INTERPOSERS)}")
    if request.standins not in STANDIN_MODES:
        raise PlanError(f"--standins {request.standins}: one of {', '.join(STANDIN_MODES)}")
    if not facts.engines:
        raise PlanError(
            "no image builder: no docker engine answers `docker info`, and neither buildah "
            "nor podman is installed (apt-get install buildah)"
        )
    arch = ARCHES.get(facts.machine)
    if arch is None:
        raise PlanError(f"no image for this machine's architecture {facts.machine}")
    builder = facts.engines[0]
    args: dict[str, str] = {"VERSION": request.version, "TARGETARCH": arch}
    if request.hami_version:
        args["HAMI_VERSION"] = request.hami_version
    if request.hami_core_commit:
        args["HAMI_CORE_COMMIT"] = request.hami_core_commit
    standins = _stand_ins(facts, request)
    for setting, _ in standins:
        name, value = setting.split("=", 1)
        args[name] = value
    args.setdefault("INTERPOSER", request.interposer)
    multi_arch = builder == "docker" and facts.buildx and not standins
    notes = []
    if not multi_arch and "," in request.platforms:
        notes.append(f"{builder}: this machine's platform only (linux/{arch})")
    if request.push and standins:
        raise PlanError(
            "PUSH=1 with stand-ins: an image with a stub or a local base is "
            "never pushed; build where the published sources are reachable"
        )
    return Plan(
        builder=builder,
        platforms=request.platforms if multi_arch else f"linux/{arch}",
        build_args=args,
        standins=tuple(standins),
        local_base=args.get("PYTHON_IMAGE") == LOCAL_BASE,
        multi_arch=multi_arch,
        secrets={"pip-ca": facts.ca_bundle} if facts.ca_bundle else {},
        notes=tuple(notes),
    )


def _stand_ins(facts: Facts, request: Request) -> list[tuple[str, str]]:
    """(build argument=value, why) for each published source replaced: the ones out of
    reach (``auto``), all (``all``) or none (``none``)."""

    def missing(host: str) -> bool:
        return request.standins == "all" or (
            request.standins == "auto" and host not in facts.reachable
        )

    def why(host: str) -> str:
        return "--standins all" if request.standins == "all" else f"{host} cannot be reached"

    standins: list[tuple[str, str]] = []
    if missing("docker.io"):
        standins.append(
            (
                f"PYTHON_IMAGE={LOCAL_BASE}",
                f"python:*-slim: {why('docker.io')}; Debian {DEBIAN_SUITE} made with mmdebstrap",
            )
        )
    if request.interposer == "published" and missing("docker.io"):
        interposer = "stub" if missing("github.com") else "source"
        standins.append(
            (
                f"INTERPOSER={interposer}",
                f"projecthami/hami: {why('docker.io')}"
                + ("; HAMi-core's source too" if interposer == "stub" else ""),
            )
        )
    elif request.interposer == "source" and missing("github.com"):
        standins.append(("INTERPOSER=stub", f"HAMi-core's source: {why('github.com')}"))
    if missing("quay.io"):
        standins.append(
            (
                "HOOK_BUILDER=base",
                f"manylinux2014: {why('quay.io')}; the hook needs the base's glibc",
            )
        )
    return standins


def build_command(p: Plan, request: Request, archive: str) -> list[str]:
    """The builder's command line for the plan (run in the repository root)."""
    args = [f"--build-arg={k}={v}" for k, v in sorted(p.build_args.items())]
    args += [f"--secret=id={k},src={v}" for k, v in sorted(p.secrets.items())]
    if p.multi_arch:
        output = "--push" if request.push else f"--output=type=oci,dest={archive}"
        return [
            "docker",
            "buildx",
            "build",
            f"--platform={p.platforms}",
            *args,
            f"--tag={request.image}",
            output,
            ".",
        ]
    if p.builder == "docker":
        return ["docker", "build", *args, f"--tag={request.image}", "."]
    # podman and buildah: keep every step's layer (warm rebuilds), the host's network for
    # apt-get and pip (no CNI needed), and never pull the local base from a registry.
    pull = ["--pull=never"] if p.local_base else []
    verb = ["podman", "build"] if p.builder == "podman" else ["buildah", "bud"]
    verb += BUILDAH_ISOLATION  # podman build takes it too
    return [*verb, "--layers", "--network=host", *pull, *args, f"--tag={request.image}", "."]


def _run(cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    print("+ " + " ".join(cmd), flush=True)
    done: subprocess.CompletedProcess[str] = subprocess.run(cmd, check=True, text=True, **kwargs)
    return done


def _quiet(cmd: Sequence[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _reachable(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=5).close()
    except urllib.error.HTTPError:
        return True  # it answered
    except (OSError, ValueError):
        return False
    return True


def gather(env: Mapping[str, str]) -> Facts:
    """Probe this machine: builders that work (not only their clients), buildx, hosts."""
    engines = tuple(e for e in ENGINES if shutil.which(e) and _quiet([e, "info"]))
    buildx = "docker" in engines and _quiet(["docker", "buildx", "version"])
    if env.get("GPUSHARE_IMAGE_OFFLINE") == "1":
        reachable: frozenset[str] = frozenset()
    else:
        reachable = frozenset(host for host, url in PROBES.items() if _reachable(url))
    ca_bundle = env.get("PIP_CERT") or env.get("SSL_CERT_FILE") or ""
    return Facts(
        engines,
        buildx,
        reachable,
        platform.machine(),
        ca_bundle if os.path.isfile(ca_bundle) else "",
    )


def storage_on_overlay(path: Path = Path("/var/lib/containers")) -> bool:
    """Whether podman's and buildah's storage would be on an overlay file system (a
    machine that is itself a container): their overlay driver cannot stack on it."""
    while not path.exists():
        path = path.parent
    out = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True)
    return out.stdout.strip() == "overlayfs"


#: the Debian package that gives each command the build may need
DEBIAN_PACKAGES = {"buildah": "buildah", "mmdebstrap": "mmdebstrap", "nm": "binutils"}


def ensure_debian_packages(commands: Sequence[str]) -> None:
    """apt-get install the packages of the commands that are missing (root on Debian
    only), with their recommended packages, as tested here (buildah's runc or crun and
    fuse-overlayfs; mmdebstrap's gpg and mount)."""
    absent = [DEBIAN_PACKAGES[c] for c in commands if not shutil.which(c)]
    if not absent:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise PlanError(
            f"{' '.join(absent)} missing: install them (Debian: apt-get install {' '.join(absent)})"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    _run(["apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL)
    _run(["apt-get", "install", "-y", "-q", *absent], env=env, stdout=subprocess.DEVNULL)


def _image_exists(builder: str, image: str) -> bool:
    if builder == "buildah":
        return _quiet(["buildah", "inspect", "--type=image", image])
    return _quiet([builder, "image", "inspect", image])


def make_local_base(builder: str) -> None:
    """Debian with python3, made by mmdebstrap and imported as LOCAL_BASE (kept: once)."""
    if _image_exists(builder, LOCAL_BASE):
        print(f"local base {LOCAL_BASE}: already there", flush=True)
        return
    ensure_debian_packages(["mmdebstrap"])
    with tempfile.TemporaryDirectory(prefix="gpushare-base-") as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        # like the slim images: no documentation, no man pages, no apt lists (mmdebstrap's
        # cleanup), a UTF-8 C locale
        excludes = [
            f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("man", "doc", "info", "locale")
        ]
        _run(
            [
                "mmdebstrap",
                "--variant=minbase",
                "--mode=root",
                "--format=tar",
                "--quiet",
                f"--include={','.join(BASE_PACKAGES)}",
                *excludes,
                DEBIAN_SUITE,
                str(rootfs),
                *DEBIAN_MIRRORS,
            ]
        )
        changes = ["ENV LANG=C.UTF-8", 'CMD ["python3"]']
        if builder == "buildah":
            container = _run(["buildah", "from", "scratch"], capture_output=True).stdout.strip()
            try:
                _run(["buildah", "add", container, str(rootfs), "/"], stdout=subprocess.DEVNULL)
                _run(["buildah", "config", "--env", "LANG=C.UTF-8", "--cmd", "python3", container])
                _run(["buildah", "commit", "--quiet", container, LOCAL_BASE])
            finally:
                _quiet(["buildah", "rm", container])
        else:
            change = [f"--change={c}" for c in changes]
            _run([builder, "import", *change, str(rootfs), LOCAL_BASE])


def _archive_path(request: Request, p: Plan) -> str:
    if p.multi_arch:
        return f"dist/gpushare-{request.version}.oci.tar"
    return f"dist/gpushare-{request.version}-{p.platforms.split('/')[1]}.tar"


def build(facts: Facts, request: Request) -> Plan:
    p = plan(facts, request)
    _describe(p)
    if p.local_base:
        started = time.monotonic()
        make_local_base(p.builder)
        print(f"local base in {time.monotonic() - started:.0f} s", flush=True)
    (ROOT / "dist").mkdir(exist_ok=True)
    started = time.monotonic()
    before = _buildah_containers() if p.builder == "buildah" else set()
    try:
        _run(build_command(p, request, _archive_path(request, p)), cwd=ROOT)
    finally:
        # buildah 1.28 leaves the working container of each stage that is only an alias
        # (FROM stage AS name, no instruction) and of a failed step: remove what this
        # build made, and nothing else
        if p.builder == "buildah":
            for container in sorted(_buildah_containers() - before):
                _quiet(["buildah", "rm", container])
    print(
        f"built {request.image} with {p.builder} in {time.monotonic() - started:.0f} s", flush=True
    )
    if request.push and not p.multi_arch:  # buildx pushed it already
        _run([p.builder, "push", request.image])
    return p


def _buildah_containers() -> set[str]:
    """buildah's working containers now (none where it cannot list them)."""
    listed = subprocess.run(
        ["buildah", "containers", "--quiet", "--notruncate"], capture_output=True, text=True
    )
    return set(listed.stdout.split()) if listed.returncode == 0 else set()


def _describe(p: Plan) -> None:
    print(f"builder: {p.builder}, platforms: {p.platforms}", flush=True)
    for setting, reason in p.standins:
        print(f"stand-in: {setting} ({reason})", flush=True)
    if not p.standins:
        print("stand-ins: none (the published bases)", flush=True)
    for note in p.notes:
        print(f"note: {note}", flush=True)
    for name, path in p.secrets.items():
        print(f"build secret: {name} = {path} (the CA bundle pip trusts here)", flush=True)


class Runner:
    """Runs a command from the image, and reads a file out of it, with the builder."""

    def __init__(self, builder: str, image: str) -> None:
        self.builder, self.image = builder, image

    def run(self, argv: Sequence[str], stdin: str = "") -> subprocess.CompletedProcess[str]:
        if self.builder == "buildah":
            container = _run(
                ["buildah", "from", "--pull=never", self.image], capture_output=True
            ).stdout.strip()
            try:
                return subprocess.run(
                    ["buildah", "run", *BUILDAH_ISOLATION, container, "--", *argv],
                    input=stdin,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
            finally:
                _quiet(["buildah", "rm", container])
        return subprocess.run(
            [self.builder, "run", "--rm", "-i", "--network=none", self.image, *argv],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def copy_out(self, path: str, dest: Path) -> None:
        if self.builder == "buildah":
            container = _run(
                ["buildah", "from", "--pull=never", self.image], capture_output=True
            ).stdout.strip()
            try:
                mount = _run(["buildah", "mount", container], capture_output=True).stdout.strip()
                shutil.copyfile(Path(mount) / path.lstrip("/"), dest)
            finally:
                _quiet(["buildah", "umount", container])
                _quiet(["buildah", "rm", container])
            return
        container = _run([self.builder, "create", self.image], capture_output=True).stdout.strip()
        try:
            _run([self.builder, "cp", f"{container}:{path}", str(dest)])
        finally:
            _quiet([self.builder, "rm", container])


# (what, command, stdin, expected exit status, text the output must hold)
CHECKS: tuple[tuple[str, tuple[str, ...], str, int, str], ...] = (
    ("daemon", ("gpushare-device-plugin", "--version"), "", 0, "{version}"),
    ("extender", ("gpushare-scheduler-extender", "--version"), "", 0, "{version}"),
    ("kubectl plugin", ("kubectl-gpushare", "--version"), "", 0, "{version}"),
    ("cache-fs init", ("python", "-m", "gpushare.host.cachefs", "--help"), "", 0, "--size-mib"),
    ("interposer version", ("cat", "/opt/gpushare/lib/libvgpu.version"), "", 0, "sha256:"),
    ("memory hook usage", ("/opt/gpushare/lib/gpushare-memory-hook",), "", 2, "usage:"),
    (
        "memory hook check mode",
        ("/opt/gpushare/lib/gpushare-memory-hook", "--check-limits"),
        "{}",
        1,
        'has no "bundle"',
    ),
    (
        "memory hook version",
        ("cat", "/opt/gpushare/lib/gpushare-memory-hook.version"),
        "",
        0,
        "GLIBC_",
    ),
    # no GPU in a build machine: the probe must say it cannot run (exit 2), not crash
    ("probe", ("python", "-m", "gpushare.probe"), "", 2, "probe: cannot run"),
)


def check(builder: str, image: str, version: str) -> list[str]:
    """Run the image's programs from the image; the failures, one line each."""
    runner = Runner(builder, image)
    failures = []
    for what, argv, stdin, status, expect in CHECKS:
        want = expect.format(version=version)
        result = runner.run(argv, stdin)
        out = (result.stdout + result.stderr).strip()
        for _ in range(2 if builder == "buildah" else 0):
            if want in out:
                break
            # buildah 1.28's `run` loses a program's whole output now and then on a loaded
            # 2-core machine (nothing on stdout or stderr, or only buildah's own "subprocess
            # exited with status N"), for a different check each time (`cat` of a file,
            # `--help`, the hook's usage), never in 16 runs alone: run it again, said in
            # the log; a program that really prints something else fails three times
            print(
                f"note {what}: {want!r} not in buildah run's output; running it again",
                flush=True,
            )
            result = runner.run(argv, stdin)
            out = (result.stdout + result.stderr).strip()
        ok = result.returncode == status and want in out
        # the line that holds what was expected, else the program's last
        shown = [line for line in out.splitlines() if want in line] or out.splitlines() or [""]
        print(
            f"{'ok  ' if ok else 'FAIL'} {what}: {' '.join(argv)} -> {result.returncode}: "
            f"{shown[0].strip()}",
            flush=True,
        )
        if not ok:
            failures.append(
                f"{what}: exit {result.returncode} (want {status}), want {want!r} in {out!r}"
            )
    ensure_debian_packages(["nm"])  # check-interposer.sh reads the library with nm -D
    with tempfile.TemporaryDirectory() as tmp:
        library = Path(tmp) / "libvgpu.so"
        runner.copy_out("/opt/gpushare/lib/libvgpu.so", library)
        result = subprocess.run(
            [str(ROOT / "scripts" / "check-interposer.sh"), str(library)],
            capture_output=True,
            text=True,
        )
        print(
            f"{'ok  ' if result.returncode == 0 else 'FAIL'} libvgpu.so hooks: "
            f"{(result.stdout + result.stderr).strip()}",
            flush=True,
        )
        if result.returncode:
            failures.append(f"libvgpu.so: {result.stderr.strip()}")
    return failures


def archive(builder: str, image: str, dest: str) -> None:
    """A docker-archive tar of the image, named by its reference (ctr and docker load it)."""
    Path(dest).parent.mkdir(parents=True, exist_ok=True)
    Path(dest).unlink(missing_ok=True)
    name = image.removeprefix("localhost/")
    if builder == "buildah":
        _run(["buildah", "push", "--quiet", image, f"docker-archive:{dest}:{name}"])
    elif builder == "podman":
        _run(["podman", "save", "--quiet", "--format=docker-archive", f"--output={dest}", image])
    else:
        _run(["docker", "save", f"--output={dest}", image])
    with tarfile.open(dest) as tar:
        manifest = tar.extractfile("manifest.json")
        tags = json.load(manifest)[0].get("RepoTags") if manifest else None
    print(
        f"archive: {dest} ({Path(dest).stat().st_size / 2**20:.0f} MiB), tags {tags}; "
        f"import with: ctr -n k8s.io images import {dest}",
        flush=True,
    )


def image_size(builder: str, image: str) -> str:
    """The image's size as the builder reports it (buildah: its own rounded units)."""
    if builder == "buildah":
        out = _run(["buildah", "images", "--json", image], capture_output=True).stdout
        return str(json.loads(out)[0]["size"])
    inspect = [builder, "image", "inspect", "--format={{.Size}}", image]
    size = _run(inspect, capture_output=True).stdout.strip()
    return f"{int(size) / 1e6:.0f} MB"


def _version() -> str:
    for line in (ROOT / "src" / "gpushare" / "__init__.py").read_text().splitlines():
        if line.startswith("__version__ = "):
            return line.split('"')[1]
    raise PlanError("no __version__ in src/gpushare/__init__.py")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("action", choices=("plan", "build", "check", "archive", "all"))
    parser.add_argument("--image", default="")
    parser.add_argument("--interposer", default="published", choices=INTERPOSERS)
    parser.add_argument("--standins", default="auto", choices=STANDIN_MODES)
    parser.add_argument("--hami-version", default="")
    parser.add_argument("--hami-core-commit", default="")
    parser.add_argument("--platforms", default="linux/amd64,linux/arm64")
    parser.add_argument("--push", action="store_true")
    parser.add_argument("--archive", default="", help="the tar to write (archive, all)")
    args = parser.parse_args(argv)
    version = _version()
    request = Request(
        image=args.image or f"gpushare:{version}",
        version=version,
        interposer=args.interposer,
        standins=args.standins,
        hami_version=args.hami_version,
        hami_core_commit=args.hami_core_commit,
        platforms=args.platforms,
        push=args.push,
    )
    try:
        if "STORAGE_DRIVER" not in os.environ and storage_on_overlay():
            # podman and buildah read it: plain copies where overlay cannot stack
            os.environ["STORAGE_DRIVER"] = "vfs"
            print("storage: vfs (containers' storage is on overlayfs)", flush=True)
        facts = gather(os.environ)
        if not facts.engines and args.action != "plan":
            ensure_debian_packages(["buildah"])
            facts = gather(os.environ)
        if args.action == "plan":
            _describe(plan(facts, request))
            return 0
        p = build(facts, request) if args.action in ("build", "all") else plan(facts, request)
        if p.multi_arch:
            return 0  # a multi-arch image is pushed or written whole by buildx
        if args.action in ("check", "all"):
            failures = check(p.builder, request.image, version)
            print(f"image size: {image_size(p.builder, request.image)}", flush=True)
            if failures:
                print("\n".join(["image check failed:", *failures]), file=sys.stderr)
                return 1
        if args.action in ("archive", "all"):
            archive(p.builder, request.image, args.archive or _archive_path(request, p))
    except PlanError as exc:
        print(f"build_image: {exc}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as exc:
        print(f"build_image: {' '.join(exc.cmd)} failed (exit {exc.returncode})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
