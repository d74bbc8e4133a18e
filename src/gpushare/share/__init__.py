"""The admission core, pure code over plain data: units and inventory, placement, pairing,
usage, the shared/whole exclusion, card modes and the enforcement answer."""
