"""``python -m benchmarks``: the demonstration (see :mod:`benchmarks.demo`)."""

from benchmarks.demo import main

if __name__ == "__main__":
    main()
