"""Building blocks of `scripts/bench.py`: workload, per-system workers, machine facts and the report."""
