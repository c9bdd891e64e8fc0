"""``python -m devin_compile.cli``: the same as the ``devin-compile`` command."""
import sys

from . import main

sys.exit(main())
