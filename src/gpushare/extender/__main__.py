"""``python -m gpushare.extender``: the scheduler extender, as ``gpushare-scheduler-extender``
runs it (see :mod:`gpushare.extender.server`)."""

import sys

from gpushare.extender.server import main

sys.exit(main())
