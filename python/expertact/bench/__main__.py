"""python -m expertact.bench: the same as the expertact-bench command (expertact.bench.cli)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
