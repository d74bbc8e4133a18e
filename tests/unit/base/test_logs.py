"""gpushare.base.logs: JSON lines (one event per line, with level and UTC time) in the
DaemonSet, and the level filter drops what is below it."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest
import structlog

from gpushare.base.logs import configure_logging


@pytest.fixture(autouse=True)
def restore_structlog() -> Iterator[None]:
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def test_json_lines_carry_the_event_its_fields_level_and_utc_time() -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    log = structlog.get_logger("t")
    log.debug("hidden", n=0)
    log.info("card_found", uuid="GPU-1", n=2)
    log.warning("card_lost", uuid="GPU-1")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["event"] for line in lines] == ["card_found", "card_lost"]
    assert lines[0]["uuid"] == "GPU-1" and lines[0]["n"] == 2
    assert [line["level"] for line in lines] == ["info", "warning"]
    assert lines[0]["timestamp"].endswith("Z")


def test_auto_writes_json_when_the_stream_is_not_a_terminal() -> None:
    out = io.StringIO()  # isatty() is False, as in a container's log
    configure_logging("auto", "debug", stream=out)
    structlog.get_logger("t").debug("seen")
    assert json.loads(out.getvalue())["event"] == "seen"


def test_console_format_is_not_json() -> None:
    out = io.StringIO()
    configure_logging("console", "info", stream=out)
    structlog.get_logger("t").info("started", parts=3)
    text = out.getvalue()
    assert "started" in text and "parts" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
