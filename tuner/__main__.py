"""`python -m tuner`: the same as the `tune` console script."""

import sys

from tuner.cli import main

sys.exit(main())
