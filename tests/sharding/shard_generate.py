"""One rank of a tensor-parallel tiny llama (mlx-lm's Model.shard over mx.distributed) generating
greedily with our caches; run by tests/sharding/test_sharding.py as
`mlx.launch -n 2 --backend ring python tests/sharding/shard_generate.py OUT.json METHOD`.

Each rank builds the same random weights (same seed), shards them (half the query and KV heads
per rank, o_proj / down_proj summed across ranks), and patches the model with our caches, which are
per-process and see n_kv_heads / world_size heads. Rank 0 writes the tokens and what the caches
saw.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from veloxquant_mlx import patch_model_kv_cache, unpatch_model_kv_cache  # noqa: E402
from veloxquant_mlx.cache.base import CompressedKVCache  # noqa: E402
from tests.architectures.servable import config_for  # noqa: E402
from tests.sharding.reference import N_NEW, PROMPT, sharding_model  # noqa: E402


def _run(group, method, patch_first):
    model = sharding_model()
    config = config_for(method)
    if patch_first:  # caches read their shape at the first update, so the order does not matter
        patch_model_kv_cache(model, config)
        model.shard(group)
    else:
        model.shard(group)
        patch_model_kv_cache(model, config)
    caches = model.make_cache()
    tokens = [int(t) for t, _ in generate_step(PROMPT, model, max_tokens=N_NEW, prompt_cache=caches)]
    unpatch_model_kv_cache(model)
    fp16 = [int(t) for t, _ in generate_step(PROMPT, model, max_tokens=N_NEW)]
    seen = [[c.n_kv_heads, c.head_dim, c.n_compressed] for c in caches if isinstance(c, CompressedKVCache)]
    return {"tokens": tokens, "fp16": fp16, "caches": seen}


def main(out_path, method):
    group = mx.distributed.init(strict=True)
    result = {"world": group.size(), "shard_then_patch": _run(group, method, False),
              "patch_then_shard": _run(group, method, True)}
    if group.rank() == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
