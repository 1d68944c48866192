"""A script that knows nothing of ddpnb: prints, writes out.txt on rank 0, exits."""

import os
import sys

rank = int(os.environ["RANK"])
print(f"plain rank {rank} sees {sys.argv[1:]!r} in {os.getcwd()}", flush=True)
if rank == 0:
    with open("out.txt", "w") as f:
        f.write(" ".join(sys.argv[1:]))
