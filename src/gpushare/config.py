"""Typed settings for the daemon: flags > environment > YAML file > defaults.

Every option is declared once, as a field of :class:`Settings` with its help text.
From that one declaration come the command-line flag (``--memory-unit-mib``), the
environment variable (``GPUSHARE_MEMORY_UNIT_MIB``) and the YAML key
(``memoryUnitMib``). The Helm chart's values are checked against the same list.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpushare.base.cli import Parser, add_version, one_line
from gpushare.share.backendchoice import (
    COMPUTE_PINS,
    COMPUTE_PINS_PATTERN,
    MEMORY_PINS,
    MEMORY_PINS_PATTERN,
    PINS_INTERPOSER,
    parse_pins,
)
from gpushare.share.cardmodes import (
    CARD_MODES_PATTERN,
    EXCLUSIVE_ENTRY,
    REPLICAS_PATTERN,
    parse_card_modes,
    parse_replicas,
)

ENV_PREFIX = "GPUSHARE_"

PLACEMENTS = ("binpack", "spread")
PRELOAD_MODES = ("env", "file", "both")
LOG_FORMATS = ("auto", "json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")
CDI_NAME_STRATEGIES = ("uuid", "index")
#: A CDI kind: ``<vendor>/<class>`` (CDI spec: vendor a domain-like name, class alphanumeric).
CDI_KIND_PATTERN = r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?/[a-zA-Z0-9]([a-zA-Z0-9_.-]*[a-zA-Z0-9])?$"
DEVICE_LIST_STRATEGIES = ("envvar", "cdi-cri", "cdi-annotations")
MIG_STRATEGIES = ("none", "single", "mixed")

#: XIDs that report an application's own fault, not the card's (NVIDIA's defaults).
DEFAULT_IGNORED_XIDS = "13,31,43,45,68,109"


#: A config file larger than this is refused unread (the real ones are a few hundred bytes).
CONFIG_FILE_LIMIT = 64 << 10
#: A value quoted in an error message is cut to this many characters.
QUOTE_LIMIT = 60

# Patterns below are written in the dialect that Python's ``re``, Go's ``regexp`` (Helm's
# schema validator) and ECMA-262 read alike: no ``\s`` or ``\d`` (their sets differ: Python's
# take Unicode), blanks are plain spaces, and ``$`` means the end of the text (Python is given
# ``\Z`` for it, see :func:`matcher`: its ``$`` also matches before a final newline).

#: A DNS subdomain (RFC 1123), as Kubernetes requires of a resource name's prefix.
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
#: Kubernetes keeps these for itself: an extended resource may not be named under them.
RESERVED_PREFIX = r"(^|\.)kubernetes\.io$"
#: What ``ignoredXids`` may say as a string (the chart's schema uses it too).
XIDS_PATTERN = r"^ *([Aa][Ll][Ll]|[0-9]+( *, *[0-9]+)*)? *$"
_STRATEGY = "(" + "|".join(DEVICE_LIST_STRATEGIES) + ")"
#: ``deviceListStrategy``: one or more of the strategies, comma-separated.
DEVICE_LIST_PATTERN = rf"^ *{_STRATEGY}( *, *{_STRATEGY})* *$"
#: An absolute path (the daemon runs in a container: a relative one means nothing there).
ABSOLUTE_PATH = r"^/"
OPTIONAL_ABSOLUTE_PATH = r"^(/.*)?$"
#: ``cdiSpecDirs``: absolute paths (no blanks inside), comma-separated; empty entries skipped.
PATH_LIST_PATTERN = r"^ *(/[^, ]*)?( *, *(/[^, ]*)?)* *$"
#: Found in a ``deviceListStrategy`` that names a CDI strategy.
CDI_STRATEGY = r"cdi-"
#: A ``cdiSpecDirs`` that names no directory.
NO_PATHS = r"^[ ,]*$"


def matcher(pattern: str) -> re.Pattern[str]:
    """``pattern`` (the shared dialect above) compiled for Python, meaning what Go means."""
    return re.compile(pattern.replace("$", r"\Z"))


def quote(value: Any) -> str:
    """A value as an error message shows it: its repr, cut short."""
    text = repr(value) if not isinstance(value, list | dict) else type(value).__name__
    return one_line(text, QUOTE_LIMIT)


class ConfigError(Exception):
    """A setting that cannot be used; the message names the key and where it came from.
    It is always one line of bounded length, whatever the input was."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


