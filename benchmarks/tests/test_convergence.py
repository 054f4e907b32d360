"""benchmarks.convergence: the options each run is given."""

from benchmarks.convergence import SPARSE_OPTIONS, sparse_options


def test_sparse_options_only_those_a_scheme_takes() -> None:
    assert sparse_options(["dense", "topk", "dct-dp", "clt-k"]) == list(SPARSE_OPTIONS)
    assert sparse_options(["clt-k"]) == ["min_numel=0"]  # clt-k has no capacity
    assert sparse_options(["dense", "powersgd"]) == []
