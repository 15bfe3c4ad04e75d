"""Time of the fit's eigendecomposition: torch's full `eigh` against LAPACK's top-r only.

The fitted projection keeps the top-r eigenvectors of each input's float64 second moment
(`logra.projection`); torch computes every eigenpair. SciPy's `eigh(subset_by_index=...,
driver="evr")` (LAPACK `syevr`) computes only the top r. SciPy is not a logra dependency:
`pip install scipy` first. Prints, per width, both times and the overlap of the two top-r
subspaces (mean squared cosine of their principal angles; 1 = the same subspace).

    python scripts/bench_eigh.py --widths 1024 2816 --rank 256 --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch

try:
    import scipy.linalg
except ImportError as exc:  # not a dependency of logra
    raise SystemExit("bench_eigh.py needs SciPy: pip install scipy") from exc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", nargs="+", type=int, default=[1024, 2816], help="input widths")
    p.add_argument("--rank", type=int, default=256, help="eigenvectors kept (r)")
    p.add_argument("--tokens", type=int, default=4096, help="rows of the random inputs")
    p.add_argument("--threads", type=int, default=1, help="torch threads (SciPy's BLAS follows OMP_NUM_THREADS)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print("| width | rank | torch eigh (s) | scipy syevr top-r (s) | speed-up | subspace overlap |")
    print("|---|---|---|---|---|---|")
    for n in args.widths:
        g = torch.Generator().manual_seed(0)
        # columns of graded scale, so the top-r subspace is well separated from the rest
        x = torch.randn(args.tokens, n, dtype=torch.float64, generator=g)
        x *= torch.linspace(0.1, 2.0, n, dtype=torch.float64)
        moment = x.T @ x
        t0 = time.perf_counter()
        full = torch.linalg.eigh(moment)[1][:, -args.rank:]
        t_torch = time.perf_counter() - t0
        t0 = time.perf_counter()
        top = scipy.linalg.eigh(moment.numpy(), subset_by_index=[n - args.rank, n - 1], driver="evr")[1]
        t_scipy = time.perf_counter() - t0
        overlap = (torch.linalg.svdvals(full.T @ torch.from_numpy(top)) ** 2).mean().item()
        print(f"| {n} | {args.rank} | {t_torch:.2f} | {t_scipy:.2f} | {t_torch / t_scipy:.2f}× | {overlap:.6f} |")


if __name__ == "__main__":
    main()
