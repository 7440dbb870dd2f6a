"""``python -m worker --config FILE``: the same as ``sluice worker``."""

import sys

from ops.cli import main

if __name__ == "__main__":
    sys.exit(main(["worker", *sys.argv[1:]]))
