"""`python -m mlfabric.workload` still works; the tool lives in `mlfabric.tools.workload`."""

import sys

from .tools.workload import worker_main

if __name__ == "__main__":
    sys.exit(worker_main())
