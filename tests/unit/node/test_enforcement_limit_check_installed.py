"""The claims' limit check (the memory hook's ``--check-limits``) is installed on the host
where the DRA driver serves a card and the interposer is on; where it cannot be, the daemon
starts, says so once (``limit_check_unavailable``), and the shares it would check are
refused at prepare (``doors/dra/test_every_card_of_a_claim_limited.py``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kit.memhook import shared_hook
from structlog.testing import capture_logs

from gpushare.config import Settings
from gpushare.node.enforcement import with_backends
from gpushare.share.answers import Enforcement


def test_installed_where_dra_is_served_and_missing_said_once(tmp_path: Path) -> None:
    settings = Settings(host_lib_dir=str(tmp_path / "vgpu"), memory_hook=str(shared_hook()))
    base = Enforcement(tmp_path / "libvgpu.so.1", None, True)
    check = with_backends(base, settings, {}, object(), serves_dra=True).limit_check
    assert check is not None and Path(check).parent == tmp_path / "vgpu"
    assert Path(check).name.startswith("gpushare-memory-hook.")
    assert Path(check).read_bytes() == shared_hook().read_bytes()
    assert with_backends(base, settings, {}, object()).limit_check is None  # no DRA card
    no_enforcement = replace(base, library=None)  # nothing for the check to hold
    assert with_backends(no_enforcement, settings, {}, object(), True).limit_check is None
    missing = replace(settings, memory_hook=str(tmp_path / "not-there"))
    with capture_logs() as logs:
        assert with_backends(base, missing, {}, object(), True).limit_check is None
    (event,) = [e for e in logs if e["event"] == "limit_check_unavailable"]
    assert event["log_level"] == "error" and "not-there" in event["error"]
