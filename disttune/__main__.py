"""python -m disttune: the disttune command."""

import sys

from .cli import main

sys.exit(main())
