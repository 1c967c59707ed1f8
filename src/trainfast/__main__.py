"""`python -m trainfast ...` (and `torchrun ... -m trainfast train ...`)."""

import sys

from trainfast.cli import main

sys.exit(main())
