#!/usr/bin/env python3
"""Run the Megatron-facing tests on every megatron-core release the package declares.

    tests/compat/run_matrix.sh                        # all rows of MATRIX, results/matrix.json
    tests/compat/run_matrix.sh --versions 0.19.2      # one row (merged into the existing table)

One virtual environment per megatron-core release, under ``$FCP_MATRIX_HOME`` (default
``~/.cache/megatron_fcp_matrix``, never inside the repository) and reused between runs:

* ``base-py3.X``: torch==2.13.0 and the test dependencies, once per Python (on 3.12 torch is a
  multi-GB CUDA build that runs on CPU, so it is downloaded once and shared);
* ``mcore-<version>-py3.X``: sees the base through a ``.pth`` file and holds megatron-core itself
  (its own numpy where a release pins ``numpy<2``) and this repository installed editable.

Each row runs the test groups of :data:`GROUPS` with pytest, one after another (``nice``,
``OMP_NUM_THREADS=1``: the machine has 2 cores), and the end-to-end group reports the largest
relative loss difference of cp=4 and tp=2 x cp=2 against cp=1 over its 10 steps; the pretrain group
(Megatron-LM's own ``pretrain()`` loop, 5 steps) reports the launcher's cp=2 and the ``--spec``
route's tp=2 x cp=2 against cp=1, and the seconds of each run. A missing
interpreter or a failed install is a row of the table, not a crash; the exit status is non-zero
when a row that could run failed (a missing interpreter only warns). The table is JSON: one row
per release with python, torch, result per group, the max relative loss difference and durations.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "tests" / "compat" / "results" / "matrix.json"
TORCH = "torch==2.13.0"
#: What every base environment holds besides torch (the project's runtime and test deps).
BASE_PACKAGES = ("numpy", "networkx>=3.0", "PyYAML>=6.0", "einops>=0.7", "tqdm>=4.0", "packaging",
                 "pytest>=7.4", "hypothesis>=6.80", "matplotlib>=3.7")

#: (megatron-core release, Python minor): the latest patch of each minor release pip offers;
#: 0.17 and later need Python 3.12.
MATRIX: tuple[tuple[str, str], ...] = (
    ("0.14.0", "3.11"),
    ("0.15.3", "3.11"),
    ("0.16.1", "3.11"),
    ("0.17.1", "3.12"),
    ("0.18.2", "3.12"),
    ("0.19.2", "3.12"),
)

#: Test groups: name -> test files. Everything here imports or runs megatron-core.
GROUPS: dict[str, tuple[str, ...]] = {
    "patches": ("tests/test_patches.py", "tests/test_te_spec.py"),
    "compat": ("tests/test_compat.py",),
    "config": ("tests/test_config.py",),
    "training": ("tests/test_megatron_training.py",),  # skipped where the wheel has no megatron.training
    "layout": ("tests/test_layout.py",),
    "e2e": ("tests/test_gpt_e2e.py",),
    # megatron.training's own pretrain() through megatron_fcp.run and --spec (skipped on 0.14-0.16)
    "pretrain": ("tests/test_megatron_pretrain.py",),
}
E2E_TOLERANCE = 1e-5
sys.path.insert(0, str(REPO / "tests"))
from _megatron_world import STEPS as E2E_STEPS  # noqa: E402  (the trainings' length is decided there)


# ---- interpreters and environments -----------------------------------------------------------------
def find_python(minor: str) -> str | None:
    """Path of a ``python<minor>`` interpreter: pyenv's newest ``<minor>.x`` first, then ``PATH``."""
    pyenv = shutil.which("pyenv")
    if pyenv:
        out = subprocess.run([pyenv, "versions", "--bare"], capture_output=True, text=True).stdout.split()
        found = sorted((v for v in out if v.startswith(minor + ".") and v.replace(".", "").isdigit()),
                       key=lambda v: tuple(int(x) for x in v.split(".")))
        if found:
            prefix = subprocess.run([pyenv, "prefix", found[-1]], capture_output=True, text=True).stdout.strip()
            exe = Path(prefix) / "bin" / f"python{minor}"
            if exe.exists():
                return str(exe)
    exe = shutil.which(f"python{minor}")
    if exe and not exe.startswith(str(Path.home() / ".pyenv" / "shims")):
        return exe
    if exe:  # a pyenv shim: only usable if it resolves
        ok = subprocess.run([exe, "-c", "pass"], capture_output=True).returncode == 0
        return exe if ok else None
    return None


