"""gpushare.base.buildinfo: the build's labels are the package's version and the running
Python's and gRPC's, the same ones the daemon logs at start and exports as a metric."""

from __future__ import annotations

import platform

import grpc

import gpushare
from gpushare.base.buildinfo import build_info


def test_build_info_names_this_package_python_and_grpc() -> None:
    assert build_info() == {
        "version": gpushare.__version__,
        "python": platform.python_version(),
        "grpc": grpc.__version__,
    }
