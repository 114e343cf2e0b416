"""The batched copy's Triton kernel itself, on CPU: run under Triton's interpreter (``TRITON_INTERPRET=1``, a
subprocess) on the tile tables :class:`~weightsync.transport.batch_copy.BatchedCopy` builds, in each of its forms
(``WIDE``: hinted row starts and unmasked whole blocks; ``STREAM``: streaming cache hints; the masked loop), with
small blocks and tiles so that long rows, short rows, column chunks, several alignment groups and masked tails all
occur. tests/test_batch_copy.py checks the tables through the CPU reference executor; tests/test_gpu_* run the
kernel compiled."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

_INTERPRETED = """
import torch
from weightsync.transport import batch_copy as bc

g = torch.Generator().manual_seed(7)
def poisoned(t):
    return torch.full_like(t, float("nan")) if t.is_floating_point() else torch.full_like(t, -1)
mat = torch.randn(151, 700, generator=g).to(torch.bfloat16)      # 1400-byte rows: the 8-aligned group
wide = torch.randn(6, 1024, generator=g)                           # 4096-byte rows: long rows, the 16 group
flat = torch.randn(5003, generator=g)                              # a masked tail
odd = torch.randint(0, 255, (999,), dtype=torch.uint8, generator=g)  # the 1 group
for WIDE, STREAM in ((True, False), (True, True), (False, False)):
    for BLOCK in (64, 256):
        pairs = [(poisoned(mat), mat), (poisoned(wide), wide), (poisoned(flat), flat),
                 (poisoned(mat[:, 350:]), mat[:, 350:]), (poisoned(wide[:, 8:]), wide[:, 8:]),
                 (poisoned(odd[1:]), odd[1:])]
        c = bc.BatchedCopy(pairs, tile_bytes=2048)
        kernel = bc._kernel()
        for align, table in c.tables.items():
            kernel[(table.shape[0],)](table, table.shape[0], W=min(align, 8), ALIGN=align, BLOCK=BLOCK, WIDE=WIDE,
                                      STREAM=STREAM, num_warps=4)
        bad = [i for i, (d, s) in enumerate(pairs) if not torch.equal(d, s)]
        assert not bad, (WIDE, STREAM, BLOCK, bad, c.groups)
        assert len(c.groups) >= 3, c.groups
print("ok")
"""


def test_the_copy_kernel_interpreted_copies_every_tile_exactly():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.path.dirname(HERE))
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    if "only 0-dimensional arrays can be converted" in proc.stderr:  # Triton 3.6's interpreter under numpy 2
        pytest.skip("this Triton's interpreter cannot loop over loaded bounds (Triton >= 3.9 can)")
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr[-4000:]
