"""``hs-extract export``: our samples in the layouts the EAGLE-3 trainers read.

- ``spec``: what an export holds (format, aux layers, final plane, fp8) and the refusals;
- ``writers``: one sample -> one SpecForge ``.ckpt`` or one speculators ``hs_<row>.safetensors``
  (with hs_connectors' per-token fp8 scheme);
- ``layout``: the export manifest (``export.jsonl``, ``export.json``), rows, stale files;
- ``arrow``: speculators' ``datasets`` table (``input_ids``, ``loss_mask``, ``seq_len``);
- ``run``: the parallel, resumable run with its progress bar; ``cli``: the subcommand.

Samples are read only through :mod:`hs_patch.samples.reader` and the manifest helpers of
:mod:`hs_patch.samples.store`, so the exporters follow the sample format when it changes.
"""
