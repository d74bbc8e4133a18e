"""Simulations of the node around gpushare: stand-ins for the kubelet
(:mod:`~gpushare.sim.kubeletdouble`, its DRA side :mod:`~gpushare.sim.drakubeletdouble`)
and the API server (:mod:`~gpushare.sim.apidouble`), a demo and a placement trace."""
