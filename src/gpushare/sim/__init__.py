"""Simulations of the node around gpushare: a kubelet, a demo and a placement trace."""
