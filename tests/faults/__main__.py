"""The command line: ``python tests/faults SPEC SEED ...`` (see the package)."""

import sys
from pathlib import Path

if __name__ == "__main__":
    # Run as a folder, the import path starts at this folder: start it at tests/
    # instead, so that the scenarios import, and worker processes unpickle their
    # sources and transforms, as faults.<kind> and support.
    here = Path(__file__).resolve().parent
    if Path(sys.path[0]).resolve() == here:
        sys.path[0] = str(here.parent)

    from faults.runner import main

    sys.exit(main(sys.argv[1:]))
