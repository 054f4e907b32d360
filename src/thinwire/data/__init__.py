"""Offline data sets shared by the jobs, the tests and the benchmarks (nothing downloads).

Floor: above the front doors, beside models (neither imports the other), below jobs.
No front door imports it.
"""
