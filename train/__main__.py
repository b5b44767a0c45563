"""``python -m train``: see :mod:`train.main`."""

from train.main import cli

cli()
