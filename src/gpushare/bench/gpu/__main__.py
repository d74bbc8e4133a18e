import sys

from gpushare.bench.gpu.run import main

sys.exit(main())
