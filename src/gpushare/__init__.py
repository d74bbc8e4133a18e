"""gpushare: share one NVIDIA GPU between many containers with hard memory limits."""

__version__ = "0.1.0"
