"""`python -m mlfabric.contention` still works; the tool lives in `mlfabric.tools.contention`."""

import sys

from .tools.contention import main

if __name__ == "__main__":
    sys.exit(main())
