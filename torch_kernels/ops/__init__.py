"""Op schemas, fakes, autograd and input checks, one module per family."""
