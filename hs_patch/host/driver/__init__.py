"""``hs-extract drive``: feed a dataset through the capturing SGLang server, one sample per line.

- ``cli``: the subcommand (options, settings check, signals); ``config``: the settings and
  their defaults; ``run``: the :class:`~hs_patch.host.driver.run.Driver` (locks, preparation,
  the loop); ``sample_steps``: what happens to one sample.
- input: ``datafile`` (reading lines with bounded work), ``dataset`` (formats, validation),
  ``chat`` (chat template, loss mask), ``limits`` (length checks before tokenizing).
- the server: ``client`` (HTTP API, retries), ``capture_check`` (the start-up probe),
  ``capture_dir`` (watching the server's capture dir), ``adopt`` (moving a sample into the
  run's samples dir), ``backpressure`` (pausing on full filesystems).
- the run on disk: ``runstate`` (parameters, lock, ledger, resume), ``runstatus``
  (status.json), ``snapshot`` (one JSON view of a run for fab's dashboard, standard library only).

Outside this room, only the CLI, the fidelity check (the server's answer, through ``client``)
and the shipper (``runstate``'s file names) import from it (``tests/test_layout.py``).
"""
