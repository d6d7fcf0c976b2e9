"""The benchmark: `suite` (what `scripts/bench.py` runs), the workload, per-system workers, machine facts and
the report; `pkg bench cold` uses the same workers from an installed wheel."""
