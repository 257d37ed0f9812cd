"""`python -m labtools.hosts`: see the package's docstring, or `--help`."""

import sys

from labtools.hosts.cli import main

sys.exit(main())
