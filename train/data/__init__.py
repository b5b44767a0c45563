"""Building blocks of the training input pipeline; :mod:`train.input_pipeline` assembles them."""
