#!/usr/bin/env python3
"""What fab pays to read a host through Ansible, next to what ``ansible-inventory`` pays.

Each round, in alternating order, times from a fresh process:

- fab:       ``python3 -c "from hs_patch.control.inventory import load; load(HOST, INV)"``:
             InventoryManager + VariableManager in process, every knob rendered (what
             ``fab extract``/``status`` do once at start; the dashboard's polling never
             reads the inventory again);
- inventory: ``ansible-inventory -i INV --host HOST`` (the same variables, not rendered).

Prints every round, the medians and the ratio. Both only read the inventory: nothing connects to the
host (the default is the production inventory's 10.1.230.174). Run:

    python3 bench/inventory_load.py                       # the production inventory, 5 rounds
    python3 bench/inventory_load.py --inventory DIR --host NAME --rounds 9
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inventory", default=str(ROOT / "inventory"))
    ap.add_argument("--host", default="10.1.230.174")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    tool = shutil.which("ansible-inventory") or str(Path(sys.executable).parent / "ansible-inventory")
    cmds = {"fab": [sys.executable, "-c", "import sys; from hs_patch.control.inventory import load; "
                    "load(sys.argv[1], sys.argv[2])", a.host, a.inventory],
            "inventory": [tool, "-i", a.inventory, "--host", a.host]}
    times: dict[str, list[float]] = {k: [] for k in cmds}
    for r in range(a.rounds):
        order = list(cmds) if r % 2 == 0 else list(cmds)[::-1]
        for name in order:
            times[name].append(timed(cmds[name]))
        print(f"round {r + 1}: " + ", ".join(f"{k} {times[k][-1]:.2f}s" for k in cmds), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"median: fab {med['fab']:.2f}s, ansible-inventory {med['inventory']:.2f}s, "
          f"ratio fab/ansible-inventory {med['fab'] / med['inventory']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
