"""``python -m bench.sim --port P --model NAME ...``: see bench.sim.cli."""

from bench.sim.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
