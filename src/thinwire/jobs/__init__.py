"""The experiments behind the command line and the benchmarks."""
