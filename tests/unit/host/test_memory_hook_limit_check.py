"""The memory hook's ``--check-limits`` mode (hook/memory-hook.c), run as a runtime runs a
createRuntime hook: the OCI state on stdin, the container's final env in the bundle's
``config.json``. It is named in every DRA claim share's CDI spec with that claim's share
(issue 32 item 2, docs/security.md row 32.2): a container whose env lets HAMi-core give
any card index more than the share is refused before it runs.

The property: whatever the env list (duplicates, any order, junk values, names close to
the real ones), a container the check lets through is one where HAMi-core, reading the env
as its source does (``get_limit_from_env``: ``strtoul`` base 0, a k/m/g suffix, 0 or an
overflow meaning "no limit"; ``_<i>`` falling back to the un-indexed name), limits every
index 0-15 to at most the share, whichever duplicate the runtime applies (runc keeps the
last, a first-wins ``getenv`` the first). And an env as the claims' specs write it, at or
under the share in any plain form, is never refused.
"""

from __future__ import annotations

import json
import os
import string
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given
from hypothesis import strategies as st
from kit.memhook import HAVE_GCC, build, run_check
from kit.sizes import at_two_sizes

from gpushare.share.answers import NEUTRAL_SWITCHES

pytestmark = pytest.mark.skipif(not HAVE_GCC, reason="needs gcc")

MIB = 1 << 20
SHARE_MIB, SHARE_CORES = 1024, 30
MEMORY = ["CUDA_DEVICE_MEMORY_LIMIT", *(f"CUDA_DEVICE_MEMORY_LIMIT_{i}" for i in range(16))]
CORES = ["CUDA_DEVICE_SM_LIMIT", *(f"CUDA_DEVICE_SM_LIMIT_{i}" for i in range(16))]
SWITCHES = ["GPU_CORE_UTILIZATION_POLICY", "CUDA_DISABLE_CONTROL"]
ARGS = [
    "--memory-mib", str(SHARE_MIB), "--cores", str(SHARE_CORES),
    *(a for name in SWITCHES for a in ("--neutral", f"{name}={NEUTRAL_SWITCHES[name]}")),
]  # fmt: skip


@pytest.fixture(scope="module")
def hook(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("hook"))[0]


# --------------------------------------------------------------- HAMi-core, as its source reads


def _strtoul(text: str) -> int:
    """glibc's ``strtoul(text, _, 0)`` on a 64-bit machine."""
    i, n = 0, len(text)
    while i < n and text[i] in " \t\n\v\f\r":
        i += 1
    negative = i < n and text[i] == "-"
    if i < n and text[i] in "+-":
        i += 1
    base = 10
    if text[i : i + 2].lower() == "0x" and i + 2 < n and text[i + 2] in string.hexdigits:
        base, i = 16, i + 2
    elif text[i : i + 1] == "0":
        base = 8
    digits = "0123456789abcdef"[:base]
    value, any_digit = 0, False
    while i < n and text[i].lower() in digits and text[i].isascii():
        value, any_digit = value * base + digits.index(text[i].lower()), True
        i += 1
    if not any_digit:
        return 0
    if value >= 1 << 64:
        return (1 << 64) - 1
    return (-value) % (1 << 64) if negative else value


def _hami_reads(value: str | None) -> int:
    """HAMi-core's ``get_limit_from_env``: the limit (bytes, or percent), 0 for none."""
    if not value:
        return 0
    scales = {"g": 1 << 30, "m": 1 << 20, "k": 1 << 10, "G": 1 << 30, "M": 1 << 20, "K": 1 << 10}
    scale = scales.get(value[-1], 1)
    res = _strtoul(value)
    scaled = (res * scale) % (1 << 64)
    if scaled == 0 or scaled // scale != res:
        return 0
    return scaled