def _run(cmd: list[str], log: Path, **kw: Any) -> int:
    with open(log, "a", encoding="utf-8") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        return subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, **kw).returncode


def _venv_python(env: Path) -> Path:
    return env / "bin" / "python"


def _site_packages(python: Path) -> str:
    return subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()


def _pip(python: Path, *args: str) -> list[str]:
    return ["nice", "-n", "10", str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]


@dataclass
class Env:
    python: Path
    install_s: dict[str, float]  # seconds spent installing, per environment, when first built
    log: Path


def ensure_base(interpreter: str, minor: str, home: Path, log: Path) -> tuple[Path, float]:
    """The shared torch environment of one Python; built once (returns its install seconds)."""
    base = home / f"base-py{minor}"
    marker = base / "fcp-matrix-ready.json"
    if marker.exists():
        return base, json.loads(marker.read_text())["install_s"]
    t0 = time.perf_counter()
    if not _venv_python(base).exists():
        if _run([interpreter, "-m", "venv", str(base)], log):
            raise RuntimeError(f"could not create {base} (see {log})")
    if _run(_pip(_venv_python(base), TORCH, *BASE_PACKAGES), log):
        raise RuntimeError(f"installing {TORCH} into {base} failed (see {log})")
    seconds = round(time.perf_counter() - t0, 1)
    marker.write_text(json.dumps({"install_s": seconds}))
    return base, seconds


def ensure_env(version: str, minor: str, interpreter: str, home: Path) -> Env:
    """The environment of one megatron-core release (built on first use, reused afterwards)."""
    home.mkdir(parents=True, exist_ok=True)
    log = home / f"mcore-{version}-py{minor}.log"
    base, base_s = ensure_base(interpreter, minor, home, log)
    env = home / f"mcore-{version}-py{minor}"
    marker = env / "fcp-matrix-ready.json"
    python = _venv_python(env)
    # setup.py's digest: an environment built before the project's requirements changed (numba,
    # 2026-12-06) installs the repository again, which brings what it now requires
    wanted = {"repo": str(REPO), "setup": hashlib.sha256((REPO / "setup.py").read_bytes()).hexdigest()[:16]}
    if marker.exists():
        got = json.loads(marker.read_text())
        if {k: got.get(k) for k in wanted} == wanted:
            return Env(python, {"base": base_s, "env": got["install_s"]}, log)
        if got.get("repo") == str(REPO) and python.exists():
            t0 = time.perf_counter()
            if _run(_pip(python, TORCH, "-e", f"{REPO}[test]"), log):
                raise RuntimeError(f"installing {REPO} editable failed (see {log})")
            marker.write_text(json.dumps({"install_s": got["install_s"], **wanted}))
            return Env(python, {"base": base_s, "env": round(time.perf_counter() - t0, 1)}, log)
    t0 = time.perf_counter()
    if not python.exists() and _run([interpreter, "-m", "venv", str(env)], log):
        raise RuntimeError(f"could not create {env} (see {log})")
    # The base's packages (torch above all) are visible here; this env's own come first.
    Path(_site_packages(python), "fcp_matrix_base.pth").write_text(_site_packages(_venv_python(base)) + "\n")
    if _run(_pip(python, TORCH, f"megatron-core=={version}"), log):
        raise RuntimeError(f"installing megatron-core=={version} failed (see {log})")
    if _run(_pip(python, TORCH, "-e", f"{REPO}[test]"), log):
        raise RuntimeError(f"installing {REPO} editable failed (see {log})")
    seconds = time.perf_counter() - t0
    marker.write_text(json.dumps({"install_s": round(seconds, 1), **wanted}))
    return Env(python, {"base": base_s, "env": round(seconds, 1)}, log)


