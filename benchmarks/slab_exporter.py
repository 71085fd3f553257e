"""A child for CUDA slab tests: allocate and fill a slab, export it, release its own handle and
mapping, send the fd with the data's sha256 over the Unix socket FD, then wait to be killed.

    python benchmarks/slab_exporter.py FD DEVICE SIZE

One script for benchmarks/cuda_smoke.py and tests/test_slabs_cuda.py (they run its text).
"""

import hashlib
import socket
import sys
import time

import torch

from vlaunch.cache.store.slabs import get_backend

sock = socket.socket(fileno=int(sys.argv[1]))
size = int(sys.argv[3])
slab = get_backend(sys.argv[2]).allocate(size)
g = torch.Generator(sys.argv[2]).manual_seed(7)
slab.tensor().copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g,
                                  device=sys.argv[2]))
digest = hashlib.sha256(slab.tensor().cpu().numpy().tobytes()).hexdigest()
fd = slab.export_fd()
slab.release()
socket.send_fds(sock, [f"{size} {digest}".encode()], [fd])
time.sleep(600)
