"""``python -m disttune.report LOG_DIR [OUT_DIR]``: see :mod:`disttune.report`."""

import sys

from . import main

sys.exit(main())
