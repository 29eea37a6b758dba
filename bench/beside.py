"""Run a command beside CPU burners, as a user's machine runs Krypton beside a browser,
a video call or a test suite: ``make test-busy`` runs ``make test``'s suite this way.

    python -m bench.beside [--burners 4] [--rounds 1] -- COMMAND ...

Starts ``--burners`` bounded ``while True`` processes, runs COMMAND ``--rounds`` times
beside them, prints each round's exit status and minutes and the load average, and ends
with the first failing status (0 when every round passed). The burners stop with it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

_BURN = "import time\nend = time.time() + {}\nwhile time.time() < end:\n    pass\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burners", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--hours", type=float, default=6.0, help="the burners' own end")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    burners = [
        subprocess.Popen([sys.executable, "-c", _BURN.format(args.hours * 3600)])
        for _ in range(max(0, args.burners))
    ]
    failed = 0
    try:
        for number in range(1, args.rounds + 1):
            began = time.time()
            status = subprocess.call(command)
            minutes = (time.time() - began) / 60
            load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
            print(
                f"round {number}/{args.rounds} beside {args.burners} burners: exit {status} "
                f"in {minutes:.1f} min (load average {load})",
                flush=True,
            )
            failed = failed or status
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    return failed


if __name__ == "__main__":
    sys.exit(main())
