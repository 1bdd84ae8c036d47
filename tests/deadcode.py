"""Dead-code check for ``make lint``: vulture (min confidence 60) over the product and its tests.

Reports unused functions, methods, properties, classes and imports; Django/DRF class attributes (``ordering``,
``list_display``, ``serializer_class``...) are "unused variables" to vulture and are not reported. Names that are
used by a framework (admin classes, DRF hooks, Celery tasks by name, NVML API methods of the simulator) are in
tests/vulture_whitelist.py. Not collected by pytest (no test_ prefix).

    .venv/bin/python tests/deadcode.py            # exit 1 and list them if any
    .venv/bin/python tests/deadcode.py --whitelist  # print a whitelist of today's findings (review it first)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("unused function", "unused method", "unused property", "unused class", "unused import")
PATHS = ["marketplace", "tenants", "telemetry", "tests"]


def findings(make_whitelist: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "vulture", *PATHS, "--min-confidence", "60", "--exclude", "*/migrations/*"]
    if make_whitelist:
        cmd.append("--make-whitelist")
    else:
        cmd.append("tests/vulture_whitelist.py")
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False).stdout
    return [line for line in out.splitlines() if any(k in line for k in KINDS)]


def main() -> int:
    if "--whitelist" in sys.argv:
        print("\n".join(findings(make_whitelist=True)))
        return 0
    found = findings()
    if found:
        print("\n".join(found))
        print(f"{len(found)} unused names: remove them, or add framework-used ones to tests/vulture_whitelist.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
