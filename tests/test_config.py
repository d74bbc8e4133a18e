"""Settings: flags > environment > file > defaults, and errors that name the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpushare.config import OPTIONS, ConfigError, Settings, env_name, load_settings, yaml_key


def test_defaults_are_what_the_readme_promises() -> None:
    settings = load_settings([], {})
    assert settings == Settings()
    assert settings.memory_resource == "gpushare.io/vcuda-memory"
    assert settings.core_resource == "gpushare.io/vcuda-core"
    assert settings.ignored_xid_set() == frozenset({13, 31, 43, 45, 68, 109})


def test_flag_beats_env_beats_file(tmp_path: Path) -> None:
    config = tmp_path / "gpushare.yaml"
    config.write_text("memoryUnitMib: 512\nplacement: spread\nresourcePrefix: from.file\n")
    env = {"GPUSHARE_MEMORY_UNIT_MIB": "1024", "GPUSHARE_PLACEMENT": "binpack"}
    settings = load_settings(["--config", str(config), "--memory-unit-mib", "2048"], env)
    assert settings.memory_unit_mib == 2048  # flag
    assert settings.placement == "binpack"  # env over file
    assert settings.resource_prefix == "from.file"  # file over default
    assert settings.kubelet_dir == Settings().kubelet_dir  # default


def test_node_name_comes_from_the_downward_api_variable() -> None:
    assert load_settings([], {"NODE_NAME": "gpu-7"}).node_name == "gpu-7"


def test_booleans_from_env_and_file(tmp_path: Path) -> None:
    assert load_settings([], {"GPUSHARE_NO_ENFORCEMENT": "true"}).no_enforcement
    config = tmp_path / "c.yaml"
    config.write_text("noEnforcement: yes\n")
    assert load_settings(["--config", str(config)], {}).no_enforcement


def test_every_option_has_a_flag_an_env_and_a_file_key() -> None:
    names = [o.name for o in OPTIONS]
    assert len({yaml_key(n) for n in names}) == len(names)
    assert len({env_name(o) for o in OPTIONS}) == len(names)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("colour: blue\n", "unknown key 'colour' in config file"),
        ("memoryUnitMib: lots\n", "bad value for memory_unit_mib (key memoryUnitMib in"),
        ("placement: random\n", "'random' is not one of binpack, spread"),
        ("metricsPort: 70000\n", "metrics_port"),
        ("ignoredXids: a,b\n", "ignored_xids"),
        ("- a list\n", "must hold a mapping"),
        ("memoryUnitMib: [1\n", "is not valid YAML"),
    ],
)
def test_bad_config_files_name_the_key_and_the_file(
    tmp_path: Path, text: str, expected: str
) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_settings(["--config", str(config)], {})
    assert expected in str(error.value)
    assert str(config) in str(error.value)


def test_a_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"memory_unit_mib \(env GPUSHARE_MEMORY_UNIT_MIB\)"):
        load_settings([], {"GPUSHARE_MEMORY_UNIT_MIB": "0"})


def test_a_config_error_exits_2_with_one_line(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("kubeletdir: /x\n")
    result = subprocess.run(
        [sys.executable, "-m", "gpushare.daemon", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "unknown key 'kubeletdir'" in lines[0] and str(config) in lines[0]
