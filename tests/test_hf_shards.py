"""How an export cuts its weights into safetensors shards (``shard_tensors``), without
torch or a model: name order, the byte budget, and a tensor too large for any shard."""

from __future__ import annotations

import numpy as np

from raytunix.models.hf import shard_tensors


def test_shards_keep_name_order_stay_under_the_budget_and_an_oversized_tensor_stands_alone():
    tensors = {
        "c": np.zeros(10, np.float32),  # 40 bytes
        "a": np.zeros(5, np.float32),  # 20 bytes
        "b": np.zeros(5, np.float32),  # 20 bytes
        "d": np.zeros(30, np.float32),  # 120 bytes: over the budget on its own
    }
    shards = shard_tensors(tensors, max_shard_bytes=60)
    assert [list(shard) for shard in shards] == [["a", "b"], ["c"], ["d"]]
    assert shard_tensors(tensors, max_shard_bytes=10**6) == [
        {name: tensors[name] for name in "abcd"}
    ]
