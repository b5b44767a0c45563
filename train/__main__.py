"""``python -m train``: the training program's command line (:mod:`train.main`)."""

from train import main

# absl prints __main__'s docstring for --helpfull; make it the program's usage.
__doc__ = main.__doc__

main.cli()
