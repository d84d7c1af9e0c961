"""Loaded by every Python process started with this directory first on its PYTHONPATH.

Only the GPU proof's ``sabotage`` phase starts a server so (``tests/gpu/sabotage.py``): with
HS_TEST_SABOTAGE=1 it installs ``lab.sabotage`` in every process of the server, SGLang's
scheduler included, where the model and the capture hook run. Never part of the product.
A ``sitecustomize`` further down the path (the image's own, if it has one) still runs.
"""

import importlib.util
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

for _entry in sys.path:  # this file shadows any other sitecustomize: run the next one found
    _next = Path(_entry or ".").resolve() / "sitecustomize.py"
    if _next.parent != HERE and _next.is_file():
        _spec = importlib.util.spec_from_file_location("_hs_next_sitecustomize", _next)
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break

if os.environ.get("HS_TEST_SABOTAGE") == "1":
    sys.path.append(str(HERE.parents[1]))  # tests/, last: only for the lab package
    from lab import sabotage

    sabotage.install()
