"""The cluster recipes under docs/recipes: their configuration loads where it is meant to, and
every unshardfs command line in them parses with the real CLI."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

import pytest
import yaml

from unshardfs.app.cli import _parser

RECIPES = Path(__file__).resolve().parents[2] / "docs" / "recipes"


def _parses(argv: list[str]) -> object:
    return _parser().parse_args(argv)


def test_the_slurm_recipe_makes_a_job_script_of_single_threaded_workers(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    jobqueue = pytest.importorskip("dask_jobqueue")
    import dask

    monkeypatch.chdir(tmp_path)  # the recipe's log-directory is made relative to the working directory

    config = yaml.safe_load((RECIPES / "slurm" / "jobqueue.yaml").read_text())
    slurm = config["jobqueue"]["slurm"]
    assert slurm["cores"] == slurm["processes"]  # one thread per worker process
    with dask.config.set({f"jobqueue.slurm.{key}": value for key, value in slurm.items()}):
        with jobqueue.SLURMCluster(account="lab", queue="cpu") as cluster:
            script = cluster.job_script()
    assert "#SBATCH -A lab" in script and "#SBATCH -p cpu" in script
    assert "#SBATCH -t 24:00:00" in script and "#SBATCH --mem=" in script
    assert "--nthreads 1" in script and "--nworkers 8" in script
    assert "--memory-limit 2.00GiB" in script  # 16 GiB over 8 processes: what docs/cluster.md states
    assert "--lifetime-restart" in script
    assert "source $HOME/venvs/unshardfs/bin/activate" in script


def test_the_slurm_driver_runs_a_resumable_export_then_checks_the_manifest():
    spec = importlib.util.spec_from_file_location("slurm_export", RECIPES / "slurm" / "export.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    export, check = module.commands("gs://bucket/seg", "/shared/seg-unsharded", "tcp://10.0.0.1:8786", 4096)
    e, c = _parses(export), _parses(check)
    assert e.command == "export" and e.resume and e.scheduler == "tcp://10.0.0.1:8786" and e.parts == 4096
    assert c.command == "check" and c.manifest == f"{e.dest}/.unshardfs/manifest.jsonl" and c.source == e.dest


def test_the_kubernetes_daskjob_shares_dest_and_takes_the_operators_scheduler():
    job = yaml.safe_load((RECIPES / "kubernetes" / "daskjob.yaml").read_text())
    assert job["apiVersion"] == "kubernetes.dask.org/v1" and job["kind"] == "DaskJob"
    pod = job["spec"]["job"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["sh", "-c"]
    runs = [shlex.split(part) for part in container["args"][0].split("&&")]
    export, check = (_parses(argv[1:]) for argv in runs)
    assert [argv[0] for argv in runs] == ["unshardfs", "unshardfs"]
    assert export.command == "export" and export.resume and export.scheduler == "env"
    assert check.command == "check" and check.scheduler == "env"
    assert check.manifest == f"{export.dest}/.unshardfs/manifest.jsonl" and check.source == export.dest
    worker = job["spec"]["cluster"]["spec"]["worker"]["spec"]
    args = worker["containers"][0]["args"]
    assert args[:2] == ["dask", "worker"] and args[args.index("--nthreads") + 1] == "1"
    limit = args[args.index("--memory-limit") + 1]
    assert limit == "2GiB" and worker["containers"][0]["resources"]["limits"]["memory"] == "2Gi"
    # DEST is on one volume, mounted at the same path in the job pod and every worker.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    worker_mounts = {m["name"]: m["mountPath"] for m in worker["containers"][0]["volumeMounts"]}
    claim = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
    worker_claim = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in worker["volumes"]}
    assert mounts == worker_mounts and claim == worker_claim
    assert any(export.dest.startswith(path + "/") for path in mounts.values())
    scheduler = job["spec"]["cluster"]["spec"]["scheduler"]
    assert scheduler["spec"]["containers"][0]["args"] == ["dask", "scheduler"]
    assert {p["port"] for p in scheduler["service"]["ports"]} >= {8786}
