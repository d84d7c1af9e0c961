"""The test lab: what the tests stand on, apart from the tests themselves.

- SSH test hosts: ``testhosts`` (``Lab``: up, down, ssh; also a command line for the molecule
  create/destroy playbooks), ``rootfs`` (the cached Debian 12 root filesystem), ``gateway``
  (one lab per gateway on this machine), ``hostcmd`` (commands, processes, mounts);
  ``loopback_sshd`` (a private sshd on 127.0.0.1, no test host needed).
- SGLang without a GPU: ``standin_server`` (the stand-in server's HTTP side and command line),
  ``standin_engine`` (model, patched forward, capture hook, scheduling), ``standin_requests``
  (what /generate takes and answers), ``sglang_sim`` (the real patched forward on CPU),
  ``sglang_wheels`` (the release wheels, cached), ``wheelhouse_dir`` (a wheelhouse for the roles).
- References and inputs: ``hf_reference`` (a transformers reference forward), ``tiny_model`` (a
  tiny random DeepseekV3 with a tokenizer), ``sample_files`` (samples written directly),
  ``runcheck`` (a run's output is complete and exact), ``trainers`` (the trainers' own readers).
- ``demo``: the whole flow on two test hosts (``python3 tests/lab/demo.py``, README).

Imported as ``lab.<module>`` (pytest's ``pythonpath`` holds ``tests/``); the modules that also
run as scripts put ``tests/`` and the checkout on ``sys.path`` themselves.
"""
