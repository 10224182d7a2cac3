"""`python -m mlfabric.traffic` still works; the tool lives in `mlfabric.tools.traffic`."""

import sys

from .tools.traffic import main

if __name__ == "__main__":
    sys.exit(main())