# ---- running a row ---------------------------------------------------------------------------------
def _versions(python: Path) -> dict[str, str]:
    code = ("import json, platform, torch; from megatron.core import package_info as p; "
            "print(json.dumps({'python': platform.python_version(), 'torch': torch.__version__, "
            "'megatron_core': p.__version__}))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=REPO)
    if out.returncode:
        raise RuntimeError(f"{python} cannot import torch/megatron.core: {out.stderr.strip()[-400:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _junit_counts(path: Path) -> dict[str, int]:
    if not path.exists():
        return {"tests": 0, "failures": 0, "errors": 1, "skipped": 0}
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def run_group(env: Env, name: str, files: tuple[str, ...], tmp: Path) -> dict[str, Any]:
    """Run one test group with pytest in ``env``; counts, seconds and (e2e) loss differences."""
    junit = tmp / f"{name}.xml"
    cmd = ["nice", "-n", "10", str(env.python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
           f"--junitxml={junit}", *files]
    metrics = tmp / "e2e-metrics.json"
    pretrain_metrics = tmp / "pretrain-metrics.json"
    if name == "e2e":
        cmd.append(f"--fcp-e2e-metrics={metrics}")
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    if name == "pretrain":
        run_env["FCP_PRETRAIN_METRICS_OUT"] = str(pretrain_metrics)
    t0 = time.perf_counter()
    rc = _run(cmd, env.log, cwd=REPO, env=run_env)
    counts = _junit_counts(junit)
    passed = max(0, counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"])
    failed = counts["failures"] + counts["errors"]
    if rc in (0, 5) and not failed and not passed and counts["skipped"]:
        result = "skipped"  # e.g. no megatron.training in this wheel: every test says why it skips
    else:
        result = "pass" if rc == 0 and passed > 0 and not failed else "fail"
    row: dict[str, Any] = {
        "result": result,
        "passed": passed,
        "failed": failed,
        "skipped": counts["skipped"],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if name == "e2e" and metrics.exists():
        runs = json.loads(metrics.read_text())
        row["max_rel_loss_diff"] = {
            "cp4_vs_cp1": _max_rel(runs["cp4"]["losses"], runs["cp1"]["losses"]),
            "tp2cp2_vs_cp1": _max_rel(runs["tp2cp2"]["losses"], runs["cp1"]["losses"]),
        }
        row["steps"] = len(runs["cp1"]["losses"])
    if name == "pretrain" and pretrain_metrics.exists():
        runs = json.loads(pretrain_metrics.read_text())
        row["max_rel_loss_diff"] = {}
        for k in ("launcher", "spec"):
            ref = "tp2cp1" if runs[k]["tp"] == 2 and "tp2cp1" in runs else "cp1"  # pretrain_runs.reference_of
            a, b = runs[k]["losses"], runs[ref]["losses"]
            row["max_rel_loss_diff"][f"{k}_{'tp2cp2' if runs[k]['tp'] == 2 else 'cp2'}_vs_{ref}"] = (
                _max_rel(a, b) if a and b else None)
        if "tp2cp1" in runs and runs["tp2cp1"]["losses"] and runs["cp1"]["losses"]:
            row["megatron_own_tp2_vs_tp1"] = _max_rel(runs["tp2cp1"]["losses"], runs["cp1"]["losses"])
        row["steps"] = len(runs["cp1"]["losses"])
        row["run_seconds"] = {k: v["seconds"] for k, v in runs.items()}
        row["standins"] = len(runs["cp1"].get("standins", []))
    return row


def run_row(version: str, minor: str, home: Path, groups: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    """One table row: install (or reuse) the env, run every group, summarise."""
    row: dict[str, Any] = {"megatron_core": version, "python": minor}
    interpreter = find_python(minor)
    if interpreter is None:
        row.update(result="no interpreter", detail=f"no python{minor} found (pyenv or PATH)")
        return row
    t0 = time.perf_counter()
    try:
        env = ensure_env(version, minor, interpreter, home)
        row.update(_versions(env.python))
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        row.update(result="install failed", detail=str(exc))
        return row
    row["install_s"] = env.install_s
    row["install_or_reuse_s"] = round(time.perf_counter() - t0, 1)
    row["groups"] = {}
    with tempfile.TemporaryDirectory(prefix=f"fcp-matrix-{version}-") as tmp:
        for name, files in groups.items():
            print(f"[matrix] megatron-core {version} (python {row['python']}): {name} ...", flush=True)
            row["groups"][name] = run_group(env, name, files, Path(tmp))
            print(f"[matrix]   {name}: {row['groups'][name]}", flush=True)
    e2e = row["groups"].get("e2e", {})
    diffs = e2e.get("max_rel_loss_diff")
    row["max_rel_loss_diff"] = max(diffs.values()) if diffs else None
    ok = all(g["result"] in ("pass", "skipped") for g in row["groups"].values())
    if "e2e" in groups:
        ok = ok and diffs is not None and row["max_rel_loss_diff"] <= E2E_TOLERANCE
    pretrain = row["groups"].get("pretrain", {}).get("max_rel_loss_diff")
    if pretrain:  # Megatron's own loop; absent where the wheel has no megatron.training (skipped)
        values = [v for v in pretrain.values() if v is not None]
        row["pretrain_max_rel_loss_diff"] = max(values) if len(values) == len(pretrain) else None
        ok = ok and row["pretrain_max_rel_loss_diff"] is not None and row["pretrain_max_rel_loss_diff"] <= E2E_TOLERANCE
    row["tests_s"] = round(sum(g["seconds"] for g in row["groups"].values()), 1)
    row["result"] = "pass" if ok else "fail"
    row["log"] = env.log.name  # in the matrix home (--home)
    return row


def merge(table_path: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Replace the rows of the releases just run in the table at ``table_path`` (keep the others)."""
    table: dict[str, Any] = {"rows": []}
    if table_path.exists():
        table = json.loads(table_path.read_text())
    done = {r["megatron_core"] for r in rows}
    kept = [r for r in table.get("rows", []) if r["megatron_core"] not in done]
    order = {v: i for i, (v, _) in enumerate(MATRIX)}
    table["rows"] = sorted(kept + rows, key=lambda r: order.get(r["megatron_core"], len(order)))
    table["tolerance"] = {"max_rel_loss_diff": E2E_TOLERANCE, "steps": E2E_STEPS, "pretrain_steps": 5}
    table["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "gpu": False}
    table["updated"] = time.strftime("%Y-%m-%d %H:%M:%S")
    table["groups"] = {k: list(v) for k, v in GROUPS.items()}
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--versions", help="comma-separated megatron-core releases of MATRIX (default: all)")
    p.add_argument("--groups", help=f"comma-separated test groups (default: all of {','.join(GROUPS)})")
    p.add_argument("--home", default=os.environ.get("FCP_MATRIX_HOME",
                                                    str(Path.home() / ".cache" / "megatron_fcp_matrix")),
                   help="where the virtual environments live (default $FCP_MATRIX_HOME or ~/.cache/...)")
    p.add_argument("--out", default=str(RESULTS), help="JSON table to write (rows are merged)")
    args = p.parse_args(argv)
    wanted = args.versions.split(",") if args.versions else [v for v, _ in MATRIX]
    known = dict(MATRIX)
    unknown = [v for v in wanted if v not in known]
    if unknown:
        p.error(f"unknown release(s) {unknown}; the matrix has {list(known)}")
    groups = {k: GROUPS[k] for k in (args.groups.split(",") if args.groups else GROUPS)}
    rows = []
    for version in wanted:
        row = run_row(version, known[version], Path(args.home).expanduser(), groups)
        print(f"[matrix] megatron-core {version}: {row['result']}", flush=True)
        rows.append(row)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(merge(out, rows), indent=1) + "\n")  # after each row: partial runs count
    print(f"[matrix] wrote {args.out}")
    for r in rows:
        print(f"  {r['megatron_core']:8s} py{r.get('python', '?'):8s} {r['result']:15s} "
              f"max rel loss diff {r.get('max_rel_loss_diff')} (pretrain() {r.get('pretrain_max_rel_loss_diff')})")
    missing = [r["megatron_core"] for r in rows if r["result"] == "no interpreter"]
    if missing:
        print(f"[matrix] WARNING: not run for lack of an interpreter: {', '.join(missing)}")
    return 0 if all(r["result"] in ("pass", "no interpreter") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
