"""`python -m transformer_mt` (what `torchrun -m transformer_mt ...` runs) is the `tmt` command."""

import sys

from .cli import main

sys.exit(main())
