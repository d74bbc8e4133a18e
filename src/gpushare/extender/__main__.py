"""``python -m gpushare.extender``: the scheduler extender, as ``gpushare-scheduler-extender``
runs it (see :mod:`gpushare.extender.httpserver`)."""

import sys

from gpushare.extender.httpserver import main

sys.exit(main())
