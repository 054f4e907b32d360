"""Models shared by the jobs, the tests and the benchmarks.

Floor: above the front doors (a model may be cut with ``thinwire.pipeline.split``),
beside data (neither imports the other), below jobs. No front door imports it.
"""
