"""Pure-PyTorch references: readable truth for the tests, and the default kernels on CPU."""
