"""Dead-code check for ``make lint``: vulture (min confidence 60), in two passes.

1. Over the product and its tests: names nothing calls.
2. Over the product alone: product code that only tests call. Vulture counts a test's call as a use, so the first
   pass cannot see it; such code moves to the tests (e.g. tests/billing_reference.py holds billing's reference
   implementations and in-process helpers).

Reports unused functions, methods, properties, classes and imports; Django/DRF class attributes (``ordering``,
``list_display``, ``serializer_class``...) are "unused variables" to vulture and are not reported. Names that are
used by a framework (admin classes and actions, DRF hooks and actions, form ``clean_*`` methods, template filters and
the properties templates read, Celery tasks by name, NVML API methods of the simulator, fixtures) are in
tests/vulture_whitelist.py, as are the known TEST-ONLY names of modules other changes own (move those to tests
there). Not collected by pytest (no test_ prefix).

    .venv/bin/python tests/deadcode.py            # exit 1 and list them if any
    .venv/bin/python tests/deadcode.py --whitelist  # print a whitelist of today's findings (review it first)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("unused function", "unused method", "unused property", "unused class", "unused import")
PRODUCT = ["marketplace", "tenants", "telemetry"]
WHITELIST = "tests/vulture_whitelist.py"


def _vulture(paths: list[str], make_whitelist: bool) -> list[str]:
    # the whitelist is a path like the others: it goes before the options (argparse takes no path after them)
    cmd = [sys.executable, "-m", "vulture", *paths, *([] if make_whitelist else [WHITELIST]),
           "--min-confidence", "60", "--exclude", "*/migrations/*"]
    if make_whitelist:
        cmd.append("--make-whitelist")
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if run.returncode not in (0, 3):  # 0: none found, 3: dead code found; 1, 2: vulture refused its input
        raise SystemExit(f"vulture failed ({run.returncode}): {run.stderr.strip()}")
    return [line for line in run.stdout.splitlines() if any(k in line for k in KINDS)]


def findings(make_whitelist: bool = False) -> list[str]:
    everywhere = _vulture([*PRODUCT, "tests"], make_whitelist)
    only_tests = [f"{line}  (only tests call it)" if not make_whitelist else line
                  for line in _vulture(PRODUCT, make_whitelist) if line not in everywhere]
    return everywhere + only_tests


def main() -> int:
    if "--whitelist" in sys.argv:
        print("\n".join(findings(make_whitelist=True)))
        return 0
    found = findings()
    if found:
        print("\n".join(found))
        print(f"{len(found)} unused names: remove them (move product code only tests call to the tests), or add "
              f"framework-used ones to {WHITELIST}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
