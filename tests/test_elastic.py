"""Workers that fail and join (thinwire.elastic on torchft): scale up and down mid-run, healing,
rollback of every scheme, bounded waits."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from thinwire import ddp, optim, schemes
from thinwire.comm import Meter, fingerprint
from thinwire.comm.fingerprint import PeerMismatchError
from thinwire.launch import spawn
from thinwire.local import LocalUpdates

os.environ.setdefault("RUST_LOG", "error")  # torchft's Rust logs, read when it is imported
torchft = pytest.importorskip("torchft")

from thinwire import elastic  # noqa: E402  (needs torchft)
from thinwire.elastic.state import Rollback, load_shared, shared_state  # noqa: E402

STEPS = 16  # inner steps (local updates: a sync every 2) or steps (per-step)
JOIN_AT = 4  # worker 2 starts once worker 0 has taken this many steps
KILL_AT = 10  # worker 1 kills itself in the middle of this step's exchange
DEADLINE_S = 240.0  # hang guard for a whole scenario
HEARTBEAT_S = 1.0  # the Lighthouse's heartbeat timeout, and the workers'
TIMEOUT_S = 30.0  # the group's: what a lost peer would cost if nothing noticed it sooner
# int4 all-gathers each worker's codes, clt-k broadcasts its leader's indices: a lost peer
# must fail both, not leave the survivors averaging half-filled buffers
SCHEMES = {"local": ("int4", {"chunk": 8}), "ddp": ("clt-k", {"ratio": 0.25})}


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * replica + step)
    return torch.randn(5, 6, generator=generator), torch.randint(0, 3, (5,), generator=generator)


def _digest(value: Any) -> str:
    """sha256 of a nested state: tensors by their bytes, mappings in key order."""
    hasher = hashlib.sha256()

    def walk(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            hasher.update(f"{item.dtype}{tuple(item.shape)}".encode())
            hasher.update(item.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(item, dict):
            for key in sorted(item, key=repr):
                hasher.update(repr(key).encode())
                walk(item[key])
        elif isinstance(item, (list, tuple)):
            for part in item:
                walk(part)
        else:
            hasher.update(repr(item).encode())

    walk(value)
    return hasher.hexdigest()


class _Recording:
    """Wraps the elastic exchange: the scheme's state at each launch and after a failed
    landing (rolled back), and the global weights' digest after each landing."""

    def __init__(self, exchange: Any, log: dict[str, Any]) -> None:
        self.exchange, self.log = exchange, log

    def launch(self, updates: Any, fragment: int, deltas: dict[str, torch.Tensor]) -> Any:
        self.before = _digest(updates.scheme.state_dict())
        return self.exchange.launch(updates, fragment, deltas)

    def land(self, updates: Any, fragment: int, future: Any) -> Any:
        result = self.exchange.land(updates, fragment, future)
        if result is None:
            self.log["rolled back"].append(self.before == _digest(updates.scheme.state_dict()))
        return result


def _killed(*args: Any, **kwargs: Any) -> Any:
    """The scheme's launch of a worker killed in the middle of an exchange: after the
    quorum and the roll call, before it sends its part."""
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_for(path: Path) -> None:
    start = time.monotonic()
    while not path.exists():
        if time.monotonic() - start > DEADLINE_S:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)