def _opt(
    default: Any,
    help: str,
    *,
    choices: Sequence[str] = (),
    env: str = "",
    bounds: tuple[float, float] | None = None,
    pattern: str = "",
    forbid: str = "",
    max_length: int | None = None,
    shape: str = "",
) -> Any:
    """One option, described once: the daemon's checks and the chart's schema
    (:mod:`gpushare.ops.chartschema`) both read this description.

    ``pattern``: a string value must match it; ``forbid``: it must not; ``shape``: what the
    error message says a good value looks like.
    """
    metadata = {
        "help": help,
        "choices": tuple(choices),
        "env": env,
        "bounds": bounds,
        "pattern": pattern,
        "forbid": forbid,
        "max_length": max_length,
        "shape": shape,
    }
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Settings:
    """Everything the daemon can be told. Field order is the order of ``--help``."""

    kubelet_dir: str = _opt(
        "/var/lib/kubelet/device-plugins",
        "directory holding kubelet.sock; the plugin's own sockets are created here",
        pattern=ABSOLUTE_PATH,
        shape="an absolute path",
    )
    pod_resources_socket: str = _opt(
        "/var/lib/kubelet/pod-resources/kubelet.sock",
        "the kubelet's PodResources socket, read to learn which units are in use",
        pattern=ABSOLUTE_PATH,
        shape="an absolute path",
    )
    resource_prefix: str = _opt(
        "gpushare.io",
        "prefix of the resource names, e.g. baidu.com for baidu.com/vcuda-memory",
        pattern=DNS_SUBDOMAIN,
        forbid=RESERVED_PREFIX,
        max_length=253,
        shape="a DNS name like gpushare.io (lower case letters, digits, '-' and '.'; "
        "kubernetes.io is reserved)",
    )
    memory_unit_mib: int = _opt(
        256, "MiB of GPU memory in one vcuda-memory unit", bounds=(1, 1 << 20)
    )
    placement: str = _opt(
        "binpack",
        "which card a container gets: the fullest that fits, or the emptiest",
        choices=PLACEMENTS,
    )
    library: str = _opt(
        "/opt/gpushare/lib/libvgpu.so",
        "the interposer library (HAMi-core libvgpu.so) to install",
        pattern=ABSOLUTE_PATH,
        shape="an absolute path",
    )
    host_lib_dir: str = _opt(
        "/usr/local/vgpu",
        "host directory for the versioned library copy and the per-container cache directories",
        pattern=ABSOLUTE_PATH,
        shape="an absolute path",
    )
    preload: str = _opt(
        "env",
        "how the library is loaded: LD_PRELOAD, a mounted /etc/ld.so.preload, or both",
        choices=PRELOAD_MODES,
    )
    no_enforcement: bool = _opt(
        False, "run without the interposer library: limits are passed as env only (not enforced)"
    )
    # Enforcement backends (docs/choosing.md) ---------------------------------------------
    memory_enforcement: str = _opt(
        "auto",
        "what holds each card's memory limits: auto (the strongest the card can have), "
        "driver (NVIDIA r615+ per-cgroup limits), interposer (HAMi-core) or hardware (MIG, "
        "whole cards); node-wide and/or <card index or UUID>=<backend>, comma-separated",
        pattern=MEMORY_PINS_PATTERN,
        shape="auto, driver, interposer or hardware, node-wide and/or <card>=<backend>, "
        "comma-separated",
    )
    compute_enforcement: str = _opt(
        "auto",
        "what holds each card's compute limits: auto, mps (needs mps_control), interposer, "
        "hardware or none; node-wide and/or <card index or UUID>=<backend>, comma-separated",
        pattern=COMPUTE_PINS_PATTERN,
        shape="auto, mps, interposer, hardware or none, node-wide and/or <card>=<backend>, "
        "comma-separated",
    )
    memory_hook: str = _opt(
        "/opt/gpushare/lib/gpushare-memory-hook",
        "the driver memory-limit hook program (an OCI createRuntime hook) to install on the "
        "host beside the interposer, for cards whose memory backend is driver and, where "
        "DRA is served, as the claims' limit check (--check-limits)",
        pattern=ABSOLUTE_PATH,
        shape="an absolute path",
    )
    mps_control: str = _opt(
        "",
        "the MPS control daemon (nvidia-cuda-mps-control) the daemon supervises, as the "
        "daemon sees it; empty: no MPS (the mps compute backend is not available)",
        pattern=OPTIONAL_ABSOLUTE_PATH,
        shape="an absolute path or empty",
    )
    cgroup_root: str = _opt(
        "/sys/fs/cgroup",
        "the host's cgroup v2 mount as the daemon sees it (the driver self-test's scratch "
        "cgroup is made here)",
        pattern=ABSOLUTE_PATH,
        shape="an absolute path",
    )
    fail_on_init_error: bool = _opt(
        False,
        "exit 1 when NVML or the GPUs cannot be read at start, instead of retrying with backoff",
    )
    simulate: str = _opt("", "YAML file describing simulated GPUs; used instead of NVML")
    node_name: str = _opt(
        "", "name of this node, for the Node and Pod annotations (downward API)", env="NODE_NAME"
    )
    node_state: str = _opt(
        "both",
        "where the card state is published: object (ConfigMap gpushare-node-<node> in the "
        "daemon's namespace, POD_NAMESPACE), annotation (the Node's gpushare.io/gpus, as "
        "older releases do) or both (during a rollout, for extenders of older releases)",
        choices=("annotation", "both", "object"),
    )
    metrics_port: int = _opt(
        9445, "port of the Prometheus /metrics and /healthz endpoint; 0 = off", bounds=(0, 65535)
    )
    metrics_address: str = _opt("0.0.0.0", "address the metrics endpoint listens on")
    ignored_xids: str = _opt(
        DEFAULT_IGNORED_XIDS,
        "comma-separated XIDs that do not make a card unhealthy, or 'all' to ignore every XID",
        pattern=XIDS_PATTERN,
        shape="comma-separated integers or 'all'",
    )
    health_recovery_seconds: float = _opt(
        300.0,
        "a card that reads well this long after a non-fatal XID is healthy again",
        bounds=(1, 7 * 86400),
    )
    pod_resources_interval_seconds: float = _opt(
        30.0,
        "how often the kubelet's PodResources records are re-read when nothing happens",
        bounds=(1, 3600),
    )
    opt_in_label: str = _opt(
        "",
        "<key>=<value>, the label the DaemonSet selects its nodes by: when the daemon stops "
        "on a node that has lost it (kubectl gpushare uninstall), it removes from "
        "--host-lib-dir what no running container uses (docs/deploy.md); empty: never",
        pattern=r"^$|^[A-Za-z0-9./_-]+=[A-Za-z0-9._-]*$",
        shape="<label key>=<value>, e.g. gpushare.io/enabled=true",
    )
    gc_grace_seconds: float = _opt(
        300.0,
        "a container cache directory unseen in PodResources this long is removed",
        bounds=(1, 7 * 86400),
    )
    # Modes (docs/modes.md) -------------------------------------------------------------
    whole_cards: bool = _opt(
        False, "also offer every card whole as <prefix>/gpu (device ID = card UUID)"
    )
    card_modes: str = _opt(
        "",
        "fixed pools: <card index or UUID>=shared|exclusive|both|dra|timeslice, "
        "comma-separated (cards not named: both, i.e. whichever use comes first; dra: "
        "published for DRA claims only, see docs/dra.md; timeslice: N replicas of "
        "<prefix>/gpu.shared, no limits)",
        pattern=CARD_MODES_PATTERN,
        shape="<card index or UUID>=shared|exclusive|both|dra|timeslice, comma-separated",
    )
    time_slice_replicas: str = _opt(
        "4",
        "replicas of <prefix>/gpu.shared a card in mode timeslice offers: node-wide N "
        "and/or <card index or UUID>=N, comma-separated (1 to 64)",
        pattern=REPLICAS_PATTERN,
        shape="N and/or <card index or UUID>=N (1 to 64), comma-separated",
    )
    exclusive_enforcement: bool = _opt(
        False, "whole cards also get the interposer, with 100%% limits (same accounting)"
    )
    device_list_strategy: str = _opt(
        "envvar",
        "how answers name their cards: envvar, cdi-cri and/or cdi-annotations, comma-separated",
        pattern=DEVICE_LIST_PATTERN,
        shape=f"a comma-separated list of {', '.join(DEVICE_LIST_STRATEGIES)}",
    )
    cdi_kind: str = _opt(
        "nvidia.com/gpu",
        "vendor/class of the CDI device names",
        pattern=CDI_KIND_PATTERN,
        shape="<vendor>/<class> like nvidia.com/gpu",
    )
    cdi_name_strategy: str = _opt(
        "uuid", "CDI device names by card UUID or card index", choices=CDI_NAME_STRATEGIES
    )
    cdi_spec_dirs: str = _opt(
        "/etc/cdi,/var/run/cdi",
        "directories of CDI specs checked for the names we hand out",
        pattern=PATH_LIST_PATTERN,
        shape="comma-separated absolute paths",
    )
    # DRA (docs/dra.md) ------------------------------------------------------------------
    dra_driver: str = _opt(
        "gpu.gpushare.io",
        "DRA driver name: the cards in card mode dra are published in ResourceSlices of it",
        pattern=DNS_SUBDOMAIN,
        max_length=63,
        shape="a DNS subdomain of at most 63 characters like gpu.gpushare.io",
    )
    dra_kubelet_root: str = _opt(
        "/var/lib/kubelet",
        "the kubelet's root directory (its plugins_registry/ and plugins/ hold the DRA sockets)",
        pattern=ABSOLUTE_PATH,
        shape="an absolute path",
    )
    dra_cdi_dir: str = _opt(
        "/var/run/cdi",
        "directory the daemon writes its own CDI specs into: DRA claims, and device-plugin "
        "grants under a cdi-* device_list_strategy",
        pattern=ABSOLUTE_PATH,
        shape="an absolute path",
    )
    dra_state_dir: str = _opt(
        "",
        "directory of the DRA checkpoint and lock file (default: <host_lib_dir>/dra)",
        pattern=r"^(/.*)?$",
        shape="empty or an absolute path",
    )
    dra_resync_seconds: float = _opt(
        10.0,
        "how often the node's ResourceSlices are checked (and re-published if deleted)",
        bounds=(0.01, 3600),
    )
    nvidia_product_label: bool = _opt(
        False, "also write nvidia.com/gpu.product (where GPU feature discovery is not installed)"
    )
    # MIG (docs/modes.md#mig) ------------------------------------------------------------
    mig_strategy: str = _opt(
        "none",
        "cards in MIG mode: none (left out), single (every MIG device as <prefix>/gpu, one "
        "profile per node) or mixed (<prefix>/mig-<profile>)",
        choices=MIG_STRATEGIES,
    )
    mig_device_specs: bool = _opt(
        False,
        "MIG answers also pass the parent's /dev/nvidia<minor> and the MIG capability nodes "
        "(/dev/nvidia-caps), for runtimes that do not add them",
    )
    mig_sharing: bool = _opt(
        False,
        "EXPERIMENTAL, with mig_strategy mixed: slice each MIG device into vcuda-memory "
        "units (no vcuda-core) instead of serving it whole",
    )
    mig_nvidia_names: bool = _opt(
        False,
        "register MIG resources as nvidia.com/mig-<profile> (single: nvidia.com/gpu) for "
        "manifests written for NVIDIA's plugin; never with NVIDIA's plugin on the same node",
    )
    cache_dir_limit_mib: int = _opt(
        64,
        "a container cache directory larger than this is logged (cache_dir_over_limit) "
        "and counted in gpushare_cache_dirs_over_limit; it holds one file of about 2 MiB",
        bounds=(1, 1 << 20),
    )
    log_format: str = _opt(
        "auto",
        "json (for the DaemonSet), console, or auto: console on a terminal",
        choices=LOG_FORMATS,
    )
    log_level: str = _opt("info", "lowest level logged", choices=LOG_LEVELS)

    # Derived views -------------------------------------------------------------------
    @property
    def memory_resource(self) -> str:
        return f"{self.resource_prefix}/vcuda-memory"

    @property
    def core_resource(self) -> str:
        return f"{self.resource_prefix}/vcuda-core"

    @property
    def kubelet_socket(self) -> Path:
        return Path(self.kubelet_dir) / "kubelet.sock"

    def device_list_strategies(self) -> frozenset[str]:
        """The ``device_list_strategy`` entries; ValueError for an unknown one."""
        chosen = frozenset(p.strip() for p in self.device_list_strategy.split(",") if p.strip())
        unknown = sorted(chosen - set(DEVICE_LIST_STRATEGIES))
        if unknown or not chosen:
            raise ValueError(
                f"{self.device_list_strategy!r}: expected a comma-separated subset of "
                f"{', '.join(DEVICE_LIST_STRATEGIES)}"
            )
        return chosen

    def cdi_spec_paths(self) -> list[Path]:
        return [Path(p.strip()) for p in self.cdi_spec_dirs.split(",") if p.strip()]

    def ignored_xid_set(self) -> frozenset[int] | None:
        """The XIDs to ignore; None means every XID is ignored."""
        return parse_xids(self.ignored_xids)


