"""`python -m mlfabric.docgen` still works; the tool lives in `mlfabric.tools.docgen`."""

import sys

from .tools.docgen import main

if __name__ == "__main__":
    sys.exit(main())
