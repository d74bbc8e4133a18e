"""A grant's host side made, sealed and undone in one place (``host/grants.py``), on a
real directory: what :func:`share_needs` names is what :class:`GrantHost` makes, a
claim's directories go at release, and each failure is one ``HostGrantError`` line."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpushare.host.grants import GrantHost, HostGrantError, NodeDirs, share_needs
from gpushare.host.grantspecs import GrantSpecs
from gpushare.host.library import cache_key, claim_cache_key
from gpushare.share.answers import CDI_CRI, ContainerEdits, DeviceListing, Enforcement

CARD = "GPU-a"
INTERPOSER = Enforcement(Path("/opt/libvgpu.so"), None, True)


def test_what_the_plan_names_is_made_and_a_claims_is_released(short_tmp: Path) -> None:
    host = GrantHost.of(short_tmp / "vgpu")
    units = [f"{CARD}-m-{n}" for n in range(3)]
    plugin = share_needs(
        INTERPOSER,
        CARD,
        host.plan_dirs(),
        key=cache_key(units),
        memory_mib=768,
        cores=None,
        mps=False,
        units=units,
    )
    key = claim_cache_key("0b5e6e4e-1111-4222-8333-444455556666", "gpu", "gpu-0")
    claim = share_needs(
        INTERPOSER,
        CARD,
        host.plan_dirs(),
        key=key,
        memory_mib=768,
        cores=30,
        mps=False,
        claim=True,
    )
    for needs in (plugin, claim):
        assert needs.cache_dir is not None and not needs.cache_dir.exists()
        host.make(needs)
        assert needs.cache_dir.is_dir() and not needs.cache_dir.is_symlink()
    assert claim.made_keys == [key]
    (claim.cache_dir / "vgpu.cache").write_bytes(b"tenant")  # type: ignore[operator]
    host.make(claim)  # made again: a fresh directory, the old one buried
    assert claim.cache_dir is not None and list(claim.cache_dir.iterdir()) == []
    host.release(claim.made_keys)
    assert not claim.cache_dir.exists()
    assert plugin.cache_dir is not None and plugin.cache_dir.is_dir()  # the GC's to take
    # a recovered claim's directory is kept where it is still there
    host.make(claim)
    (claim.cache_dir / "vgpu.cache").write_bytes(b"running")
    kept = share_needs(
        INTERPOSER,
        CARD,
        host.plan_dirs(),
        key=key,
        memory_mib=768,
        cores=30,
        mps=False,
        claim=True,
        keep=True,
    )
    host.make(kept)
    assert (claim.cache_dir / "vgpu.cache").read_bytes() == b"running"


def test_each_failure_is_one_line(short_tmp: Path) -> None:
    (short_tmp / "vgpu").write_text("not a directory")
    host = GrantHost(NodeDirs(short_tmp / "vgpu"))
    needs = share_needs(
        INTERPOSER,
        CARD,
        host.dirs,
        key=cache_key(["u"]),
        memory_mib=256,
        cores=None,
        mps=False,
        units=["u"],
    )
    with pytest.raises(
        HostGrantError, match=r"^cannot create the container's cache directory: "
    ) as made:
        host.make(needs)
    assert "\n" not in str(made.value)
    (short_tmp / "cdi").write_text("not a directory")
    sealing = GrantHost(
        NodeDirs(short_tmp / "lib"),
        specs=GrantSpecs(short_tmp / "cdi", "gpushare.io", 60.0),
        listing=DeviceListing(frozenset({CDI_CRI})),
    )
    assert sealing.seals
    with pytest.raises(HostGrantError, match=r"^cannot write the grant's CDI spec in "):
        sealing.seal(ContainerEdits(envs={"A": "1"}), "vcuda-memory-0123456789abcdef0123")
    with pytest.raises(HostGrantError, match=r"^cannot write the claim's CDI spec in "):
        sealing.write_claim_spec(short_tmp / "cdi", "gpu.gpushare.io/claim", "uid", [])
    # without a CDI strategy the edits are the answer as they are, nothing written
    plain = GrantHost(NodeDirs(short_tmp / "lib"))
    edits = ContainerEdits(envs={"A": "1"})
    assert not plain.seals and plain.seal(edits, "any") is edits
