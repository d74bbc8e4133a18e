"""One version everywhere, and the start line that names every setting's origin."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from conftest import TESLA_P4, Node, cards
from kit.procs import daemon_command
from kit.scripts import SCRIPTS, build_image

from gpushare import __version__
from gpushare.config import OPTIONS, yaml_key


def test_the_start_line_names_the_version_and_every_setting_with_its_origin(node: Node) -> None:
    node.write_gpus(cards(TESLA_P4, 1))
    command = daemon_command(node)
    command[command.index("--library") + 1] = "/nonexistent/libvgpu.so"  # stops right after
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=30,
        env={"GPUSHARE_PLACEMENT": "spread", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 1
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    starting = [e for e in events if e["event"] == "starting"]
    assert len(starting) == 1
    line = starting[0]
    assert line["version"] == __version__
    assert line["python"] and line["grpc"]
    config = line["config"]
    assert set(config) == {yaml_key(o.name) for o in OPTIONS}
    assert config["placement"] == {"value": "spread", "from": "env GPUSHARE_PLACEMENT"}
    assert config["library"] == {"value": "/nonexistent/libvgpu.so", "from": "flag --library"}
    assert config["memoryUnitMib"] == {"value": 256, "from": "default"}


def test_version_flags_print_the_package_version() -> None:
    for module, prog in (
        ("gpushare.daemon", "gpushare-device-plugin"),
        ("gpushare.sim.demo", "gpushare-demo"),
        ("gpushare.extender.httpserver", "gpushare-scheduler-extender"),
        ("gpushare.ops.kubectl", "kubectl gpushare"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=30
        )
        assert result.returncode == 0
        assert result.stdout.strip() == f"{prog} {__version__}"


ROOT = Path(__file__).resolve().parents[2]


def test_chart_image_manifests_and_makefile_carry_the_package_version() -> None:
    chart = yaml.safe_load((ROOT / "charts" / "gpushare" / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == __version__
    for path in (ROOT / "daemonset").rglob("*.yaml"):
        for image in re.findall(r"image:\s*(\S*gpushare:\S+)", path.read_text()):
            assert image.rsplit(":", 1)[1] == __version__, path
    make = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "version"], capture_output=True, text=True, timeout=30
    )
    assert make.stdout.strip() == __version__
    dry_run = subprocess.run(
        ["make", "-n", "-C", str(ROOT), "image"], capture_output=True, text=True, timeout=30
    ).stdout
    assert f"--image gpushare:{__version__}" in dry_run
    # the build script reads the same version and passes it to the Dockerfile
    plan = build_image.plan(_facts(), _request(build_image._version()))
    assert plan.build_args["VERSION"] == __version__


def _facts(buildx: bool = True) -> Any:
    everywhere = frozenset(build_image.PROBES)
    return build_image.Facts(("docker",), buildx, everywhere, "x86_64")


def _request(version: str = __version__, **kw: Any) -> Any:
    return build_image.Request(image=kw.pop("image", f"gpushare:{version}"), version=version, **kw)


def test_make_image_builds_both_architectures_with_buildx_and_falls_back_without() -> None:
    def command(buildx: bool = True, **kw: Any) -> str:
        request = _request(**kw)
        plan = build_image.plan(_facts(buildx), request)
        return " ".join(
            build_image.build_command(plan, request, build_image._archive_path(request, plan))
        )

    default = command()
    assert default.startswith("docker buildx build")  # buildx where available
    assert "--platform=linux/amd64,linux/arm64" in default
    assert f"--output=type=oci,dest=dist/gpushare-{__version__}.oci.tar" in default  # no push
    assert "--push" not in default
    pushed = command(image="registry.example.com/gpushare:1", push=True)
    assert "--push" in pushed and "--tag=registry.example.com/gpushare:1" in pushed
    fallback = command(buildx=False)
    assert fallback.startswith("docker build ") and "--build-arg=TARGETARCH=amd64" in fallback
    # the fallback pushes too (after the build): build_image.build
    assert '_run([p.builder, "push", request.image])' in (SCRIPTS / "build_image.py").read_text()
    make = subprocess.run(["make", "-n", "-C", str(ROOT), "image", "PUSH=1"],
                          capture_output=True, text=True, timeout=30).stdout  # fmt: skip
    assert "--push" in make
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG VERSION" in dockerfile and "org.opencontainers.image.version" in dockerfile


def test_the_distribution_is_gpushare_device_plugin_and_no_doc_says_install_gpushare() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "gpushare-device-plugin"
    assert "version" in project["dynamic"]  # read from gpushare.__version__
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for line in path.read_text().splitlines():
            if re.search(r"pip3? install\s+(?:-U\s+)?gpushare(?![-_\w])", line):
                assert "Never" in line or "Do not" in line, f"{path.name}: {line}"
