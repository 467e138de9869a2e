"""Shards and partials that arrive late, on the CPU: ``check=True`` scores out a racy config of the shard GEMM, and
GEMM-RS's own rows' GEMM adds each peer's partial only once it has landed.

A host thread delivers them (see ``late_shards``); ``test_gpu.py`` runs the same cases on one GPU with a side
CUDA stream delivering them.
"""

from __future__ import annotations

import pytest
import torch

from disttune.kernels.matmul import gemm_config
from late_shards import HostThreadArrivals, check_scores_out_racy_config, own_rows_gemm_with_late_partials

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


@pytest.mark.parametrize("rows", [40, 300], ids=str)
def test_the_own_rows_gemm_adds_each_peers_partial_only_once_it_has_landed(rows):
    found = own_rows_gemm_with_late_partials(HostThreadArrivals(0.5), gemm_config(32, 16, 16, 1, 1, 1), rows=rows,
                                             K=32, N=48, dtype=torch.float32, device="cpu")
    assert found == {"right": True, "nan": False, "late": True}, found
