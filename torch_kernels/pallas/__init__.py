"""The pallas backend's torch face: torch_kernels ops running the jax_impl kernels.

- :mod:`.torch_tensors`: ordinary (CPU) torch tensors cross to JAX arrays and back by DLPack; this
  is how the tests and the doctor run the Pallas kernels (in interpret mode) on CPU.
- :mod:`.torchax_tensors`: the torchax environment, in which ops called on torchax ('jax')
  tensors run JAX implementations on the tensors' arrays directly (the TPU path).
- ``<family>.py``, one per op family: that family's wrappers for CPU tensors (the kernels its ops
  module registers as ``"torch_kernels.pallas.<family>:pallas_<name>"``) and its
  ``torchax_implementations()``, which :func:`.torchax_tensors.register` installs.

Importing this package imports neither jax nor torchax; the modules import them when used.
"""
