"""Diagnostics of a run: per-role metrics and their sinks, trajectory signatures, the failure
detectors and the statistics of a whole run."""