def _worker(mode: str, replica: int, lighthouse: str, out: str) -> None:
    os.environ["RUST_LOG"] = "error"
    torch.set_num_threads(1)
    from thinwire.local import LocalUpdates

    if replica == 2:  # joins half way: started with the others, it waits for its moment
        _wait_for(Path(out, "join"))
    manager = elastic.connect(lighthouse, min_workers=2, replica_id=f"worker{replica}",
                              timeout_s=TIMEOUT_S, quorum_timeout_s=120,
                              heartbeat_timeout_s=HEARTBEAT_S)
    torch.manual_seed(100 + replica)  # seeded differently: torchft heals all but one at step 0
    model = _model()
    name, config = SCHEMES[mode]
    # clock: (start, end) of each entry of syncs, time.monotonic()
    log: dict[str, Any] = {"syncs": [], "healed": [], "rolled back": [], "clock": []}

    def shared() -> dict[str, Any]:
        return ({"globals": updates.updates.global_state(), "outer": updates.updates.outer
                 .state_dict(), "steps": updates.steps, "scheme": shared_state(updates
                                                                              .updates.scheme)}
                if mode == "local" else
                {"module": model.state_dict(), "optimizer": inner.state_dict(),
                 "scheme": shared_state(net.scheme)})

    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if mode == "local":
        updates = elastic.ElasticLocalUpdates(
            LocalUpdates(model, inner, schemes.build(name, **config), every=2), manager)
        updates.updates.exchange = _Recording(updates.updates.exchange, log)
    else:
        net = elastic.ElasticDDP(model, inner, schemes.build(name, **config), manager)
    # registered after the front door's: torchft loads it second, so it sees the healed state
    manager.register_state_dict_fn("probe", lambda sent: log["healed"].append(
        (sent, _digest(shared()))), lambda: _digest(shared()))
    if replica == 2:
        Path(out, "asked").touch()  # its first step asks for a quorum now
    if mode == "local":
        while updates.steps < STEPS:
            x, y = _batch(replica, updates.steps)
            inner.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            inner.step()
            started = time.monotonic()
            if replica == 1 and updates.steps + 1 == KILL_AT:  # a sync: every=2
                updates.updates.scheme.launch = _killed  # type: ignore[method-assign]
            commits = updates.record["commits"]
            if updates.step():
                log["syncs"].append((updates.steps, _digest(updates.updates.global_state()),
                                     manager.num_participants(),
                                     updates.record["commits"] > commits))
                log["clock"].append((started, time.monotonic()))
            if replica < 2 and updates.steps == JOIN_AT:
                _join(replica, out)
        updates.finish()
        log["record"] = updates.record
    else:
        while manager.current_step() < STEPS:
            started = time.monotonic()
            net.begin()
            before = _digest(net.scheme.state_dict())
            if replica == 1 and manager.current_step() == KILL_AT:
                net.scheme.launch_flat = _killed  # type: ignore[method-assign]
            x, y = _batch(replica, manager.current_step())
            nn.functional.cross_entropy(net(x), y).backward()
            committed = net.commit()
            log["syncs"].append((manager.current_step(), _digest(model.state_dict()),
                                 manager.num_participants(), committed))
            log["clock"].append((started, time.monotonic()))
            if not committed:
                log["rolled back"].append(before == _digest(net.scheme.state_dict()))
            if replica < 2 and manager.current_step() == JOIN_AT:
                _join(replica, out)
        log["record"] = net.record
    torch.save(log, os.path.join(out, f"{replica}.pt"))
    manager.shutdown(wait=False)


def _join(replica: int, out: str) -> None:
    """At step JOIN_AT, worker 2 is let in; the others go on once it asks for a quorum."""
    if replica == 0:
        Path(out, "join").touch()
    _wait_for(Path(out, "asked"))
    time.sleep(0.3)  # its quorum request is on its way


def _scenarios(out: Path) -> dict[str, dict[int, Any]]:
    """Per mode, at the same time: workers 0 and 1 train; worker 2 joins at step JOIN_AT;
    worker 1 is killed at KILL_AT."""
    from torchft.coordination import LighthouseServer

    # forked from a server that has imported torch: six workers on few cores start in
    # seconds, not in six imports of torch
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed"])
    lighthouses, processes = {}, {}
    start = time.monotonic()
    try:
        for mode in SCHEMES:
            (out / mode).mkdir()
            lighthouses[mode] = LighthouseServer(bind="[::]:0", min_replicas=2,
                                                 join_timeout_ms=1000,
                                                 heartbeat_timeout_ms=int(1000 * HEARTBEAT_S))
            for replica in range(3):
                processes[mode, replica] = context.Process(target=_worker, args=(
                    mode, replica, lighthouses[mode].address(), str(out / mode)))
                processes[mode, replica].start()
        for process in processes.values():
            process.join(timeout=max(1.0, DEADLINE_S - (time.monotonic() - start)))
    finally:
        for process in processes.values():
            if process.is_alive():
                process.kill()
        for lighthouse in lighthouses.values():
            lighthouse.shutdown()
    codes = {key: process.exitcode for key, process in processes.items()}
    assert codes == {(mode, replica): -signal.SIGKILL if replica == 1 else 0
                     for mode in SCHEMES for replica in range(3)}, codes
    return {mode: {replica: torch.load(out / mode / f"{replica}.pt", weights_only=False)
                   for replica in (0, 2)} for mode in SCHEMES}


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, Any]]:
    return _scenarios(tmp_path_factory.mktemp("elastic"))


