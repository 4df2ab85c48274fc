"""TorchRL's own GRPO scripts (``sota-implementations/grpo/grpo-{sync,async}.py``) on vLLM
replicas.

Copies the scripts from a pytorch/rl checkout into a scratch folder, changes the lines below
(each must match as often as said, or the run stops and names it), runs ``grpo-MODE.py`` on
the package's tiny model with its Countdown config for ``--steps`` GRPO steps, and runs
``examples/grpo_countdown.py`` with the same batch beside it, alternating which goes first.

The changes, by kind (``changes.diff`` in ``--out`` holds them as a diff):

* ``engine``: ``AsyncVLLM.from_pretrained`` -> ``VLLMService.from_pretrained`` (and its
  import), TorchRL's ``VLLMWeightSyncScheme`` -> ``ServiceSyncScheme`` (its NCCL transfer
  is vLLM's native one, which these replicas refuse): the two lines a GPU user changes;
* ``cpu`` (only where torch sees no GPU): the script requires CUDA and puts the trainer on
  ``cuda:0`` in six places, which no config override reaches;
* ``torchrl``: TorchRL 0.14.1's ``RayReplayBuffer`` does not pickle
  (``ReplayBuffer.__getstate__`` takes locks it never made), so ``RayLLMCollector`` fails
  before the first step on any engine; the script pickles the buffer's fields instead.

TorchRL 0.14.1's ``RayLLMCollector`` also never stops (its remote ``next()`` returns None
at the end where the iterator waits for StopIteration), so this runner interrupts the
script (SIGINT: its ``finally`` shuts Ray down) once ``--steps`` steps have ended; so does
async mode, whose collectors stop at the trainer's budget and collect faster than it trains
here (given a large budget instead). A step ends with TorchRL's ``timeit`` print after its
weight push (async: a push after every optimizer step); step time is the median gap between
step ends, the first step excluded.

    python benchmarks/bench_torchrl_grpo.py --rl-repo PATH [--mode sync|async] [--steps 5]
        [--rounds 2] [--out bench_torchrl_grpo]

``PATH`` is a pytorch/rl checkout or its bare git directory. Needs ``hydra-core``,
``wandb`` and ``datasets`` (the script's imports; wandb runs disabled).
"""

from __future__ import annotations

import argparse
import difflib
import itertools
import json
import logging
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

logger = logging.getLogger("bench_torchrl_grpo")
REPO = Path(__file__).resolve().parents[1]
SCRIPT_DIR = "sota-implementations/grpo"
SCRIPT = "<script>"  # an edit of grpo-sync.py or grpo-async.py, whichever runs


@dataclass(frozen=True)
class Edit:
    kind: str  # engine | cpu | torchrl
    file: str
    old: str
    new: str
    count: int = 1  # how many times ``old`` is in the file


RB_SHIM = """

# TorchRL 0.14.1: a RayReplayBuffer does not pickle (ReplayBuffer.__getstate__ needs locks it
# never made), so RayLLMCollector(replay_buffer=rb) fails on any engine. Pickle its fields.
def _rebuild_ray_rb(state):
    _patch_ray_rb()
    rb = RayReplayBuffer.__new__(RayReplayBuffer)
    rb.__dict__.update(state)
    return rb


def _patch_ray_rb():
    RayReplayBuffer.__reduce__ = lambda self: (_rebuild_ray_rb, (dict(self.__dict__),))


_patch_ray_rb()
"""
GRPO_LOSS_IMPORT = "from torchrl.objectives.llm.grpo import GRPOLoss, MCAdvantage\n"
TORCHRL_SCHEME = """    return VLLMWeightSyncScheme(
        master_address=master_address,
        master_port=master_port,
        gpus_per_replica=tp_size,
        num_replicas=num_replicas,
        strategy="state_dict",
    )
"""

EDITS = [
    Edit(
        "engine",
        "grpo_utils.py",
        "    from torchrl.modules.llm.backends.vllm import AsyncVLLM\n",
        "    from torchrl_vllm_ext import VLLMService\n",
    ),
    Edit(
        "engine",
        "grpo_utils.py",
        "inference_server = AsyncVLLM.from_pretrained(**inference_params)",
        "inference_server = VLLMService.from_pretrained(**inference_params)",
    ),
    Edit(
        "engine",
        "grpo_utils.py",
        TORCHRL_SCHEME,
        "    from torchrl_vllm_ext import ServiceSyncScheme\n\n"
        "    return ServiceSyncScheme(vllm_engine)\n",
    ),
    Edit(
        "cpu",
        SCRIPT,
        "    if not torch.cuda.is_available():\n"
        '        raise RuntimeError("CUDA is required for training")\n',
        "",
    ),
    Edit(
        "cpu",
        SCRIPT,
        'torch.set_default_device("cuda:0")',
        'torch.set_default_device("cpu")',
    ),
    Edit(
        "cpu",
        SCRIPT,
        'train_device = torch.device(f"cuda:{devices[0]}" if devices else "cuda:0")',
        'train_device = torch.device("cpu")',
    ),
    Edit(
        "cpu",
        "grpo_utils.py",
        'device_map = "balanced" if len(train_devices) > 1 else f"cuda:{train_devices[0]}"',
        'device_map = "cpu"',
    ),
    # the trainer's, the reference model's and the KL transform's device
    Edit(
        "cpu", "grpo_utils.py", 'device=torch.device("cuda:0"),', 'device=torch.device("cpu"),', 3
    ),
    Edit("torchrl", SCRIPT, GRPO_LOSS_IMPORT, GRPO_LOSS_IMPORT + RB_SHIM),
]

