"""The chart and the daemon accept exactly the same configuration.

Every option's enumerated values, bounds, types and patterns, and every cross-field rule
of ``gpushare.config.RULES``, are fed to both sides: Helm (the chart's values.schema.json
and templates, rendered by Helm's own Go SDK) and the daemon's config loader, which reads
the ConfigMap the chart rendered, as the pod does. Where Helm accepts, the daemon starts
with that file; where Helm refuses, the daemon refuses the same value in its file.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from test_deploy_manifests import chart_objects, one

from gpushare.config import OPTIONS, RULES, ConfigError, Settings, load_settings, yaml_key
from gpushare.share.cardmodes import CARD_MODES_PATTERN, parse_card_modes

DEFAULTS = Settings()

#: Values of the string options that have a pattern: good ones and bad ones.
TEXT_SAMPLES: dict[str, list[Any]] = {
    "kubelet_dir": ["/var/lib/k0s/kubelet/device-plugins", "var/lib/kubelet", "./dp", ""],
    "pod_resources_socket": ["/x/kubelet.sock", "kubelet.sock"],
    "library": ["/opt/lib/libvgpu.so", "lib/libvgpu.so"],
    "host_lib_dir": ["/usr/local/vgpu", "usr/local/vgpu"],
    "resource_prefix": [
        "gpushare.io",
        "baidu.com",
        "a",
        "kubernetes.io",
        "gpu.kubernetes.io",
        "notkubernetes.io",
        "kubernetes.io.example",
        "Upper.io",
        "a/b",
        "-a.io",
        "a" * 253,
        "a" * 254,
        "",
        "gpushare.io\n",
    ],
    "ignored_xids": ["13,31", " 13 , 31 ", "all", "ALL", "", "13;31", "13,", "x", "13\n", "\u0661"],
    "dra_driver": ["gpu.gpushare.io", "gpu", "Gpu.io", "a" * 63 + ".io", "x.io\n", ""],
    "dra_kubelet_root": ["/var/lib/kubelet", "var/lib/kubelet", ""],
    "dra_cdi_dir": ["/var/run/cdi", "run/cdi", ""],
    "dra_state_dir": ["", "/var/lib/gpushare/dra", "dra"],
    "opt_in_label": ["", "gpushare.io/enabled=true", "a=", "enabled", "a=b=c", "a b=c", "x=y\n"],
    "card_modes": [
        "0=dra",
        "0=DRA,1=shared",
        "0=exclusive",
        " 0 = Exclusive , GPU-1a2b=shared,",
        "0=both,1=shared",
        "0=exclusiv",
        "0",
        "=shared",
        "0=shared,0=both",
        "a b=shared",
        "0=shared\n",
        "0\t=shared",
    ],
    "device_list_strategy": [
        "envvar",
        "cdi-cri",
        "cdi-annotations",
        "envvar, cdi-cri",
        "cdi",
        "",
        "envvar,,cdi-cri",
        "Envvar",
        "cdi-cri\n",
    ],
    "cdi_kind": ["nvidia.com/gpu", "example.com/dev_1", "nvidia.com", "Nvidia.com/gpu", "/gpu"],
    "cdi_spec_dirs": ["/etc/cdi", "/etc/cdi, /var/run/cdi,", "", "etc/cdi", "/a b", "/x\n"],
    "memory_enforcement": [
        "auto",
        "Driver",
        " interposer , 0 = driver , GPU-1a=hardware,",
        "0=auto",
        "",
        "mps",
        "driver,interposer",
        "0=driver,0=interposer",
        "0=driver=x",
        "a b=driver",
        "driver\n",
    ],
    "compute_enforcement": [
        "auto",
        "none,0=interposer",
        "0=mps",
        "hardware",
        "driver",
        "1=none,1=none",
    ],
    "memory_hook": ["/opt/gpushare/lib/gpushare-memory-hook", "hook", ""],
    "cgroup_root": ["/sys/fs/cgroup", "sys/fs/cgroup", ""],
    "mps_control": ["", "/usr/bin/nvidia-cuda-mps-control", "nvidia-cuda-mps-control", " /x"],
    "time_slice_replicas": ["4", "4,0=8", " 0 = 64 , GPU-1=1", "0", "65", "4,8", "0=2,0=3"],
}

#: Values of the options a rule matches with a pattern: some that match, some that do not.
RULE_SAMPLES: dict[str, list[Any]] = {
    "card_modes": ["0=exclusive", "GPU-1=Exclusive , 1=shared", "0=shared", "0=timeslice", ""],
    "device_list_strategy": ["cdi-cri", "envvar, cdi-annotations", "envvar"],
    "cdi_spec_dirs": ["", " , ", "/etc/cdi"],
    "memory_enforcement": ["interposer", "auto,0=Interposer", "driver", "0=hardware"],
    "compute_enforcement": ["1=interposer , none", "INTERPOSER", "auto"],
}

#: Options whose test value must come with another to be acceptable on its own.
COMPANIONS: dict[str, dict[str, Any]] = {
    "card_modes": {"wholeCards": True},
    "mig_sharing": {"migStrategy": "mixed"},
}


def samples(option: dataclasses.Field[Any]) -> list[Any]:
    """Values of one option worth judging: each enumerated value, the bounds and one
    step past them, the wrong YAML types, and the pattern samples above."""
    default, meta = option.default, option.metadata
    if isinstance(default, bool):
        return [True, False, "yes", "true", 1, 0, [True]]
    if isinstance(default, int | float):
        low, high = meta["bounds"]
        step = 1 if isinstance(default, int) else 0.5
        values = [low, high, low - step, high + step, default, str(default), True, [default]]
        if isinstance(default, int):
            values += [float(default), default + 0.5]
        return values
    if meta["choices"]:
        choices = list(meta["choices"])
        return [*choices, choices[0].upper(), "bogus", "", 1, [choices[0]]]
    extra = TEXT_SAMPLES.get(option.name, [default, "", "any text"])
    return [default, *extra, 7, True, {"a": 1}]


def helm_config(config: dict[str, Any]) -> str | None:
    """The daemon's config file as the chart renders it, or None if Helm refuses."""
    try:
        objects = chart_objects({"config": config})
    except helm_python.HelmError:
        return None
    configmap = next(
        o for o in objects if o["kind"] == "ConfigMap" and "config.yaml" in o.get("data", {})
    )
    return str(configmap["data"]["config.yaml"])


