"""The production fidelity check: is each dumped final state the one the server computed?

- ``check``: argmax of the model's ``lm_head`` over the dumped state against the server's
  own tokens of the same pass, batched (:class:`~hs_patch.host.fidelity.check.FidelityChecker`).
- ``policy``: what a run does with the results: counts, and a stop with a diagnosis.
"""
