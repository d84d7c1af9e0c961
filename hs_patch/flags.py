"""SGLang server flags the capture hook needs, per release (shared: the hook, ``hs-patch
status``, the Ansible role and fab's preflight all read this one table).

Standard library only: imported inside the SGLang server and on the control node.
"""

from __future__ import annotations

# What each release needs on the command line with capture on (see hs_patch.server.checks).
REQUIRED_FLAGS = {
    "0.5.9": ["--disable-radix-cache"],
    "0.5.16": ["--disable-radix-cache", "--disable-prefill-cuda-graph"],
    "0.5.23": ["--disable-radix-cache", "--disable-prefill-cuda-graph"],
}
