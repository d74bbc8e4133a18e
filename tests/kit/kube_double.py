"""The API-server test double lives in the package (``gpushare.sim.apidouble``), so that
``make bench`` can run the daemon against it; tests import it from here as before."""

from gpushare.sim.apidouble import KINDS, KubeApiDouble, Recorded, merge_patch

__all__ = ["KINDS", "KubeApiDouble", "Recorded", "merge_patch"]
