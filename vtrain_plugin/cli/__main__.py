"""``python -m vtrain_plugin.cli``."""

import sys

from vtrain_plugin.cli import main

sys.exit(main())
