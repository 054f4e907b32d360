"""The experiments: compare, data-parallel training, DCT-MP, dAD and parameter-server runs.

A job puts a model and a data set to work through the front doors, and writes
results. Floor: above models, data and every front door; within the package only
the command line imports it (the benchmarks do too).
"""