# One GRPO step of grpo_countdown.py's default size: 2 problems x 4 samples, 24 tokens.
PROMPTS, GROUP, MAX_TOKENS = 2, 4, 24


def config_overrides(model: Path, steps: int, mode: str) -> list[str]:
    """Hydra overrides: the tiny model, a small batch, fp32, a few logical CPUs for Ray;
    in async mode a push after every optimizer step (one collector per prompt, 2 CPUs each
    in the script)."""
    batch = PROMPTS * GROUP
    per_mode = {
        "sync": ["ray.init_config.num_cpus=6"],
        # async: the collectors stop at the trainer's own budget, and collect faster than
        # it trains here, so the trainer would find them stopped: a large budget, and the
        # runner stops the script after its steps
        "async": [
            "train.weight_update_frequency=1",
            "ray.init_config.num_cpus=8",
            f"train.total_dialog_turns={batch * 1000}",
        ],
    }
    per_mode["sync"].append(f"train.total_dialog_turns={batch * steps}")
    return [
        f"mode={mode}",
        *per_mode[mode],
        f"model.name={model}",
        f"env.num_envs={PROMPTS}",
        f"env.repeats={GROUP}",
        f"train.dialog_turns_per_batch={batch}",
        f"train.optim_batch_size={batch}",
        "train.gradient_accumulation_steps=1",
        "train.mixed_precision=false",
        "train.logging_frequency=1",
        "train_model.torch_dtype=float32",
        "inference_model.torch_dtype=float32",
        f"inference_model.max_tokens={MAX_TOKENS}",
        "+inference_model.max_model_len=512",  # Countdown's prompt is ~370 tokens here
        # (Ray pre-starts one worker per CPU it is told of: a few, not the config's 96)
        "ray.collector_config.num_cpus=1",
        "ray.replay_buffer_config.num_cpus=1",
        "ray.train_handler_config.num_cpus=1",
    ]


def copy_scripts(rl_repo: Path, dest: Path) -> Path:
    """TorchRL's GRPO folder from a checkout or a bare git directory, into ``dest``."""
    src = rl_repo / SCRIPT_DIR
    if src.is_dir():
        shutil.copytree(src, dest / "grpo")
    elif (rl_repo / "HEAD").is_file() and (rl_repo / "objects").is_dir():
        archive = subprocess.run(
            ["git", "--git-dir", str(rl_repo), "archive", "HEAD", SCRIPT_DIR],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "x", "-C", str(dest)], input=archive, check=True)
        shutil.move(str(dest / SCRIPT_DIR), dest / "grpo")
    else:
        raise SystemExit(f"--rl-repo {rl_repo}: neither a pytorch/rl checkout nor its git dir")
    return dest / "grpo"


def apply_edits(folder: Path, kinds: set[str], script: str) -> str:
    """Apply the edits of ``kinds`` to ``script`` and grpo_utils.py; the unified diff."""
    edits = [e if e.file != SCRIPT else replace(e, file=script) for e in EDITS]
    before = {f: (folder / f).read_text() for f in {e.file for e in edits}}
    after = dict(before)
    for e in edits:
        if e.kind not in kinds:
            continue
        count = after[e.file].count(e.old)
        if count != e.count:
            raise SystemExit(
                f"{e.file}: expected the {e.kind} line {e.old.strip()!r} {e.count}x, found {count}: "
                "TorchRL's script changed; update EDITS in this file"
            )
        after[e.file] = after[e.file].replace(e.old, e.new)
    diff = []
    for f in sorted(before):
        (folder / f).write_text(after[f])
        diff += difflib.unified_diff(
            before[f].splitlines(True), after[f].splitlines(True), f"a/{f}", f"b/{f}"
        )
    return "".join(diff)


STEP_END = re.compile(
    r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[torchrl\]\[INFO\]\S*\s+timeit -- "
    r"(.+?) took ([\d.]+) msec"
)


def parse_steps(log: str) -> list[dict]:
    """Each step's timeit print (TorchRL's): end time and the parts in seconds."""
    steps: list[dict] = []
    part: dict = {}
    for stamp, name, msec in STEP_END.findall(log):
        part[name] = float(msec) / 1e3
        if name == "update_policy_weights":  # the last line of a step's print
            t = time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S"))
            steps.append({"end": t + int(stamp[20:]) / 1e3, **part})
            part = {}
    return steps


