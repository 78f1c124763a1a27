"""The first ``os.fork()`` of a process that imported weft_sync (nothing open) against a bare one.

Each sample is a fresh interpreter (``python -c``) that imports either nothing beyond the
standard modules this script's child code needs (``bare``) or ``weft_sync`` (``imported``: the
package, which loads the storages, the fence and the facade), then forks once. The parent times
its ``os.fork()`` call; the child writes its first-instruction time (``time.monotonic()``, one
clock for both processes) through a pipe and leaves with ``os._exit``. The two kinds take
turns, ``--runs`` each.

Printed: the median and maximum of both times for each kind, and the ratio imported / bare of
the medians, measured in this run (target: at most 1.1x). Importing adds modules, hence memory
the fork copies page tables for: a third kind, ``dependencies``, imports every module that
``import weft_sync`` loads except the library's own, so imported / dependencies is what the
library itself adds (it registers no fork hook at import); each kind's resident set size at the
fork is printed too.

    python bench/first_fork.py [--runs 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_note

_SAMPLE = r"""
import json, os, resource, time
{imports}
read_end, write_end = os.pipe()
began = time.monotonic()
pid = os.fork()
if pid == 0:
    os.write(write_end, repr(time.monotonic()).encode())
    os._exit(0)
returned = time.monotonic()
os.close(write_end)
child_first = float(os.read(read_end, 64).decode())
os.waitpid(pid, 0)
with open("/proc/self/statm") as statm:
    rss_kb = int(statm.read().split()[1]) * resource.getpagesize() / 1024
print(json.dumps({{"call": returned - began, "child": child_first - began, "rss_kb": rss_kb}}))
"""

_IMPORTS = {
    "bare": "",
    "imported": "import weft_sync",
    # Every module importing weft_sync loads, except the library's own (filled in by main()).
    "dependencies": "",
}


def _dependencies() -> str:
    """Code importing every module ``import weft_sync`` loads besides the library's own."""
    listing = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; before = set(sys.modules); import weft_sync; "
            "print(' '.join(sorted(m for m in set(sys.modules) - before "
            "if not m.startswith('weft_sync') "
            "and getattr(sys.modules[m], '__spec__', None) is not None)))",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    names = listing.stdout.split()
    return f"import importlib\nfor name in {names!r}:\n    importlib.import_module(name)"


def _sample(kind: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", _SAMPLE.format(imports=_IMPORTS[kind])],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    sample: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return sample


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
    _IMPORTS["dependencies"] = _dependencies()
    samples: dict[str, list[dict[str, float]]] = {kind: [] for kind in _IMPORTS}
    for _ in range(args.runs):
        for kind in _IMPORTS:
            samples[kind].append(_sample(kind))
    print(machine_note())
    print(f"{args.runs} fresh processes of each kind, taking turns")
    print("| process | os.fork() call, median | max | child running, median | max | RSS |")
    print("| --- | --- | --- | --- | --- | --- |")
    medians: dict[str, tuple[float, float]] = {}
    for kind, rows in samples.items():
        calls = [row["call"] * 1000 for row in rows]
        childs = [row["child"] * 1000 for row in rows]
        rss = statistics.median(row["rss_kb"] for row in rows) / 1024
        medians[kind] = (statistics.median(calls), statistics.median(childs))
        print(
            f"| {kind} | {medians[kind][0]:.3f} ms | {max(calls):.3f} ms | "
            f"{medians[kind][1]:.3f} ms | {max(childs):.3f} ms | {rss:.1f} MiB |"
        )
    call_ratio = medians["imported"][0] / medians["bare"][0]
    child_ratio = medians["imported"][1] / medians["bare"][1]
    print(
        f"imported / bare (medians): os.fork() call {call_ratio:.2f}x, "
        f"child running {child_ratio:.2f}x (target: at most 1.1x)"
    )
    dep_call = medians["imported"][0] / medians["dependencies"][0]
    dep_child = medians["imported"][1] / medians["dependencies"][1]
    print(
        f"imported / dependencies only (medians): os.fork() call {dep_call:.2f}x, "
        f"child running {dep_child:.2f}x (what weft_sync itself adds beyond the modules it loads)"
    )


if __name__ == "__main__":
    main()
