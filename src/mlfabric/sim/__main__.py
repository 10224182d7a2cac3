"""`python -m mlfabric.sim`: run the simulator (see `engine`)."""

import sys

from .engine import main

sys.exit(main())
