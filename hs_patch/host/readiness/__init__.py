"""Is the GPU host ready to start the server? Checks that run before ~600 GB of weights load.

- ``gpu_ready``: PCIe/IOMMU/ACS state, a JIT compile for the GPU's architecture, an all-GPU
  NCCL all-reduce under a timeout.
- ``model_check``: the model directory is complete, whole and readable.

Both are scripts: the services role copies each file alone to the host
(``sglang_service_check_dir``) and runs it with the host's Python, without this package, so
they import the standard library only (torch lazily, in the venv's Python, for the GPU
checks) (``tests/test_layout.py``).
"""
