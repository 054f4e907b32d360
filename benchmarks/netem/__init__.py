"""Real bandwidth-limited benchmarks: workers in network namespaces on tbf-shaped veth links.

    sudo python -m benchmarks.netem            # full run (~15 min on 2 cores)
    sudo python -m benchmarks.netem --quick    # ~2 min check: 100mbit, 2 workers
    sudo python -m benchmarks.netem --cleanup  # remove leftovers of killed runs

See docs/bench.md for the topology, the shaping and what is measured.
"""