@pytest.fixture(params=list(SCHEMES))
def scenario(request: pytest.FixtureRequest,
             scenarios: dict[str, dict[int, Any]]) -> tuple[str, dict[int, Any]]:
    return request.param, scenarios[request.param]


def _committed(log: dict[str, Any]) -> dict[int, str]:
    return {step: digest for step, digest, _, committed in log["syncs"] if committed}


def test_scaled_up_and_down_the_live_workers_end_with_equal_weights_at_the_step_count(
        scenario: tuple[str, dict[int, Any]]) -> None:
    mode, logs = scenario
    first, joined = _committed(logs[0]), _committed(logs[2])
    assert max(first) == max(joined) == STEPS
    assert max(workers for _, _, workers, _ in logs[0]["syncs"]) == 3  # scaled up
    shared = first.keys() & joined.keys()  # every commit both took part in: bit-identical
    assert len(shared) >= 3 and all(first[step] == joined[step] for step in shared)


def test_a_worker_killed_during_an_exchange_fails_that_step_then_is_left_out(
        scenario: tuple[str, dict[int, Any]]) -> None:
    mode, logs = scenario
    for log in logs.values():
        failed = [i for i, (*_, committed) in enumerate(log["syncs"]) if not committed]
        assert len(failed) == 1 and log["syncs"][failed[0]][2] == 3  # cut short, 3 workers
        _, _, workers, committed = log["syncs"][failed[0] + 1]
        assert committed and workers == 2  # the next commit leaves the killed worker out
        assert log["record"]["failures"] == 1


def test_the_survivors_commit_within_seconds_of_a_worker_killed_during_an_exchange(
        scenario: tuple[str, dict[int, Any]]) -> None:
    """From the start of the step or sync worker 1 died in to the survivors' next commit:
    its connections' close, a quorum without it after the heartbeat timeout, one more step
    or sync. Seconds, not the group's timeout (a bound a loaded machine keeps)."""
    mode, logs = scenario
    for log in logs.values():
        failed = next(i for i, (*_, committed) in enumerate(log["syncs"]) if not committed)
        lost = log["clock"][failed + 1][1] - log["clock"][failed][0]
        assert lost < TIMEOUT_S / 3, f"{mode}: the survivors lost {lost:.1f} s to the kill"


def test_a_healed_worker_holds_its_healers_state_to_the_bit(
        scenario: tuple[str, dict[int, Any]]) -> None:
    mode, logs = scenario
    joined = logs[2]["healed"]
    assert joined, "the joining worker was never healed"
    for sent, held in joined:
        assert sent == held


def test_a_failed_exchange_leaves_the_schemes_state_as_before_it(
        scenario: tuple[str, dict[int, Any]]) -> None:
    mode, logs = scenario
    rolled = [flag for log in logs.values() for flag in log["rolled back"]]
    assert rolled and all(rolled)


# Every stateful scheme, one failed step each: restored to the bit, and the next step the same
# as if the failed one had never been taken.

def _grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * rank + step)
    return {"w": torch.randn(16, 12, generator=generator),
            "b": torch.randn(12, generator=generator)}


ROLLBACK_CONFIGS: dict[str, dict[str, Any]] = {
    "topk": {"ratio": 0.2}, "dct-dp": {"ratio": 0.2, "life_span": 2},
    "laplace": {"ratio": 0.2, "min_numel": 0}, "powersgd": {"rank": 1}, "clt-k": {"ratio": 0.2},
    "local-topk": {"ratio": 0.2}}


