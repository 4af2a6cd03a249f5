"""Time a whole command and keep the figure with its commit: ``make test``, ``make demo``.

    python -m experiments.clock NAME [--out DIR] -- COMMAND [ARG ...]

Runs COMMAND (no shell), waits for it, and writes ``clock_NAME.json`` with the wall time, the exit
code, the command and the usual environment record, so the README's "Measured here" table
(``python -m experiments.summary --readme``) reads the figure instead of a hand-copied one.
Exits with COMMAND's exit code. Example, on a fresh clone:

    git clone . /tmp/x && cd /tmp/x && python3 -m experiments.clock make_test \\
        --out "$OLDPWD/experiments/results/x86_64-2cpu" -- make test

(The clock itself needs only the standard library until it writes: it runs before ``make``
has created the virtual environment.)
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m experiments.clock NAME [--out DIR] -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    cut = argv.index("--")
    ap = argparse.ArgumentParser(prog="python -m experiments.clock", description=__doc__.split("\n\n")[0])
    ap.add_argument("name", help="what is timed (the file is clock_NAME.json)")
    ap.add_argument("--out", required=True, help="results directory to write clock_NAME.json into")
    args = ap.parse_args(argv[:cut])
    command = argv[cut + 1:]
    if not command:
        ap.error("no command after --")
    t0 = time.monotonic()
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    code = subprocess.call(command)
    seconds = time.monotonic() - t0
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.split("\n")
    record = {"experiment": f"clock_{args.name}", "command": command, "cwd": os.getcwd(), "exit_code": code,
              "seconds": round(seconds, 1), "created": started, "commit": commit,
              "dirty": [line[3:] for line in dirty if line.strip()],
              "env": {"machine": f"{platform.machine()}-{os.cpu_count()}cpu", "python": platform.python_version(),
                      "platform": platform.platform(), "cpu_count": os.cpu_count(),
                      "loadavg_at_end": [round(v, 2) for v in os.getloadavg()], "time": started}}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"clock_{args.name}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"{' '.join(command)}: exit {code} after {seconds:.1f} s; wrote {path}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
