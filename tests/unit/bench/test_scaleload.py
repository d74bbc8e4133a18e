"""gpushare.bench.scaleload: what is created on the real API server carries none of the
fields the server sets itself (a create with them is refused or ignored). The load of
a real cluster runs in make scale and tests/e2e/test_scale_real.py."""

from __future__ import annotations

from gpushare.bench import scaleobjects
from gpushare.bench.scaleload import SERVER_SET, _for_create


def test_server_set_fields_are_removed_and_the_rest_kept() -> None:
    pod = scaleobjects.a_pod(7, gpu=True)
    pod["metadata"]["resourceVersion"] = "12"
    kept = {k: v for k, v in pod["metadata"].items() if k not in SERVER_SET}
    assert set(pod["metadata"]) & set(SERVER_SET)  # the pod had some
    created = _for_create(pod)
    assert created["metadata"] == kept and created["spec"] == scaleobjects.a_pod(7, True)["spec"]
