"""The Kubernetes and SkyPilot jobs ``zerotrain launch`` writes: valid against their schemas, and their shell
command, run with the variables the scheduler sets, gives zerotrain the flags of this node.

No cluster here: the manifests are checked with jsonschema against the fields of the Kubeflow training operator's
PyTorchJob CRD (``kubeflow.org/v1``; with the core Pod fields the template uses) and of SkyPilot's task YAML
schema, written below, unknown keys refused at every level a template writes. The sbatch script runs under a real
SLURM in test_slurm.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest
import yaml

from zerotrain.config.flags import parse_config
from zerotrain.errors import UserError
from zerotrain.runtime.templates import emit, job_spec

FIT = ["fit", "toy", "--launch.nproc_per_node", "4", "--launch.nnodes", "2", "--trainer.max_steps", "50",
       "--checkpoint.every_steps", "10", "--trainer.output_dir", "/mnt/runs", "--launch.rdzv_endpoint=h:1"]

# What the child prints: its arguments and whether torchrun's RANK/WORLD_SIZE reached it.
PRINT_ARGV = f"{sys.executable} -c 'import json, os, sys; print(json.dumps([sys.argv[1:], os.environ.get(\"RANK\"), " \
             "os.environ.get(\"WORLD_SIZE\")]))'"


def _obj(properties: dict, required: tuple = ()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


INT_OR_STRING = {"anyOf": [{"type": "integer"}, {"type": "string"}]}
CONTAINER = _obj({
    "name": {"type": "string"}, "image": {"type": "string"},
    "command": {"type": "array", "items": {"type": "string"}}, "args": {"type": "array", "items": {"type": "string"}},
    "env": {"type": "array"},
    "resources": _obj({"limits": {"type": "object", "additionalProperties": INT_OR_STRING},
                       "requests": {"type": "object", "additionalProperties": INT_OR_STRING}}),
    "volumeMounts": {"type": "array", "items": _obj({"name": {"type": "string"}, "mountPath": {"type": "string"},
                                                     "readOnly": {"type": "boolean"}}, ("name", "mountPath"))},
}, ("name",))
VOLUME = _obj({"name": {"type": "string"},
               "persistentVolumeClaim": _obj({"claimName": {"type": "string"}, "readOnly": {"type": "boolean"}},
                                             ("claimName",)),
               "emptyDir": _obj({"medium": {"type": "string"}, "sizeLimit": INT_OR_STRING})}, ("name",))
REPLICA = _obj({
    "replicas": {"type": "integer", "minimum": 0},
    "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
    "template": _obj({"metadata": {"type": "object"}, "spec": _obj({
        "containers": {"type": "array", "minItems": 1, "items": CONTAINER},
        "volumes": {"type": "array", "items": VOLUME},
        "terminationGracePeriodSeconds": {"type": "integer", "minimum": 0},
    }, ("containers",))}),
}, ("template",))
PYTORCH_JOB = _obj({
    "apiVersion": {"const": "kubeflow.org/v1"}, "kind": {"const": "PyTorchJob"},
    "metadata": _obj({"name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                      "namespace": {"type": "string"}}, ("name",)),
    "spec": _obj({
        "runPolicy": _obj({"backoffLimit": {"type": "integer", "minimum": 0},
                           "cleanPodPolicy": {"enum": ["All", "Running", "None"]},
                           "activeDeadlineSeconds": {"type": "integer"},
                           "ttlSecondsAfterFinished": {"type": "integer"}}),
        "nprocPerNode": {"type": "string"},
        "pytorchReplicaSpecs": {"type": "object", "propertyNames": {"enum": ["Master", "Worker"]},
                                "additionalProperties": REPLICA, "required": ["Master"]},
    }, ("pytorchReplicaSpecs",)),
}, ("apiVersion", "kind", "metadata", "spec"))

SKYPILOT_TASK = _obj({
    "name": {"type": "string"}, "workdir": {"type": "string"},
    "num_nodes": {"type": "integer", "minimum": 1},
    "resources": _obj({
        "cloud": {"type": "string"}, "region": {"type": "string"}, "zone": {"type": "string"},
        "accelerators": {"anyOf": [{"type": "string", "pattern": r"^[A-Za-z0-9-]+(:\d+)?$"},
                                   {"type": "object", "additionalProperties": {"type": "integer"}}]},
        "cpus": INT_OR_STRING, "memory": INT_OR_STRING, "use_spot": {"type": "boolean"},
        "disk_size": {"type": "integer"}, "image_id": {"type": "string"},
        "job_recovery": {"anyOf": [{"type": "string"}, _obj({
            "strategy": {"enum": ["FAILOVER", "EAGER_NEXT_REGION"]},
            "max_restarts_on_errors": {"type": "integer", "minimum": 0}})]},
    }),
    "envs": {"type": "object", "additionalProperties": {"type": ["string", "number", "boolean", "null"]}},
    "file_mounts": {"type": "object", "additionalProperties": {"anyOf": [{"type": "string"}, _obj({
        "name": {"type": "string"}, "source": {"type": "string"}, "store": {"type": "string"},
        "persistent": {"type": "boolean"}, "mode": {"enum": ["MOUNT", "COPY", "MOUNT_CACHED"]}})]}},
    "setup": {"type": "string"}, "run": {"type": "string"},
})


def _run_shell(script: str, **env: str) -> tuple[list[str], object, object]:
    out = subprocess.run(["/bin/sh", "-c", script], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    args, rank, world = json.loads(out.stdout)
    return args, rank, world


def test_the_pytorchjob_is_valid_and_its_command_runs_this_pods_launcher():
    job = yaml.safe_load(emit("kubernetes", job_spec(FIT, exe=PRINT_ARGV, job_name="toy-run")))
    jsonschema.validate(job, PYTORCH_JOB)
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 1)
    for replica in replicas.values():
        assert replica["restartPolicy"] == "OnFailure"  # 75 is a failure that restarts the pod
        pod = replica["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == 120
        (container,) = pod["containers"]
        assert container["name"] == "pytorch"  # the operator finds the training container by this name
        assert container["resources"]["limits"] == {"nvidia.com/gpu": 4}
        assert {"name": "runs", "mountPath": "/mnt/runs"} in container["volumeMounts"]

    # The worker pod: the operator sets RANK to the pod's index and MASTER_* to the master pod.
    args, rank, world = _run_shell(container["command"][2], RANK="1", WORLD_SIZE="2", MASTER_ADDR="toy-run-master-0",
                                   MASTER_PORT="23456")
    assert (rank, world) == (None, None)  # the launcher of this pod, not a worker of a job of pods
    cfg = parse_config(args[1], args[2:]).validate()
    assert (cfg.launch.nnodes, cfg.launch.node_rank, cfg.launch.nproc_per_node) == (2, 1, 4)
    assert cfg.launch.rdzv_endpoint == "toy-run-master-0:23456"
    assert (cfg.trainer.output_dir, cfg.trainer.run_name, cfg.checkpoint.resume) == ("/mnt/runs", "toy-run", "auto")
    assert (cfg.trainer.max_steps, cfg.checkpoint.every_steps) == (50, 10)
    assert args.count("--launch.rdzv_endpoint") == 1 and "--launch.rdzv_endpoint=h:1" not in args  # the template's


def test_the_skypilot_task_is_valid_and_its_run_script_starts_this_nodes_launcher():
    task = yaml.safe_load(emit("skypilot", job_spec(FIT, exe=PRINT_ARGV, job_name="toy-run", accelerator="A100")))
    jsonschema.validate(task, SKYPILOT_TASK)
    assert task["num_nodes"] == 2 and task["resources"]["accelerators"] == "A100:4"
    assert task["resources"]["job_recovery"]["max_restarts_on_errors"] >= 1
    assert task["file_mounts"]["/mnt/runs"]["mode"] == "MOUNT_CACHED"

    args, _, _ = _run_shell(task["run"], SKYPILOT_NODE_RANK="1", SKYPILOT_NODE_IPS="10.0.0.5\n10.0.0.6",
                            SKYPILOT_NUM_NODES="2")
    cfg = parse_config(args[1], args[2:]).validate()
    assert (cfg.launch.nnodes, cfg.launch.node_rank, cfg.launch.rdzv_endpoint) == (2, 1, "10.0.0.5:29500")
    assert (cfg.trainer.output_dir, cfg.trainer.run_name, cfg.checkpoint.resume) == ("/mnt/runs", "toy-run", "auto")


def test_a_cpu_command_asks_for_no_gpus_and_one_node_needs_no_rendezvous_flags():
    fit = ["fit", "toy", "--trainer.device", "cpu", "--launch.nproc_per_node", "2", "--trainer.max_steps", "5"]
    job = yaml.safe_load(emit("kubernetes", job_spec(fit)))
    jsonschema.validate(job, PYTORCH_JOB)
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert "resources" not in container and "Worker" not in job["spec"]["pytorchReplicaSpecs"]
    assert "--launch.node_rank" not in container["command"][2]
    task = yaml.safe_load(emit("skypilot", job_spec(fit)))
    jsonschema.validate(task, SKYPILOT_TASK)
    assert "accelerators" not in task["resources"]
    script = emit("slurm", job_spec(fit))
    assert "#SBATCH --ntasks-per-node=2" in script and "--gpus-per-node" not in script
    assert "#SBATCH --signal=USR1@120" in script and "#SBATCH --requeue" in script
    assert 'if [ "$status" -eq 75 ]; then' in script


def test_launch_needs_a_fit_command():
    with pytest.raises(UserError, match="give the command to run after --"):
        job_spec(["toy"])


def test_a_job_file_leaves_restarts_to_the_scheduler():
    with pytest.raises(UserError, match=r"^--launch.max_restarts restarts the workers of zerotrain's own launcher"):
        job_spec(["fit", "toy", "--trainer.max_steps", "4", "--launch.max_restarts", "2"])


def test_a_run_name_reaches_the_node_as_it_was_given_and_a_control_character_is_refused():
    """The job file is shell: a run name with ``$( )`` or a quote must reach zerotrain as written (not expanded on
    the node), and a newline in any value would start a shell line of its own (in a comment or an #SBATCH line)."""
    fit = ["fit", "toy", "--trainer.max_steps", "5", "--trainer.device", "cpu", "--trainer.run_name", 'a$(id)b"c']
    task = yaml.safe_load(emit("skypilot", job_spec(fit, exe=PRINT_ARGV)))
    args, _, _ = _run_shell(task["run"], SKYPILOT_NODE_RANK="0", SKYPILOT_NODE_IPS="10.0.0.5", SKYPILOT_NUM_NODES="1")
    assert parse_config(args[1], args[2:]).validate().trainer.run_name == 'a$(id)b"c'
    for settings, flag in (({"job_name": "a\nb"}, "--job_name"), ({"shared_dir": "/runs\nid"}, "--shared_dir"),
                           ({}, "the command after --")):
        argv = fit[:-2] + (["--logging.wandb_project", "x\nid"] if not settings else [])
        with pytest.raises(UserError, match=rf"^{flag} .* holds the control character '\\n'"):
            job_spec(argv, **settings)
    with pytest.raises(UserError, match=r"^--job_name 'My_Job' is no name every scheduler takes"):
        job_spec(fit[:-2], job_name="My_Job")
