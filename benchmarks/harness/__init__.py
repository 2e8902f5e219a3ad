"""What every benchmark shares: workloads, interleaved repetitions, provenance, records, plots, the docs page."""
