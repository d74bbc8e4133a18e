"""Settings: flags > environment > file > defaults, and errors that name the key."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from kit.sizes import at_two_sizes

from gpushare.config import (
    OPTIONS,
    ConfigError,
    Settings,
    effective_config,
    env_name,
    load_settings,
    load_settings_with_origins,
    yaml_key,
)


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


# -- hostile and mistaken values: one bounded line, exit 2 ------------------------------

FLOAT_OPTIONS = [o for o in OPTIONS if isinstance(o.default, float)]


@pytest.mark.parametrize("option", FLOAT_OPTIONS, ids=lambda o: o.name)
@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "1e400", "0", "-5", "1e9", "0.001"])
def test_every_float_setting_refuses_non_finite_and_out_of_range(
    option: dataclasses.Field[Any], text: str, tmp_path: Path
) -> None:
    low, high = option.metadata["bounds"]
    assert 0 < low <= option.default <= high  # the default itself is in range
    flag = "--" + option.name.replace("_", "-")
    config = tmp_path / "c.yaml"
    config.write_text(f"{yaml_key(option.name)}: {text}\n")
    for argv, env in (([f"{flag}={text}"], {}), ([], {env_name(option): text})):
        with pytest.raises(ConfigError, match=option.name) as error:
            load_settings(argv, env)
        assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match=option.name):
        load_settings(["--config", str(config)], {})


@pytest.mark.parametrize(
    "text,expected",
    [
        ("memoryUnitMib: [1, 2]\n", "expected an integer, got list"),
        ("memoryUnitMib: {a: 1}\n", "expected an integer, got dict"),
        ("memoryUnitMib: 1.5\n", "expected an integer"),
        ("gcGraceSeconds: [1]\n", "expected a number, got list"),
        ("gcGraceSeconds: .nan\n", "expected a finite number"),
        ("gcGraceSeconds: .inf\n", "expected a finite number"),
        ("placement: [binpack]\n", "expected a string, got list"),
        ("noEnforcement: [true]\n", "expected true or false"),
        ("ignoredXids: [13, x]\n", "expected a list of integers"),
        ("resourcePrefix: Not_A_Domain\n", "is not a DNS name"),
        ("resourcePrefix: kubernetes.io\n", "kubernetes.io is reserved"),
        ("memoryUnitMib: 99999999999999999999999999\n", "between 1 and 1048576"),
        ("memoryUnitMib: " + "9" * 5000 + "\n", "not valid YAML"),
    ],
)
def test_values_of_the_wrong_shape_are_one_line_errors(
    tmp_path: Path, text: str, expected: str
) -> None:
    assert_refused_in_one_line(tmp_path, text, expected)


def assert_refused_in_one_line(tmp_path: Path, text: str, expected: str) -> None:
    """The config file ``text`` is refused with one short line that says ``expected``."""
    config = tmp_path / "config.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_settings(["--config", str(config)], {})
    message = str(error.value)
    assert expected in message
    assert "\n" not in message and len(message) <= 1000


def test_ignored_xids_accepts_a_yaml_list(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("ignoredXids: [13, 31, 79]\n")
    assert load_settings(["--config", str(config)], {}).ignored_xid_set() == {13, 31, 79}


YAML_BOMB = """a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
memoryUnitMib: [*f,*f,*f,*f,*f,*f,*f,*f,*f]
"""


@pytest.mark.parametrize(
    "text,expected",
    [
        (YAML_BOMB, "aliases (*name) are not allowed"),
        ("memoryUnitMib: " + "[" * 50_000 + "\n", "not valid YAML"),
        ("memoryUnitMib: 256\n" + "#" * (70 << 10) + "\n", "larger than 64 KiB"),
        ("memoryUnitMib: '" + "x" * 60_000 + "'\n", "expected an integer"),
        ("x" * 1000 + ": 1\n", "unknown key"),
    ],
)
def test_hostile_config_files_cost_little_and_say_one_short_line(
    tmp_path: Path, text: str, expected: str
) -> None:
    assert_refused_in_one_line(tmp_path, text, expected)


@at_two_sizes(
    given(
        key=st.sampled_from([yaml_key(o.name) for o in OPTIONS]),
        value=st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
            max_leaves=8,
        ),
    ),
    quick=80,
    full=300,
    deadline=None,
)
def test_any_value_for_any_key_loads_or_is_refused_in_one_line(key: str, value: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "c.yaml"
        config.write_text(yaml.safe_dump({key: value}))
        try:
            loaded = load_settings(["--config", str(config)], {})
        except ConfigError as exc:
            assert "\n" not in str(exc) and len(str(exc)) <= 1000
        else:
            assert isinstance(loaded, Settings)


@pytest.mark.parametrize(
    "command",
    [
        ["gpushare.daemon", "--placement", "random"],
        ["gpushare.daemon", "--gc-grace-seconds", "nan"],
        ["gpushare.daemon", "--memory-unit-mib", "[1,2]"],
        ["gpushare.sim.demo", "--log-level", "loud"],
    ],
)
def test_bad_command_lines_exit_2_with_one_line(command: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", *command], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stdout == ""


def test_the_effective_configuration_names_every_key_and_its_origin(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("placement: spread\n")
    settings, origins = load_settings_with_origins(
        ["--config", str(config), "--memory-unit-mib", "512"], {"GPUSHARE_LOG_LEVEL": "debug"}
    )
    effective = effective_config(settings, origins)
    assert set(effective) == {yaml_key(o.name) for o in OPTIONS}
    assert effective["memoryUnitMib"] == {"value": 512, "from": "flag --memory-unit-mib"}
    assert effective["logLevel"] == {"value": "debug", "from": "env GPUSHARE_LOG_LEVEL"}
    assert effective["placement"] == {"value": "spread", "from": f"key placement in {config}"}
    assert effective["kubeletDir"]["from"] == "default"


@pytest.mark.parametrize(
    "command",
    [
        ["gpushare.extender.httpserver", "--ledger-timeout-seconds=nan"],
        ["gpushare.extender.httpserver", "--ledger-timeout-seconds=inf"],
        ["gpushare.extender.httpserver", "--ledger-timeout-seconds=-1"],
        ["gpushare.ops.kubectl", "uninstall", "--wait=nan"],
        ["gpushare.ops.kubectl", "uninstall", "--wait=1e999"],
    ],
)
def test_float_flags_of_the_other_commands_refuse_non_finite_values(command: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", *command], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "is not between" in line
