"""A job run by two torchrun agents on this machine as two "nodes" (tests/cross_cutting/test_two_nodes.py).

HSDP with one replica per node: ``dp_replicate_size=2`` (node 0 holds ranks 0-1, node 1 ranks 2-3;
the mesh is row-major, so the replicate coordinate is the node), parameters sharded over the 2 ranks
of each node. Rank 0 writes the losses of 3 AdamW steps to ``sys.argv[2]``.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from nemo_wrap import DistributedSetup, NeMoAutoModelForCausalLM, initialize_distributed
from nemo_wrap.training import train_step
from tests.support.batches import local_micro_batches


def main(checkpoint: str, output: str) -> None:
    env = initialize_distributed()
    setup = DistributedSetup.build("fsdp2", env.world_size, dp_replicate_size=2)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, distributed_setup=setup, verify=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    losses = [
        train_step(model, optimizer, local_micro_batches(step, setup.dp_rank(), setup.dp_size, 1)).loss
        for step in range(3)
    ]
    replica = setup.device_mesh()["dp_replicate"].get_local_rank()
    if env.rank == 0:
        with open(output, "w") as file:
            json.dump({"losses": losses, "world": env.world_size, "replica_of_rank0": replica}, file)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
