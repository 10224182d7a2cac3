"""`python -m mlfabric.chaos` still works; the tool lives in `mlfabric.tools.chaos`."""

import sys

from .tools.chaos import main

if __name__ == "__main__":
    sys.exit(main())
