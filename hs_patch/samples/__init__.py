"""The sample format's code, in one room: what a sample file and its manifest are and how they are written and read.

``store`` (the format: one safetensors file per sample, the append-only manifest, publishing a
written sample), ``reader`` (reading and checking samples, every format ever written) and
``lazy_sample`` (one tensor at a time, for the exporters and the fidelity check), ``intent`` (the
driver's loss mask and provenance, which the hook writes into the sample) and ``files`` (checked
writes, digests and JSON logs, the file writing everything else uses). Used by the server's hook,
the driver, the shipper, the exporters and the control node alike; standard library only at module
level (``reader`` and ``lazy_sample`` load safetensors when they read). ``tests/test_layout.py``
holds the rules.
"""
