"""``python -m service.cli``: the same command as the ``zerotrain`` console script."""

import sys

from service.cli import main

sys.exit(main())
