"""hs_patch: capture an SGLang server's hidden states for EAGLE-3 drafter training."""

__version__ = "0.1.0"