def daemon_accepts(text: str, tmp_path: Path) -> bool:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    try:
        load_settings([f"--config={path}"], {})
    except ConfigError:
        return False
    return True


def judge(config: dict[str, Any], tmp_path: Path) -> tuple[bool, bool]:
    """(Helm accepts, the daemon accepts). Where Helm accepts, the daemon is given the
    file Helm rendered; where it refuses, the same values as a file of its own."""
    rendered = helm_config(config)
    if rendered is not None:
        return True, daemon_accepts(rendered, tmp_path)
    return False, daemon_accepts(yaml.safe_dump(config), tmp_path)


def test_every_patterned_option_has_samples() -> None:
    patterned = {o.name for o in OPTIONS if o.metadata["pattern"]}
    assert patterned <= set(TEXT_SAMPLES), patterned - set(TEXT_SAMPLES)


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: yaml_key(o.name))
def test_helm_and_the_daemon_judge_every_value_alike(
    option: dataclasses.Field[Any], tmp_path: Path
) -> None:
    verdicts = {}
    for value in samples(option):
        config = {yaml_key(option.name): value, **COMPANIONS.get(option.name, {})}
        helm, daemon = judge(config, tmp_path)
        verdicts[repr(value)] = (helm, daemon)
        assert helm == daemon, f"{config}: helm {'accepts' if helm else 'refuses'}"
    # each option's samples hold at least one value both accept and one both refuse
    assert {True, False} == {h for h, _ in verdicts.values()}, verdicts