def _rollbacks(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in schemes.names():
        config = ROLLBACK_CONFIGS.get(name, {})
        scheme, reference = schemes.build(name, **config), schemes.build(name, **config)
        for step in range(2):
            scheme.reduce(_grads(rank, step))
            reference.reduce(_grads(rank, step))
        before = _digest(scheme.state_dict())
        keeps = before != _digest(schemes.build(name, **config).state_dict())
        rollback = Rollback(scheme)
        scheme.reduce(_grads(rank, 99))  # the step that does not commit
        changed = _digest(scheme.state_dict()) != before
        scheme = rollback.restore(scheme)
        restored = _digest(scheme.state_dict()) == before
        again = scheme.reduce(_grads(rank, 2))
        expected = reference.reduce(_grads(rank, 2))
        out[name] = {"changed": changed, "keeps state": keeps, "restored": restored,
                     "next step": all(torch.equal(again[k], expected[k]) for k in expected)}
        # a joining worker: the peer's shared state, its own (empty) memory
        joiner = schemes.build(name, **config)
        load_shared(joiner, shared_state(reference))
        state, peer = joiner.state_dict(), reference.state_dict()
        out[name]["joined"] = (_digest({k: v for k, v in state.items() if k != "memory"})
                               == _digest({k: v for k, v in peer.items() if k != "memory"})
                               and _digest(state.get("memory"))
                               == _digest(schemes.build(name, **config).state_dict()
                                          .get("memory")))
    # last, for it leaves the group broken: rank 0 registers thinwire's hook, rank 1 runs
    # plain DDP; both must fail soon, not after the group's timeout
    fingerprint.PEER_CHECK_S = 2.0
    net = DistributedDataParallel(nn.Linear(6, 3))
    start = time.monotonic()
    try:
        if rank == 0:
            ddp.register(net, schemes.build("topk", ratio=0.5))
        net(torch.randn(4, 6)).sum().backward()
        out["beside plain DDP"] = None
    except (PeerMismatchError, RuntimeError) as error:
        out["beside plain DDP"] = (type(error).__name__, str(error), time.monotonic() - start)
    return out


@pytest.fixture(scope="module")
def rollbacks() -> list[dict[str, Any]]:
    return spawn(_rollbacks, 2, timeout_s=PLAIN_DDP_TIMEOUT_S, deadline_s=300)


PLAIN_DDP_TIMEOUT_S = 120.0  # the group's timeout in that spawn: a wait this long would fail


@pytest.mark.parametrize("name", schemes.names())
def test_a_failed_step_leaves_every_schemes_state_as_it_was_to_the_bit(
        name: str, rollbacks: list[dict[str, Any]]) -> None:
    for rank in range(2):
        result = rollbacks[rank][name]
        assert result["restored"] and result["next step"] and result["joined"]
        # not vacuous: the failed step did change the state of a scheme that keeps any
        assert result["changed"] == result["keeps state"]
    assert rollbacks[0][name]["keeps state"] or name in {"dense", "fp16"}


def test_a_rolled_back_scheme_keeps_its_warm_up() -> None:
    """A warm-up (register's under AdamW) outlives a failed exchange: the restored scheme
    sends the rest of it dense, as one never rolled back does."""
    meter = Meter(0, 1)
    scheme = schemes.build("topk", ratio=0.1, min_numel=0, warmup_steps=3)
    scheme.meter = meter
    scheme.reduce(_grads(0, 0))
    rollback = Rollback(scheme)
    scheme.reduce(_grads(0, 99))  # the step that does not commit
    restored = rollback.restore(scheme)
    assert restored is not scheme
    assert restored.warmup_steps == 3 and restored.meter is meter
    for step in (1, 2):  # its second and third launches: every entry, as dense sends it
        grads = _grads(0, step)
        sent = restored.reduce(grads)
        assert all(torch.equal(sent[key], grads[key]) for key in grads)
    sent = restored.reduce(_grads(0, 3))  # then it compresses
    assert int((sent["w"] != 0).sum()) < sent["w"].numel()


def _coupled(name: str) -> schemes.Scheme:
    scheme = schemes.build(name, ratio=0.1, min_numel=0)
    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
    assert optim.couple(sgd, scheme).coupled
    return scheme


@pytest.mark.parametrize("name", ["topk", "clt-k"])
def test_a_rolled_back_coupled_scheme_keeps_its_coupling(name: str) -> None:
    """SGD's momentum coupled into the scheme (thinwire.optim.couple) stays in the memory the
    optimiser's hooks hold, and the next step is as if the failed one never ran."""
    scheme, reference = _coupled(name), _coupled(name)
    for step in range(2):
        scheme.reduce(_grads(0, step))
        reference.reduce(_grads(0, step))
    memory = scheme.error_memory
    rollback = Rollback(scheme)
    scheme.reduce(_grads(0, 99))  # the step that does not commit
    restored = rollback.restore(scheme)
    assert restored.error_memory is memory
    again, expected = restored.reduce(_grads(0, 2)), reference.reduce(_grads(0, 2))
    assert all(torch.equal(again[key], expected[key]) for key in expected)


def test_thinwire_beside_plain_ddp_fails_clearly_well_before_the_groups_timeout(
        rollbacks: list[dict[str, Any]]) -> None:
    (kind, message, waited), (_, peer_message, peer_waited) = (rollbacks[rank]["beside plain DDP"]
                                                               for rank in range(2))
    assert kind == "PeerMismatchError" and "plain DDP" in message
    assert "closed" in peer_message  # the plain-DDP rank's wait ends when thinwire's rank leaves
    assert waited < PLAIN_DDP_TIMEOUT_S / 2 and peer_waited < PLAIN_DDP_TIMEOUT_S


class _Votes:
    """torchft's Manager as the membership sees it: errors reported, then the vote."""

    def __init__(self) -> None:
        self.error: Exception | None = None

    def report_error(self, error: Exception) -> None:
        self.error = error

    def errored(self) -> Exception | None:
        return self.error

    def should_commit(self) -> bool:
        committed, self.error = self.error is None, None
        return committed


def _lost_peer() -> Any:
    raise RuntimeError("Connection closed by peer")


@pytest.mark.parametrize("failure", ["collective", "decision", "collective, group re-formed"])
def test_a_worker_whose_collective_failed_leaves_the_group_at_the_vote(failure: str) -> None:
    """A survivor still waiting on this worker's part (a ring's next hop) then fails at once,
    not after the group's timeout; a step refused by decision keeps the group, and so does a
    group formed since the failure (a later fragment's, under delayed local updates)."""
    from thinwire.elastic.membership import Membership

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        membership = Membership(_Votes(), {}, "a test", None)
        if failure == "decision":
            membership.fail("joined a sync without the others' state")
        else:
            assert membership.guard(_lost_peer, "fallback").wait() == "fallback"
        if failure == "collective, group re-formed":
            dist.destroy_process_group()
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
        assert dist.is_initialized()  # left at the vote, not in the exchange's callback
        assert not membership.commit()
        assert dist.is_initialized() == (failure != "collective")
        assert membership.record["failures"] == 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_lost_lighthouse_gives_a_clear_error_in_bounded_time() -> None:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    address = lighthouse.address()
    lighthouse.shutdown()
    start = time.monotonic()
    with pytest.raises(elastic.QuorumLost, match="Lighthouse is gone"):
        # A Lighthouse that has not quite closed its port yet fails the first quorum;
        # one that has fails the connection: either way the error names it.
        manager = elastic.connect(address, timeout_s=2, quorum_timeout_s=2)
        try:
            elastic.manager.quorum(manager)
        finally:
            manager.shutdown(wait=False)
    assert time.monotonic() - start < 60


@pytest.mark.parametrize(("options", "match"), [
    ({"min_workers": 0}, "min_workers=0"), ({"timeout_s": 0}, "timeout_s=0"),
    ({"backend": "mpi"}, "backend='mpi'"), ({"lighthouse": ""}, "no Lighthouse address"),
    ({"heartbeat_timeout_s": 0}, "heartbeat_timeout_s=0")])
def test_bad_options_are_refused_by_name(options: dict[str, Any], match: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(elastic.LIGHTHOUSE_ENV, raising=False)
    with pytest.raises(ValueError, match=match):
        elastic.connect(**{"lighthouse": "http://localhost:1", **options})


@pytest.mark.parametrize("option", ["overlap", "eager", "lookahead"])
def test_overlapped_local_updates_are_refused(option: str) -> None:
    model = nn.Linear(3, 2)
    updates = LocalUpdates(model, torch.optim.SGD(model.parameters(), lr=0.1), every=2,
                           **{option: True})
    with pytest.raises(ValueError, match=f"{option}=False"):
        elastic.ElasticLocalUpdates(updates, None)  # type: ignore[arg-type]
