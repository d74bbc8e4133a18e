"""The GPU sharing benchmark (``make gpu-bench``, ``python -m gpushare.bench.gpu``): the
figures users compare GPU sharing on, per enforcement backend, on a real card (issue 42).

Decide first, then apply, as the daemon does: :mod:`.facts` reads the machine (and parses
recorded text of it), :mod:`.plan` decides from those facts which backends can run and
what each scenario costs, :mod:`.stats` and :mod:`.table` turn measurements into the
report; only :mod:`.tenants`, :mod:`.scenarios` and :mod:`.run` touch processes, cgroups
and the MPS control daemon. :mod:`.worker` is the tenant: the probe's kind of steady
kernel through the CUDA driver API (ctypes, :mod:`gpushare.probe.cuda`), nothing else.

It never changes a GPU setting (MIG mode, persistence, clocks, compute mode): it measures
the card as it finds it. MPS daemons it starts it stops.
"""
