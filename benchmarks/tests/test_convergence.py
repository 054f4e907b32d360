"""benchmarks.convergence: the options each run is given."""

from benchmarks.convergence import SPARSE_OPTIONS, measured, sparse_options


def test_sparse_options_only_those_a_scheme_takes() -> None:
    assert sparse_options(["dense", "topk", "dct-dp", "clt-k"]) == list(SPARSE_OPTIONS)
    assert sparse_options(["clt-k"]) == ["min_numel=0"]  # clt-k has no capacity
    assert sparse_options(["dense", "powersgd"]) == []


def test_a_rerun_of_one_scheme_dates_only_its_own_records() -> None:
    def run(scheme: str) -> dict[str, object]:
        return {"workload": "digits-mlp", "workers": 2, "seed": 0, "scheme": scheme,
                "coupled": True}
    record = {"runs": [run("dense"), run("clt-k")], "meta": [
        {"when": "day 1", "cell": ["digits-mlp", 2, 0], "argv": []},
        {"when": "day 2", "cell": ["digits-mlp", 2, 0], "argv": ["--schemes", "clt-k"]},
        {"when": "day 3", "cell": ["digits-mlp", 4, 0], "schemes": ["dense"]},
    ]}
    when = measured(record)
    assert when[("digits-mlp", 2, 0, "dense", True)] == "day 1"
    assert when[("digits-mlp", 2, 0, "clt-k", True)] == "day 2"
