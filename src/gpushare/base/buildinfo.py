"""What this build is: one place for the version every entry point, log line, metric,
image and chart reports (``gpushare.__version__``; pyproject.toml reads it from there,
and tests check that the chart and the image tag agree)."""

from __future__ import annotations

import platform

from gpushare import __version__


def build_info() -> dict[str, str]:
    """version, python and grpc versions, as ``gpushare_build_info`` labels them."""
    try:
        import grpc  # already loaded by the daemon; cheap here

        grpc_version = str(grpc.__version__)
    except ImportError:  # pragma: no cover - grpc is a dependency
        grpc_version = "unknown"
    return {"version": __version__, "python": platform.python_version(), "grpc": grpc_version}
