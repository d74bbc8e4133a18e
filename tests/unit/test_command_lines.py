"""Small things an operator trips on, on every command line.

* a flag must be spelled out (``--memory-unit 512`` is no ``--memory-unit-mib``);
* ``--help`` lists the values of every option with choices;
* a relative ``--kubelet-dir`` is refused with one line, before any gRPC;
* ``install`` without ``--image`` warns and says how to build and push.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kit.kube_double import KubeApiDouble
from test_kubectl import api  # noqa: F401  (the API-server double with three nodes)

from gpushare import config
from gpushare.extender import httpserver
from gpushare.ops import deploy, inspect, kubectl


def parsers() -> Iterator[argparse.ArgumentParser]:
    """Every parser a user meets: the daemon's, the extender's, the kubectl plugin's and
    each of its subcommands'."""
    yield config.build_parser()
    yield httpserver.build_parser()
    yield inspect.build_parser()
    top = kubectl.build_parser()
    yield top
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.values()


PARSERS = list(parsers())


def _long_flags(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--")]


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.prog)
def test_abbreviated_flags_are_refused(parser: argparse.ArgumentParser) -> None:
    flags = _long_flags(parser)
    tried = 0
    for flag in flags:
        short = flag[:-1]
        if len(short) <= 3 or short in flags or flag in ("--help", "--version"):
            continue
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([short, "x"])
        assert exit_.value.code == 2, (parser.prog, short)
        tried += 1
    assert tried or set(flags) <= {"--help", "--version", "--output"}, parser.prog


@pytest.mark.parametrize(
    "module,args",
    [
        ("gpushare.sim.demo", ["--log-lev", "debug"]),
        ("gpushare.bench", ["--quic"]),
        ("gpushare.sim.trace", ["--see", "1"]),
    ],
)
def test_the_other_commands_refuse_abbreviations_too(module: str, args: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert "unrecognized arguments" in result.stderr


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.prog)
def test_help_lists_the_values_of_every_choice(parser: argparse.ArgumentParser) -> None:
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.choices and not isinstance(action, argparse._SubParsersAction):
            for choice in action.choices:
                assert str(choice) in text, (parser.prog, action.dest, choice)


def test_the_daemons_help_names_every_enumerated_value() -> None:
    text = " ".join(config.build_parser().format_help().split())
    for option in config.OPTIONS:
        for choice in option.metadata["choices"]:
            assert choice in text
    assert "one of: none, single, mixed" in text


@pytest.mark.parametrize("where", ["flag", "env"])
def test_a_relative_kubelet_dir_is_refused_in_one_line(where: str, tmp_path: Path) -> None:
    argv, env = (["--kubelet-dir", "dp"], {}) if where == "flag" else ([], {
        "GPUSHARE_KUBELET_DIR": "var/lib/kubelet/device-plugins"
    })
    result = subprocess.run(
        [sys.executable, "-m", "gpushare.daemon", *argv, "--simulate", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", **env},
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "kubelet_dir" in line and "is not an absolute path" in line


def test_install_without_an_image_says_how_to_build_and_push(
    api: KubeApiDouble,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    shipped = deploy.shipped_image(deploy.load_objects())
    assert kubectl.main(["install", "--node", "gpu-a"]) == 0
    out = capsys.readouterr().out
    warning = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and shipped in warning[0]
    assert "make image PUSH=1" in warning[0] and "--image" in warning[0]
    # with an image, or once an earlier install set one, nothing to warn about
    assert kubectl.main(["install", "--node", "gpu-a", "--image", "reg.example/gpushare:1"]) == 0
    assert "warning:" not in capsys.readouterr().out
    assert kubectl.main(["install", "--node", "gpu-b"]) == 0
    assert "warning:" not in capsys.readouterr().out
