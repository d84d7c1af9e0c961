"""``hs-patch``'s work: the capture patch on an installed SGLang, and checking samples.

- ``patcher``: apply, verify, revert, status of ``deepseek_v2.py`` (standard library only,
  never imports SGLang); the exact edits per release are in :mod:`hs_patch.engine.releases`.
- ``hook_check``: verify's check, on the syntax tree, that the hook sits where it must and
  nothing else changed.
- ``status``: ``hs-patch status`` and ``check-args`` (capture settings, server flags, the
  drafter's serving ids).
- ``nearest``: for a ``deepseek_v2.py`` no release has, the nearest known release and what
  differs where the patch works (status shows it; adding a release stays a reviewed step).
- ``inspection``: ``hs-patch inspect`` (a sample, a samples dir or a shipped run against its
  manifest).
"""
