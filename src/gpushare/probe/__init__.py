"""The enforcement probe: a program of its own, run inside a tenant's container (``python
-m gpushare.probe``, started by ``kubectl gpushare verify``), that checks the limits the
daemon handed out hold there. It imports nothing of the daemon (only :mod:`gpushare.base`;
``make test`` checks it), so the container needs only Python and the driver's libraries.
See :mod:`gpushare.probe.checks`."""
