"""``python -m gpushare.probe``: see :mod:`gpushare.probe.checks`."""

import sys

from gpushare.probe.checks import main

sys.exit(main())
