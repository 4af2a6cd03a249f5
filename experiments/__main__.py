"""``python -m experiments NAME|all [--quick] [--out DIR]``: what ``blockflow bench`` runs."""
from __future__ import annotations

import argparse
import sys

from experiments import EXPERIMENTS, run_all


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments",
                                 description="Run one experiment or all of them: " + ", ".join(EXPERIMENTS))
    ap.add_argument("name", help="experiment name or 'all'")
    ap.add_argument("--quick", action="store_true", help="short settings for a smoke run")
    ap.add_argument("--out", help="results directory of every experiment (default: the git-ignored scratch "
                                  "directory experiments/results/_runs/<machine>); to replace the committed "
                                  "results: --out experiments/results/<machine>")
    args = ap.parse_args(argv)
    return run_all(args.name, quick=args.quick, out=args.out)


if __name__ == "__main__":
    sys.exit(main())
