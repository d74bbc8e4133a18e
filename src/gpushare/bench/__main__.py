"""``python -m gpushare.bench``: see :mod:`gpushare.bench.run`."""

import sys

from gpushare.bench.run import main

sys.exit(main())
