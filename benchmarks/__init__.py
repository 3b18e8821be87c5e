"""The speed and memory benchmarks: ``python -m benchmarks`` runs them all and writes the table."""