OPTIONS: tuple[dataclasses.Field[Any], ...] = dataclasses.fields(Settings)
_BY_NAME = {option.name: option for option in OPTIONS}


@dataclass(frozen=True)
class When:
    """A condition on one setting: its value is one of ``values``, or (a string) the
    pattern ``finds`` something in it."""

    values: tuple[Any, ...] = ()
    finds: str = ""

    def holds(self, value: Any) -> bool:
        if self.finds:
            return isinstance(value, str) and matcher(self.finds).search(value) is not None
        return any(type(value) is type(v) and value == v for v in self.values)


@dataclass(frozen=True)
class Rule:
    """A combination of settings the daemon refuses: every condition holds at once.
    The chart's schema refuses the same combination (``not`` of the conditions)."""

    when: tuple[tuple[str, When], ...]
    blame: str
    why: str

    def broken(self, settings: Settings) -> bool:
        return all(cond.holds(getattr(settings, name)) for name, cond in self.when)


#: The cross-field rules, checked by the daemon and generated into the chart's schema.
RULES: tuple[Rule, ...] = (
    Rule(
        (
            ("whole_cards", When((True,))),
            ("mig_strategy", When(("single",))),
            ("mig_nvidia_names", When((False,))),
        ),
        "mig_strategy",
        "single and whole_cards would both advertise <prefix>/gpu "
        "(turn one off, or set mig_nvidia_names)",
    ),
    Rule(
        (("mig_sharing", When((True,))), ("mig_strategy", When(("none", "single")))),
        "mig_sharing",
        "needs mig_strategy mixed",
    ),
    Rule(
        (("card_modes", When(finds=EXCLUSIVE_ENTRY)), ("whole_cards", When((False,)))),
        "card_modes",
        "a card in exclusive mode needs whole_cards (--whole-cards) on",
    ),
    Rule(
        (
            ("device_list_strategy", When(finds=CDI_STRATEGY)),
            ("cdi_spec_dirs", When(finds=NO_PATHS)),
        ),
        "cdi_spec_dirs",
        "a cdi-* device_list_strategy needs a CDI spec directory (where the names are checked)",
    ),
    Rule(
        (
            ("no_enforcement", When((True,))),
            ("memory_enforcement", When(finds=PINS_INTERPOSER)),
        ),
        "memory_enforcement",
        "pins the interposer, which no_enforcement turns off",
    ),
    Rule(
        (
            ("no_enforcement", When((True,))),
            ("compute_enforcement", When(finds=PINS_INTERPOSER)),
        ),
        "compute_enforcement",
        "pins the interposer, which no_enforcement turns off",
    ),
)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(option: dataclasses.Field[Any]) -> str:
    return str(option.metadata["env"] or ENV_PREFIX + option.name.upper())


