"""`python -m transformer_mt` (what `torchrun -m transformer_mt ...` runs) is the `tmt` command."""

from .cli import run

run()
