"""The (site x shard) device mesh: replicate across sites, shard inside each."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from thinwire.comm.collectives import world


def site_mesh(sites: int, device_type: str = "cpu") -> DeviceMesh:
    """A 2-D mesh over the default group: dim ``"site"`` across sites, ``"shard"`` inside.

    Ranks ``[s * shards, (s + 1) * shards)`` form site ``s``, so a site's ranks are
    neighbours (one machine, or one fast network, under torchrun). Shard with
    ``fully_shard(module, mesh=mesh["shard"])`` and pass ``mesh["site"].get_group()``
    to :func:`thinwire.fsdp.register`; native HSDP takes the whole mesh.

    Raises:
        ValueError: ``sites`` is not an integer in [1, world size] that divides it.
    """
    _, size = world()
    if (not isinstance(sites, int) or isinstance(sites, bool) or not 1 <= sites <= size
            or size % sites):
        raise ValueError(f"sites={sites!r} must be an integer in [1, {size}] that divides "
                         f"the world size {size}")
    return init_device_mesh(device_type, (sites, size // sites),
                            mesh_dim_names=("site", "shard"))