def yaml_key(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def parse_xids(text: str) -> frozenset[int] | None:
    text = text.strip()
    if text.lower() == "all":
        return None
    try:
        return frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers or 'all', got {text!r}") from None


def _field_type(option: dataclasses.Field[Any]) -> type:
    return type(option.default)


def _coerce(option: dataclasses.Field[Any], value: Any, origin: str, typed: bool) -> Any:
    """Turn a raw value into the option's type: a string from a flag or the environment,
    or (``typed``) a YAML value from the config file, which must already have the type
    the chart's schema gives it (``memoryUnitMib: "512"`` is refused there and here)."""
    kind = _field_type(option)
    where = f"{option.name} ({origin})"
    try:
        if kind is bool:
            if isinstance(value, bool):
                result: Any = value
            elif typed or not isinstance(value, str):
                raise ValueError(f"expected true or false, got {quote(value)}")
            elif value.strip().lower() in ("1", "true", "yes", "on"):
                result = True
            elif value.strip().lower() in ("0", "false", "no", "off", ""):
                result = False
            else:
                raise ValueError(f"expected true or false, got {quote(value)}")
        elif kind is int:
            if isinstance(value, float) and typed and value.is_integer():
                value = int(value)  # JSON's integer: 256.0 is 256 (Helm reads it so)
            if isinstance(value, bool) or not isinstance(value, int | str):
                raise ValueError(f"expected an integer, got {quote(value)}")
            if typed and isinstance(value, str):
                raise ValueError(f"expected an integer, got the string {quote(value)}")
            result = int(value)
        elif kind is float:
            if isinstance(value, bool) or not isinstance(value, int | float | str):
                raise ValueError(f"expected a number, got {quote(value)}")
            if typed and isinstance(value, str):
                raise ValueError(f"expected a number, got the string {quote(value)}")
            result = float(value)
            if not math.isfinite(result):
                raise ValueError(f"expected a finite number, got {quote(value)}")
        elif option.name == "ignored_xids" and isinstance(value, list):
            if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value):
                raise ValueError("expected a list of integers of at least 0")
            result = ",".join(str(x) for x in value)
        else:
            if not isinstance(value, str):
                raise ValueError(f"expected a string, got {quote(value)}")
            result = value
    except ValueError as exc:
        text = str(exc)
        if not text.startswith("expected"):  # int()/float() quote the whole input
            text = f"expected {'an integer' if kind is int else 'a number'}, got {quote(value)}"
        raise ConfigError(f"bad value for {where}: {text}") from None
    choices = option.metadata["choices"]
    if choices and result not in choices:
        raise ConfigError(
            f"bad value for {where}: {quote(result)} is not one of {', '.join(choices)}"
        )
    return result


