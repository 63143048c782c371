"""`make diagrams`: every diagram of `kvlab.book.diagrams.DIAGRAMS` written to book/diagrams/<name>.svg.

Each is drawn from kvlab's own state (a registry config, a memory budget, a block manager, two engine runs, a
tensor-parallel plan); the SVGs are byte-for-byte reproducible, and tests/test_diagrams.py checks that the
committed ones equal a fresh run. `--out DIR` writes them elsewhere.
"""

import argparse
from pathlib import Path

from kvlab.book.diagrams import DIAGRAMS, save_svg

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "book" / "diagrams"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="folder for the SVGs (default book/diagrams)")
    args = parser.parse_args(argv)
    for diagram in DIAGRAMS.values():
        path = args.out / f"{diagram.name}.svg"
        save_svg(diagram.build(), path)
        print(f"{path}  (book/{diagram.chapter}/index.md)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
