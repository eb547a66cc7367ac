"""`python -m fusedzero.cli` (torchrun needs a module to run): the app's `fusedzero` command."""

import sys

from fusedzero.app.entry import main

if __name__ == "__main__":
    sys.exit(main())
