"""Loaded by every Python process started with this directory first on its PYTHONPATH.

Only the GPU proof's ``sabotage`` phase starts a server so (``tests/gpu/sabotage.py``): with
HS_TEST_SABOTAGE=1 it installs ``lab.sabotage`` in every process of the server, SGLang's
scheduler included, where the model and the capture hook run. Never part of the product.
"""

import os
import sys
from pathlib import Path

if os.environ.get("HS_TEST_SABOTAGE") == "1":
    sys.path.append(str(Path(__file__).resolve().parents[2]))  # tests/, last: only for the lab package
    from lab import sabotage

    sabotage.install()
