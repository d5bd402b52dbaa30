"""``python -m vlmcompile ...`` (and ``torchrun ... -m vlmcompile train ...``): the command line."""

import sys

from vlmcompile.cli import main

sys.exit(main())