def _views(env: list[str]) -> list[dict[str, str]]:
    """The env as a last-wins runtime and as a first-wins ``getenv`` see it."""
    last: dict[str, str] = {}
    first: dict[str, str] = {}
    for entry in env:
        if "=" in entry:
            name, value = entry.split("=", 1)
            last[name] = value
            first.setdefault(name, value)
    return [last, first]


def _within_share(env: list[str]) -> bool:
    for view in _views(env):
        for i in range(16):
            memory = _hami_reads(view.get(MEMORY[1 + i])) or _hami_reads(view.get(MEMORY[0]))
            if not 0 < memory <= SHARE_MIB * MIB:
                return False
            cores = _hami_reads(view.get(CORES[1 + i])) or _hami_reads(view.get(CORES[0]))
            if not 0 < cores <= SHARE_CORES:
                return False
        if any(view.get(name) != NEUTRAL_SWITCHES[name] for name in SWITCHES):
            return False
    return True


# --------------------------------------------------------------- env lists

_SPEC = [
    *(f"{n}={SHARE_MIB}m" for n in MEMORY),
    *(f"{n}={SHARE_CORES}" for n in CORES),
    *(f"{n}={NEUTRAL_SWITCHES[n]}" for n in SWITCHES),
]
_NAMES = st.sampled_from(
    [*MEMORY, *CORES, *SWITCHES, "PATH", "CUDA_DEVICE_MEMORY_LIMIT_16",
     "CUDA_DEVICE_MEMORY_LIMIT_01", "cuda_device_memory_limit_0", "CUDA_DEVICE_SM_LIMIT_"]
)  # fmt: skip
_VALUES = st.one_of(
    st.sampled_from(
        ["1024m", "1024M", "1g", "1G", str(SHARE_MIB * MIB), "1048576k", "512m", "30", "29",
         "1025m", "2g", "31", "100", "0", "", " 512m", "0x200m", "0512m", "-1", "+512m",
         "512mb", "512 m", "99999999999999999999999g", "18014398509481984k", "abc", "5\u00e9",
         "default", "false", "true", "disable", "force"]
    ),
    st.text(alphabet="0123456789kKmMgGxX -+", max_size=8),
)  # fmt: skip
_ENTRY = st.one_of(st.tuples(_NAMES, _VALUES).map("=".join), st.sampled_from(["NOEQUALS"]))


@st.composite
def _env_lists(draw: st.DrawFn) -> list[str]:
    """The env a claim's spec writes, some names dropped, hostile entries anywhere."""
    base = [e for e in _SPEC if draw(st.integers(0, 40)) != 0]
    for entry in draw(st.lists(_ENTRY, max_size=6)):
        base.insert(draw(st.integers(0, len(base))), entry)
    return base


_FIXTURES_ONCE = [HealthCheck.function_scoped_fixture]  # the hook and the bundle directory


def _property(given_: Callable[[Callable[..., None]], Callable[..., None]]) -> Any:
    """60 examples (each runs the hook) in make test, 250 under ``slow``."""
    return at_two_sizes(
        given_, quick=60, full=250, deadline=None, suppress_health_check=_FIXTURES_ONCE
    )


@_property(given(env=_env_lists()))
@example(env=_SPEC)
@example(env=[*_SPEC, "CUDA_DEVICE_MEMORY_LIMIT_3=2g"])
@example(env=["CUDA_DEVICE_MEMORY_LIMIT_3=2g", *_SPEC])  # first-wins getenv would read 2g
@example(env=[*_SPEC, "CUDA_DEVICE_MEMORY_LIMIT_3=0"])  # 0: no limit to HAMi-core
@example(env=[*_SPEC, "CUDA_DEVICE_SM_LIMIT=0x10"])
@example(env=[e for e in _SPEC if not e.startswith("CUDA_DEVICE_MEMORY_LIMIT_15=")])
def test_what_the_check_lets_through_is_within_the_share(
    hook: Path, tmp_path: Path, env: list[str]
) -> None:
    result = run_check(hook, tmp_path / "bundle", env, ARGS)
    assert result.returncode in (0, 1), result
    if result.returncode == 0:
        assert _within_share(env), env
    else:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("gpushare-memory-hook: "), result.stderr


