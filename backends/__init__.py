"""orthon.backends: training backends other than plain torch (each behind its own extra).

The torch model in orthon.pretrain is the reference; a backend builds the same architecture from the
same ModelConfig, reads and writes the same weights format and takes the optimizer routing from the
same ``param_specs``."""
