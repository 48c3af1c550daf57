"""Data-parallel training on NCCL: one process per GPU, every rank a full copy of the model.

    python -m gptcuda.launch --nproc 2 train.py configs/tiny.yaml       # see gptcuda/launch.py

What a rank does (train.py -> Trainer -> Engine -> DataParallel):

  * parse_env()          RANK, WORLD_SIZE, LOCAL_RANK (and the rendezvous settings) from the launcher,
                         or from mpirun / srun through the same variables (README, "Several GPUs")
  * init_group(env)      rank 0 makes the NCCL unique id; share_unique_id hands it to every rank
                         through a TCP socket that rank 0 serves on MASTER_ADDR:MASTER_PORT, or a
                         file in a shared directory; bounded retries and timeouts, one-line errors
  * DataParallel(...)    the communicator (nccl4py's bindings, imported here and only here), the
                         start-up self-test, and the data-parallel part of the recorded step:
        - rank r reads rows [r*B, (r+1)*B) of each micro-batch of the world's batch (the Engine's
          batches.Batches gets the rank), with its own dropout stream (rank_seed: the run's seed
          mixed with the rank, rank 0 keeps it; the Engine builds the rank's backend with it and
          DataParallel checks it);
        - the loss mean and the gradients are all-reduced (ncclAvg: the sum divided by the world
          size, so each rank keeps grad_scale 1/(B*T)) in buckets on a second stream, each bucket
          as soon as the backward has written its last tensor (plan_buckets; with gradient
          accumulation, after the last micro-batch's backward has added the others'); the main stream
          waits for the communication stream before the gradient norm and AdamW;
        - zero: 1 instead reduce-scatters the gradients after the backward, takes the norm of this
          rank's shard (partial sums all-reduced), updates its shard with its share of the Adam
          state, and all-gathers the parameters (zero_shards).

World size 1 never comes here unless asked (GPTCUDA_DIST=nccl): the single-GPU step is unchanged
and nothing imports NCCL. NCCL_NVLS_ENABLE=0 is forced: no NVLink multicast.

The modules: env.py (parse_env, DistEnv, DistError, rank_seed), rendezvous.py (share_unique_id,
Group, init_group), nccl.py (NcclComm, load_nccl, the self-test), buckets.py (plan_buckets,
zero_shards), parallel.py (DataParallel).
"""
from __future__ import annotations

from gptcuda.dist.buckets import (ALIGN, Bucket, ZeroShards, _merge, plan_buckets, production_order,
                                  tensor_extents, zero_shards)
from gptcuda.dist.env import (DEFAULT_BUCKET_MB, DEFAULT_PORT, DEFAULT_TIMEOUT_S, DistEnv, DistError,
                              parse_env, rank_seed)
from gptcuda.dist.nccl import (DTYPES, ITEMSIZE, OPS, UID_BYTES, NcclComm, check_selftest, load_nccl,
                               nccl_version, selftest, selftest_vectors)
from gptcuda.dist.parallel import DataParallel
from gptcuda.dist.rendezvous import MAGIC, Group, init_group, rdzv_path, share_unique_id

__all__ = ["DistError", "DistEnv", "parse_env", "share_unique_id", "init_group", "Group", "NcclComm",
           "Bucket", "tensor_extents", "production_order", "plan_buckets", "ZeroShards", "zero_shards",
           "selftest_vectors", "check_selftest", "selftest", "rank_seed", "DataParallel"]