def _format_bound(bound: float) -> str:
    return f"{bound:g}" if bound < 1e6 else str(int(bound))


def _validate(settings: Settings, origins: Mapping[str, str]) -> None:
    """Every check of :func:`_opt`'s description and :data:`RULES`; the first failure is
    raised as a :class:`ConfigError` naming the option and where its value came from."""

    def fail(name: str, why: str) -> None:
        raise ConfigError(f"bad value for {name} ({origins.get(name, 'default')}): {why}")

    for option in OPTIONS:
        meta = option.metadata
        value = getattr(settings, option.name)
        bounds = meta["bounds"]
        if bounds is not None and not bounds[0] <= value <= bounds[1]:
            low, high = (_format_bound(b) for b in bounds)
            fail(option.name, f"{value:g} is not between {low} and {high}")
        if not isinstance(value, str):
            continue
        too_long = meta["max_length"] is not None and len(value) > meta["max_length"]
        if (
            too_long
            or (meta["pattern"] and not matcher(meta["pattern"]).search(value))
            or (meta["forbid"] and matcher(meta["forbid"]).search(value))
        ):
            fail(option.name, f"{quote(value)} is not {meta['shape']}")
    try:
        parse_card_modes(settings.card_modes)
    except ValueError as exc:  # the pattern held: a card named twice
        fail("card_modes", str(exc))
    try:
        parse_replicas(settings.time_slice_replicas)
    except ValueError as exc:  # the pattern held: a card named twice, or out of range
        fail("time_slice_replicas", str(exc))
    for name, words in (("memory_enforcement", MEMORY_PINS), ("compute_enforcement", COMPUTE_PINS)):
        try:
            parse_pins(getattr(settings, name), words, yaml_key(name))
        except ValueError as exc:  # the pattern held: something given twice
            fail(name, str(exc))
    for rule in RULES:
        if rule.broken(settings):
            fail(rule.blame, rule.why)