def run_torchrl_script(folder: Path, model: Path, steps: int, mode: str, log_path: Path):
    env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="1")
    cmd = [sys.executable, f"grpo-{mode}.py", "--config-name", "grpo_countdown"]
    shm_before = set(os.listdir("/dev/shm"))
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd + config_overrides(model, steps, mode),
            cwd=folder,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        done: list[dict] = []
        while proc.poll() is None and len(done) < steps and time.time() - t0 < 900:
            time.sleep(0.5)
            done = parse_steps(log_path.read_text(errors="replace"))
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # sync never stops; async runs long
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    done = parse_steps(log_path.read_text(errors="replace"))
    if len(done) < steps:
        raise SystemExit(f"grpo-{mode}.py ended after {len(done)} of {steps} steps: {log_path}")
    gaps = [b["end"] - a["end"] for a, b in itertools.pairwise(done)]
    time.sleep(2)  # Ray's processes finish exiting
    return {
        "steps": len(done),
        # what the run left in /dev/shm: ours (torchrl-vllm-*) must be nothing; TorchRL's
        # actors, killed by ray.shutdown(), leave their tqdm locks' semaphores (sem.mp-*)
        "left_in_dev_shm": sorted(set(os.listdir("/dev/shm")) - shm_before),
        "first_step_end_s": done[0]["end"] - t0,
        "median_step_s": statistics.median(gaps),
        "median_push_s": statistics.median(s["update_policy_weights"] for s in done[1:]),
        "median_train_s": statistics.median(
            s.get("forward_pass", 0) + s.get("backward_pass", 0) + s.get("optim_step", 0)
            for s in done[1:]
        ),
        "per_step": done,
    }


def run_example(model: Path, steps: int, out: Path) -> dict:
    cmd = [
        sys.executable,
        str(REPO / "examples" / "grpo_countdown.py"),
        "--steps",
        str(steps),
        "--replicas",
        "1",
        "--prompts",
        str(PROMPTS),
        "--group-size",
        str(GROUP),
        "--max-tokens",
        str(MAX_TOKENS),
        "--model",
        str(model),
        "--output",
        str(out),
        "--no-progress",
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    s = json.loads((out / "metrics.json").read_text())["summary"]
    return {k: s[k] for k in ("steps", "median_step_s", "median_sync_s", "median_train_s")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rl-repo", type=Path, required=True, help="pytorch/rl checkout or git dir")
    p.add_argument("--mode", choices=["sync", "async"], default="sync", help="grpo-MODE.py")
    p.add_argument("--steps", type=int, default=5, help="GRPO steps per run (>= 3)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each, order alternating")
    p.add_argument("--out", type=Path, default=Path("bench_torchrl_grpo"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import torch

    from torchrl_vllm_ext.testing import make_tiny_model

    args.out.mkdir(parents=True, exist_ok=True)
    kinds = {"engine", "torchrl"} | (set() if torch.cuda.is_available() else {"cpu"})
    with tempfile.TemporaryDirectory(prefix="torchrl-grpo-") as scratch:
        folder = copy_scripts(args.rl_repo.resolve(), Path(scratch))
        diff = apply_edits(folder, kinds, f"grpo-{args.mode}.py")
        (args.out / "changes.diff").write_text(diff)
        model = make_tiny_model(Path(scratch) / "tiny")
        rounds = []
        for r in range(args.rounds):
            order = ["torchrl", "example"] if r % 2 == 0 else ["example", "torchrl"]
            row = {}
            for which in order:
                logger.info("round %d: %s", r, which)
                if which == "torchrl":
                    log = args.out / f"grpo-{args.mode}-round{r}.log"
                    row[which] = run_torchrl_script(folder, model, args.steps, args.mode, log)
                else:
                    row[which] = run_example(model, args.steps, Path(scratch) / f"ex{r}")
            rounds.append(row)
            t, e = row["torchrl"], row["example"]
            print(
                f"round {r}: grpo-{args.mode}.py {1 / t['median_step_s']:.2f} steps/s "
                f"(median step {t['median_step_s']:.2f} s, push {t['median_push_s']:.2f} s) | "
                f"grpo_countdown.py {1 / e['median_step_s']:.2f} steps/s (median step "
                f"{e['median_step_s']:.2f} s, push {e['median_sync_s']:.2f} s)"
            )
    config = {**vars(args), "rl_repo": str(args.rl_repo), "out": str(args.out)}
    result = {"changed_kinds": sorted(kinds), "config": config, "rounds": rounds}
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    brief = [{k: {m: v[m] for m in v if m != "per_step"} for k, v in r.items()} for r in rounds]
    print(json.dumps({"changed_kinds": sorted(kinds), "rounds": brief}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
