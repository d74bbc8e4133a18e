"""Whether this daemon's stop is an uninstall: its node has lost the opt-in label.

The DaemonSet runs on the nodes that carry its opt-in label (``gpushare.io/enabled=true``
in the manifests, the chart's ``optInLabel``), told to the daemon as
``--opt-in-label``/``GPUSHARE_OPT_IN_LABEL``. ``kubectl gpushare uninstall`` removes the
label, and the DaemonSet's pod on that node is stopped; a restart or a rolling update
stops it with the label still there. Read once, at the API link's stop; anything that
leaves the answer unknown (no label configured, the API server unreachable, the Node
gone) is "not opted out": the caller then removes nothing.
"""

from __future__ import annotations

from urllib.parse import quote

import structlog

from gpushare.kube.stdlibclient import ApiClient

log = structlog.get_logger(__name__)

#: Seconds for the one Node read.
READ_TIMEOUT = 5.0


def node_opted_out(api: ApiClient, node_name: str, opt_in_label: str) -> bool:
    """Whether the Node ``node_name``, read now, lacks ``opt_in_label`` (``key=value``)."""
    key, given, value = opt_in_label.partition("=")
    if not key or not given or not node_name:
        return False
    try:
        node = api.get(f"/api/v1/nodes/{quote(node_name, safe='')}", READ_TIMEOUT)
    except Exception as exc:  # the API server is down, RBAC is missing, ...
        log.warning("opt_in_label_unread", label=opt_in_label, error=str(exc)[:200])
        return False
    if not isinstance(node, dict):  # the Node is gone: no uninstall said so
        return False
    labels = (node.get("metadata") or {}).get("labels") or {}
    if labels.get(key) == value:
        return False
    log.info("node_opted_out", label=opt_in_label)
    return True
