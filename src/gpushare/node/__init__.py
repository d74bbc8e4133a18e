"""One node, assembled: the kubelet's records client and the usage refresher that every
front door shares (and, built from the settings, the node's core that they stand on)."""