_PLAIN = st.integers(1, SHARE_MIB).flatmap(
    lambda mib: st.sampled_from([f"{mib}m", f"{mib}M", f"{mib * 1024}k", str(mib * MIB)])
)


@_property(
    given(
        memory=st.lists(_PLAIN, min_size=17, max_size=17),
        cores=st.lists(st.integers(1, SHARE_CORES), min_size=17, max_size=17),
        others=st.lists(
            st.sampled_from(["PATH=/bin", "HOME=/", "NOEQUALS", "X=CUDA_DEVICE_SM_LIMIT=99"])
        ),
        order=st.randoms(use_true_random=False),
    )
)
def test_an_env_at_or_under_the_share_is_never_refused(
    hook: Path,
    tmp_path: Path,
    memory: list[str],
    cores: list[int],
    others: list[str],
    order: object,
) -> None:
    env = [
        *(f"{n}={v}" for n, v in zip(MEMORY, memory, strict=True)),
        *(f"{n}={v}" for n, v in zip(CORES, cores, strict=True)),
        *(f"{n}={NEUTRAL_SWITCHES[n]}" for n in SWITCHES),
        *others,
    ]
    order.shuffle(env)  # type: ignore[attr-defined]
    result = run_check(hook, tmp_path / "bundle", env, ARGS)
    assert result.returncode == 0, (result.stderr, env)
    assert _within_share(env)


def test_two_claims_of_unequal_shares_refuse_the_container_in_either_order(
    hook: Path, tmp_path: Path
) -> None:
    """What a runtime builds from two claims' specs, each setting every name, the later
    one's values replacing: whichever came last, one claim's check refuses (the smaller's
    when the larger came last, the larger's never); equal shares pass both."""

    def final(*shares: int) -> list[str]:
        env: dict[str, str] = {}
        for mib in shares:
            env.update({n: f"{mib}m" for n in MEMORY})
        return [f"{k}={v}" for k, v in env.items()]

    for applied in ((1024, 4096), (4096, 1024), (2048, 2048)):
        env = final(*applied)
        verdicts = {
            mib: run_check(hook, tmp_path / "b", env, ["--memory-mib", str(mib)]) for mib in applied
        }
        small, last = min(applied), applied[-1]
        assert verdicts[last].returncode == 0, verdicts[last].stderr
        if last != small:
            assert verdicts[small].returncode == 1
            assert f"={last}m is above this claim's share ({small} MiB)" in verdicts[small].stderr
        else:
            assert all(v.returncode == 0 for v in verdicts.values())


@pytest.mark.parametrize(
    "config, says",
    [
        (b"", "is not a JSON object"),
        (b"[]", "is not a JSON object"),
        (b'{"process": {"env": ["A=1"]}', "is not valid JSON"),
        (b'{"process": {}, "process": {}}', 'two "process"'),
        (b'{"process": {"env": [], "Env": []}}', 'two "process.env"'),
        (b'{"process": {"env": "A=1"}}', "process.env is not a list"),
        (b'{"process": {"env": [1]}}', "non-string env entry"),
        (b'{"process": {"env": ["A=\\u0000"]}}', "holds a NUL byte"),
        (b'{"process": {"env": ["A=\\ud800"]}}', "is not valid JSON"),
        (b'{"process": {"env": []}} x', "data after its JSON object"),
        ('{"proce\u017fs": {}}'.encode(), "non-ASCII key"),  # Go folds it onto "process"
        (b'{"process": {"\\u212anv": []}}', "non-ASCII key"),
        (b'{"process": null}', "CUDA_DEVICE_MEMORY_LIMIT is not set"),
        (b'{"a": ' * 40 + b"1" + b"}" * 40, "is not valid JSON"),
        # names as a Go runtime decodes them: escapes and the key's case
        (b'{"Process": {"ENV": ["CUDA_DEVICE_MEMORY_LIMIT_0=2g"]}}', "_LIMIT_0=2g is above"),
        (
            b'{"pro\\u0063ess": {"env": ["\\u0043UDA_DEVICE_MEMORY_LIMIT=2g"]}}',
            "_LIMIT=2g is above",
        ),
    ],
)
def test_a_config_that_cannot_be_read_plainly_is_refused(
    hook: Path, tmp_path: Path, config: bytes, says: str
) -> None:
    result = run_check(hook, tmp_path / "b", None, ["--memory-mib", "1024"], config=config)
    assert result.returncode == 1, result
    assert result.stderr.count("\n") == 1 and says in result.stderr, result.stderr


