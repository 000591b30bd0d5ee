"""What a training step imports of the package: the lines of every ``megatron_fcp`` module loaded
after ``apply_fcp`` and one FCP forward + backward (cp = 2, two gloo processes, the local spec's
attention replaced; no CLI, no emulator, no cost-model study).

    python benchmarks/import_closure.py [--json OUT]

Each rank runs in a fresh interpreter (``torch.multiprocessing.spawn``), so nothing imported by the
script itself counts beyond what the step needs; rank 0 reports. Prints one JSON object: the
package's lines in all, the lines and modules of the step's closure, and the closure's modules.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _lines(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def _step(rank: int, world: int, init: str, out: str) -> None:
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from megatron_fcp import FCPConfig, apply_fcp, fcp_attention

    apply_fcp(FCPConfig(enabled=True))
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(16, 1, 2, 8, generator=g, requires_grad=True) for _ in range(3))
    fcp_attention(q, k, v, cp_group=dist.group.WORLD, plan="full").sum().backward()
    mods = sorted((n, m.__file__) for n, m in list(sys.modules.items())
                  if n.split(".")[0] == "megatron_fcp" and getattr(m, "__file__", None))
    if rank == 0:
        Path(out).write_text(json.dumps(mods))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "mods.json")
        mp.spawn(_step, args=(2, f"file://{d}/rdzv", out), nprocs=2)
        mods = json.loads(Path(out).read_text())
    pkg = sorted(ROOT.joinpath("megatron_fcp").rglob("*.py"))
    closure = {n: _lines(p) for n, p in mods}
    res = {"package_lines": sum(_lines(str(p)) for p in pkg), "package_modules": len(pkg),
           "step_lines": sum(closure.values()), "step_modules": len(closure), "step_closure": closure}
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