class _NoAliasLoader(yaml.SafeLoader):
    """YAML without anchors and aliases: a few bytes of aliases expand to gigabytes."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise yaml.YAMLError("aliases (*name) are not allowed")
        return super().compose_node(parent, index)


def read_config_file(path: str) -> dict[str, Any]:
    """Read a YAML config file into {option name: raw value}; unknown keys are errors,
    a key with no value (null) is left out."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(CONFIG_FILE_LIMIT + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    if len(raw) > CONFIG_FILE_LIMIT:
        raise ConfigError(f"config file {path} is larger than {CONFIG_FILE_LIMIT >> 10} KiB")
    try:
        data = yaml.load(raw.decode("utf-8"), Loader=_NoAliasLoader)  # a SafeLoader
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None
    except (yaml.YAMLError, RecursionError, ValueError) as exc:  # ValueError: 5000 digits
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings")
    by_key = {yaml_key(o.name): o.name for o in OPTIONS}
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in by_key:
            raise ConfigError(
                f"unknown key {quote(key)} in config file {path}; known keys: {', '.join(by_key)}",
            )
        if value is not None:  # ``key:`` with no value leaves the default, as in Helm
            values[by_key[key]] = value
    return values


def build_parser(prog: str = "gpushare-device-plugin") -> Parser:
    parser = Parser(
        prog=prog,
        description="Kubernetes device plugin sharing NVIDIA GPUs by memory slices and core units.",
        epilog="Every flag can also be set by its environment variable (GPUSHARE_<FLAG>) or "
        "in the --config YAML file (camelCase key); flags win over env over file.",
    )
    add_version(parser)
    parser.add_argument("--config", metavar="FILE", help="YAML file of settings")
    for option in OPTIONS:
        kind = _field_type(option)
        help_text = f"{option.metadata['help']} (env {env_name(option)}; default: {option.default})"
        if kind is bool:
            parser.add_argument(
                flag_name(option.name),
                action="store_const",
                const=True,
                default=None,
                help=help_text,
            )
        else:
            parser.add_argument(
                flag_name(option.name),
                default=None,
                metavar=option.name.split("_")[-1].upper(),
                choices=option.metadata["choices"] or None,
                help=help_text,
            )
    return parser


