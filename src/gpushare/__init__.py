"""gpushare: share one NVIDIA GPU between many containers with hard memory limits."""

#: The one place the version is written: pyproject.toml, the image tag (Makefile), the chart
#: (Chart.yaml, checked by tests) and every ``--version`` read it from here.
__version__ = "0.1.0"
