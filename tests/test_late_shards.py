"""``check=True`` scores out a racy config of the shard GEMM whose shards arrive late, on the CPU.

A host thread delivers the shards (see ``late_shards``); ``test_gpu.py`` runs the same case on one GPU
with a side CUDA stream delivering them.
"""

from __future__ import annotations

import pytest
import torch

from disttune.kernels.matmul import gemm_config
from late_shards import HostThreadArrivals, check_scores_out_racy_config

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="a host thread cannot deliver while a GPU kernel spins; "
                       "on a GPU, test_gpu.py runs this case with a side stream"),
    # triton 3.6's interpreter turns runtime scalars into ints through 1-element arrays: harmless noise
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]


@pytest.mark.slow
@pytest.mark.parametrize("check", [False, True])
def test_check_scores_out_a_shard_gemm_config_that_reads_shards_before_they_arrive(check, tmp_path):
    waiting = gemm_config(16, 16, 16, 1, 1, 1)
    found = check_scores_out_racy_config(HostThreadArrivals(), waiting, check, tmp_path, rows=16, K=16, N=16,
                                         dtype=torch.float32, device="cpu")
    if check:
        assert found["winner"] == 0 and found["right"] and found["agreed_ms"][1] == float("inf"), found
    else:  # the racy config is timed the fastest, so unchecked it wins and the output is wrong
        assert found["winner"] == 1 and not found["right"], found
