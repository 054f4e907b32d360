"""Models shared by jobs, tests and benchmarks."""
