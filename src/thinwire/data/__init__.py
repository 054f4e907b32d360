"""Offline data sets shared by jobs, tests and benchmarks."""
