"""Placing the served model on the GPU host: ``hs-model fetch`` and ``hs-model verify``.

The model comes from one source (``hs_model_source``): the Hugging Face hub at a pinned
commit (huggingface_hub's own downloader, resumable file by file), a mirror the operator
names over HTTP or rsync (resumable within a file), or ``none`` (placed by hand). Every
file is then checked against what the source itself says it is, size and checksum (the
hub's tree listing: sha256 of LFS files, the git blob id of the others; a mirror's
``hs-model-manifest.json``), before the server may load it. What was verified is written
into the model directory as ``hs-model-manifest.json`` (so the directory can serve as a
mirror) and ``.hs-model-verified.json`` (sizes and modification times, so the next run
checks in a second that nothing changed, without the network).

- :mod:`.listing`: what the files should be (:class:`FileSpec`), from the hub or a manifest;
- :mod:`.verify`: hashing, checking a directory against a listing, the two records;
- :mod:`.fetch`: the sources' downloads and the free-space check before them;
- :mod:`.cli`: the ``hs-model`` command.
"""
