"""Code that runs on the GPU host, outside the SGLang server, in rooms by job.

- ``patch_cli`` (``hs-patch``) and ``extract_cli`` (``hs-extract``): the two commands, thin;
  each subcommand lives in its room.
- ``patching/``: the capture patch (apply, verify, revert), ``hs-patch status``/``check-args``
  and ``inspect``.
- ``driver/``: ``hs-extract drive``: the dataset through the server, one sample per line,
  resumable; and ``snapshot``, a run's state for the dashboard.
- ``fidelity/``: the production fidelity check of each sample and what a run does with its results.
- ``readiness/``: the host checks (PCIe/JIT/NCCL, the model directory) that the services role
  copies to the host and runs with the standard library only.
- ``shipping/``: ``hs-extract ship``: rsync to storage, verified there.
- ``export/``: ``hs-extract export``: samples in the trainers' layouts.
- ``drafter/``: ``hs-extract drafter-config``: the eagle_config a drafter is served with.
- ``model_files``: a served model's config and single tensors by name (used by fidelity,
  export, drafter, the driver and ``hs-patch status``).

``tests/test_layout.py`` holds the rules between the rooms.
"""
