"""The benchmarks (``make bench``, ``python -m gpushare.bench``): a tool, not product; it
drives the real daemon process through the simulated kubelet (see
:mod:`gpushare.bench.run`)."""
