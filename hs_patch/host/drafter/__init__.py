"""The drafter a run's samples train: how it is served.

- ``config``: ``hs-extract drafter-config``, the ``eagle_config`` that makes an SGLang release
  feed a drafter the planes it was trained on.
"""
