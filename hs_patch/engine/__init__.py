"""What the project knows about SGLang, in one room: its releases, the code the patch inserts, its settings.

``releases`` (the supported releases, recognised by their pristine ``deepseek_v2.py``, and the exact
edits for each), ``families`` (the code the patch inserts, written once per family of releases),
``flags`` (the server settings capture needs and refuses), ``serving`` (which hidden states each
release feeds an EAGLE-3 drafter) and ``kv_cache`` (does a running server's KV cache hold the longest
sample). Read by the patcher, the hook inside the server, the driver, the Ansible roles (through
``hs-patch``) and the control node; standard library only, so each of those may import it.
``tests/test_layout.py`` holds the rules.
"""