def test_an_oversized_config_a_link_and_a_fifo_are_refused(hook: Path, tmp_path: Path) -> None:
    bundle = tmp_path / "b"
    big = b'{"process": {"env": ["A=' + b"x" * (16 << 20) + b'"]}}'
    result = run_check(hook, bundle, None, ["--memory-mib", "1"], config=big)
    assert result.returncode == 1 and "larger than 16777216 bytes" in result.stderr
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text('{"process": {"env": []}}')
    (bundle / "config.json").unlink()
    (bundle / "config.json").symlink_to(elsewhere)
    result = run_check_existing(hook, bundle)
    assert result.returncode == 1 and "Too many levels of symbolic links" in result.stderr
    (bundle / "config.json").unlink()
    os.mkfifo(bundle / "config.json")  # nothing writes it: the hook must not wait
    result = run_check_existing(hook, bundle)
    assert result.returncode == 1 and "is not a regular file" in result.stderr


def run_check_existing(hook: Path, bundle: Path) -> subprocess.CompletedProcess[str]:
    state = json.dumps({"ociVersion": "1.2.0", "id": "c", "pid": 1, "bundle": str(bundle)})
    return subprocess.run(
        [str(hook), "--check-limits", "--memory-mib", "1"], input=state,
        capture_output=True, timeout=60, text=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    "state, args, says",
    [
        ({"pid": 1}, ["--memory-mib", "1"], 'has no "bundle"'),
        ({"pid": 1, "bundle": "rel/b"}, ["--memory-mib", "1"], "not an absolute path"),
        ({"bundle": "/nonexistent-gs"}, ["--memory-mib", "1"], "cannot open the bundle"),
        ({"bundle": "/", "bundle ": 1, "x": {"bundle": 2}}, ["--memory-mib", "1"], "config.json"),
        ({"bundle": "/a", "bundl\\u0065": "/b"}, ["--memory-mib", "1"], 'more than one "bundle"'),
        ({"bundle": "/"}, ["--memory-mib", "0"], "not a number from 1"),
        ({"bundle": "/"}, ["--cores", "101"], "not a number from 1 to 100"),
        ({"bundle": "/"}, ["--cores", "-5"], "not a number from 1"),
        ({"bundle": "/"}, ["--neutral", "=x"], "not NAME=VALUE"),
        ({"bundle": "/"}, ["--memory-mib"], "usage"),
        ({"bundle": "/"}, ["--limit-mib", "5"], "usage"),
    ],
)
def test_bad_state_and_arguments_are_refused(
    hook: Path, state: dict[str, object], args: list[str], says: str
) -> None:
    text = json.dumps(state).replace("\\\\u", "\\u")
    result = subprocess.run(
        [str(hook), "--check-limits", *args], input=text.encode(), capture_output=True,
        timeout=60,
    )  # fmt: skip
    assert result.returncode in (1, 2), result
    err = result.stderr.decode()
    assert err.count("\n") == 1 and says in err, err
