"""`python -m flashlite.cli`: the `flashlite` command."""

import sys

from flashlite.cli import main

sys.exit(main())
