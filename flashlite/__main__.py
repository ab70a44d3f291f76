"""`python -m flashlite`: the `flashlite` command."""

import sys

from flashlite.cli import main

sys.exit(main())
