"""``hs-extract``: run an extraction on the GPU host, next to the capturing SGLang server.

Subcommands, each from its room: ``drive`` (feed a dataset through the server and collect
the samples: :mod:`hs_patch.host.driver.cli`), ``ship`` (move finished samples to training
storage, verified: :mod:`hs_patch.host.shipping.shipper`), ``fetch`` (a run shipped to a bucket onto
local disk, verified: :mod:`hs_patch.host.shipping.fetch`), ``snapshot`` (one JSON view of a
run, for the dashboard: :mod:`hs_patch.host.driver.snapshot`), ``export`` (samples in a
trainer's layout: :mod:`hs_patch.host.export.cli`), ``drafter-config`` (the eagle_config a
drafter is served with: :mod:`hs_patch.host.drafter.config`), ``accept`` (a trained drafter's accept
length against a running EAGLE-3 server: :mod:`hs_patch.host.drafter.accept`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional

from hs_patch import __version__
from hs_patch.samples.files import quiet_when_stdout_closes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hs-extract", description="Run a hidden-state extraction on the GPU host.")
    p.add_argument("--version", action="version", version=f"hs-extract {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from hs_patch.host.driver import cli as drive_cli

    d = sub.add_parser("drive", help="feed a dataset through the capturing server; collect the samples",
                       description=drive_cli.DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    drive_cli.add_arguments(d)
    d.set_defaults(func=drive_cli.run_args)
    from hs_patch.host.shipping import shipper
    from hs_patch.host.driver import snapshot

    s = sub.add_parser("ship", help="ship finished samples to training storage, verified there, then delete "
                       "them here", description=shipper.DESCRIPTION, epilog=shipper.EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    shipper.add_arguments(s)
    s.set_defaults(func=shipper.run_args)
    from hs_patch.host.shipping import fetch

    f = sub.add_parser("fetch", help="bring a run shipped to an S3 bucket onto local disk, every file verified "
                       "(then inspect or export it)", description=fetch.DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    fetch.add_arguments(f)
    f.set_defaults(func=fetch.run_args)
    n = sub.add_parser("snapshot", help="print one JSON snapshot of a run (what fab's dashboard shows)",
                       description=snapshot.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    snapshot.add_arguments(n)
    n.set_defaults(func=snapshot.run_args)
    from hs_patch.host.drafter import config as drafter
    from hs_patch.host.export import cli as export_cli

    e = sub.add_parser("export", help="export samples for a trainer: SpecForge .ckpt or speculators (bf16/fp8)",
                       description=export_cli.DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    export_cli.add_arguments(e)
    e.set_defaults(func=export_cli.run_args)
    c = sub.add_parser("drafter-config", help="the eagle_config that makes an SGLang release feed a drafter the "
                       "planes it was trained on", description=drafter.DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    drafter.add_arguments(c)
    c.set_defaults(func=drafter.run_args)
    from hs_patch.host.drafter import accept

    m = sub.add_parser("accept", help="measure a trained drafter's accept length against a running EAGLE-3 server "
                       "on held-out chats", description=accept.DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    accept.add_arguments(m)
    m.set_defaults(func=accept.run_args)
    return p


@quiet_when_stdout_closes
def main(argv: Optional[list[str]] = None) -> int:
    os.umask(0o077)  # hidden states of a proprietary model: every file and dir we create is owner-only
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    a = build_parser().parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
