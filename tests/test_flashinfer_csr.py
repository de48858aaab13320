"""FlashInfer's paged CSR (indptr, indices, last page length) built on the host before each fp8/bf16 decode replay:
the same arrays as the device-side ``paged_indices``, whether the table is cut row by row (wide) or masked whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvfp4_kernels.backends.flashinfer_backend import _ROW_CUT_WIDTH, paged_indices, paged_indices_host


@pytest.mark.parametrize("width", [8, _ROW_CUT_WIDTH - 1, _ROW_CUT_WIDTH, 3 * _ROW_CUT_WIDTH])
def test_host_csr_equals_the_device_one_for_narrow_and_wide_tables(width):
    g = torch.Generator().manual_seed(width)
    batch, page = 7, 16
    table = torch.randint(0, 1 << 20, (batch, width), generator=g, dtype=torch.int32)
    lens = torch.randint(1, width * page + 1, (batch,), generator=g, dtype=torch.int32)
    lens[0], lens[1], lens[2] = 1, page, width * page  # one token, exactly one page, a full row
    want = paged_indices(table, lens, page)
    got = paged_indices_host(table.numpy(), lens.numpy(), page)
    for w, x in zip(want, got, strict=True):
        assert x.dtype == np.int32 and np.array_equal(w.numpy(), x)
    assert paged_indices_host(table.numpy()[:0], lens.numpy()[:0], page)[1].size == 0  # an empty batch