def _rule_values(name: str, when: Any) -> list[Any]:
    """For one condition of a rule: left out (null: the default), values that meet it,
    and values that do not."""
    option = next(o for o in OPTIONS if o.name == name)
    if when.finds:
        return [None, *RULE_SAMPLES[name]]
    others = [v for v in samples(option) if type(v) is type(option.default)]
    misses = [v for v in others if not when.holds(v)][:1]
    return [None, *when.values, *misses]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.blame}")
def test_every_cross_field_rule_holds_on_both_sides(rule: Any, tmp_path: Path) -> None:
    names = [name for name, _ in rule.when]
    choices = [_rule_values(name, when) for name, when in rule.when]
    broken = 0
    for combination in itertools.product(*choices):
        config = {yaml_key(n): v for n, v in zip(names, combination, strict=True)}
        helm, daemon = judge(config, tmp_path)
        assert helm == daemon, f"{config}: helm {'accepts' if helm else 'refuses'}"
        values = dict(zip(names, combination, strict=True))
        effective = {n: getattr(DEFAULTS, n) if v is None else v for n, v in values.items()}
        meets = all(when.holds(effective[n]) for n, when in rule.when)
        if meets:  # refused by both; where it does not, other checks may still refuse
            assert not helm, config
        broken += meets
    assert broken, "no combination broke the rule"


@pytest.mark.parametrize(
    "config,says",
    [
        ({"deviceListStrategy": "cdi"}, "device_list_strategy"),
        ({"resourcePrefix": "kubernetes.io"}, "resource_prefix"),
        ({"cardModes": "0=exclusiv", "wholeCards": True}, "card_modes"),
        ({"migStrategy": "single", "wholeCards": True}, "mig_strategy"),
        ({"memoryUnitMib": "512"}, "memory_unit_mib"),
        ({"wholeCards": "yes"}, "whole_cards"),
        ({"kubeletDir": "var/lib/kubelet/device-plugins"}, "kubelet_dir"),
    ],
)
def test_the_values_the_issue_names_are_refused_by_both(
    config: dict[str, Any], says: str, tmp_path: Path
) -> None:
    assert helm_config(config) is None
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=says):
        load_settings([f"--config={path}"], {})


@pytest.mark.parametrize(
    "option, value, says",
    [
        ("memoryEnforcement", "driver, interposer", "gives the node a backend twice"),
        ("computeEnforcement", "0=none,0 =mps", "gives card 0 a backend twice"),
    ],
)
def test_a_backend_given_twice_is_refused_by_the_template(
    option: str, value: str, says: str
) -> None:
    with pytest.raises(helm_python.HelmError, match=says):
        chart_objects({"config": {option: value}})


def test_a_card_named_twice_is_refused_by_the_template_with_one_line() -> None:
    with pytest.raises(helm_python.HelmError, match="names card 0 twice"):
        chart_objects({"config": {"cardModes": "0=shared, 0 =both"}})
    assert one(chart_objects({"config": {"cardModes": "0=shared,1=both"}}), "DaemonSet")


_PATTERN = re.compile(CARD_MODES_PATTERN.replace("$", r"\Z"))
_TEXT = st.text(alphabet=st.sampled_from(list("01aG-= ,\tsharedexclusivebothSHX\n")), max_size=24)


@given(_TEXT)
@settings(max_examples=400, deadline=None)
def test_the_card_modes_pattern_and_parser_agree(text: str) -> None:
    try:
        parse_card_modes(text)
        parsed = True
    except ValueError as exc:
        parsed = "twice" in str(exc)  # a card named twice: the pattern cannot see it
    assert parsed == bool(_PATTERN.search(text)), repr(text)