#: Where a setting's value came from, as the start log line and errors name it.
DEFAULT_ORIGIN = "default"


def load_settings_with_origins(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[Settings, dict[str, str]]:
    """Parse flags, environment and the config file into validated :class:`Settings`,
    with the origin of every setting (``flag --x``, ``env X``, ``key k in FILE``,
    ``default``)."""
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)
    config_path = args.config or environ.get(ENV_PREFIX + "CONFIG") or ""
    file_values = read_config_file(config_path) if config_path else {}

    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for option in OPTIONS:
        flag_value = getattr(args, option.name)
        typed = False  # flags and the environment are text; the file's YAML has types
        if flag_value is not None:
            raw, origin = flag_value, f"flag {flag_name(option.name)}"
        elif env_name(option) in environ:
            raw, origin = environ[env_name(option)], f"env {env_name(option)}"
        elif option.name in file_values:
            raw, typed = file_values[option.name], True
            origin = f"key {yaml_key(option.name)} in {config_path}"
        else:
            origins[option.name] = DEFAULT_ORIGIN
            continue
        values[option.name] = _coerce(option, raw, origin, typed)
        origins[option.name] = origin
    settings = Settings(**values)
    _validate(settings, origins)
    return settings, origins


def load_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Parse flags, environment and the config file into validated :class:`Settings`."""
    return load_settings_with_origins(argv, environ)[0]


def effective_config(settings: Settings, origins: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Every setting with its value and origin, for the one start log line."""
    return {
        yaml_key(option.name): {
            "value": getattr(settings, option.name),
            "from": origins.get(option.name, DEFAULT_ORIGIN),
        }
        for option in OPTIONS
    }
