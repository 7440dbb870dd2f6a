"""``python -m sluice.worker --config FILE``: the same as ``sluice worker``."""

import sys

from sluice.worker.main import main

if __name__ == "__main__":
    sys.exit(main())
