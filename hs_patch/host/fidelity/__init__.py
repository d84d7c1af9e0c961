"""The production fidelity check: is every plane of each sample what the server computed?

- ``rows``: every row of every plane against the fingerprints the capture hook took on the GPU,
  and rows of every chunk against the model's own norm weights (layer identity, full reduction,
  the final norm) (:func:`~hs_patch.host.fidelity.rows.check_rows`).
- ``check``: both parts on one sample: the row checks and argmax of the model's ``lm_head`` over
  the dumped final state against the server's own tokens of the same pass, batched
  (:class:`~hs_patch.host.fidelity.check.FidelityChecker`).
- ``policy``: what a run does with the results: counts, the run's statistics of each plane,
  and a stop with a diagnosis.
- ``settings``: what the check is, as every sample and the run record it, and what weakens it.
"""
