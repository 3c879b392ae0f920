"""Side-by-side speed benchmark: lmppo vs TRL's PPOTrainer on identical inputs (CPU).

Both trainers get the same tokenizer, policy, critic, reward model and prompts (built once by
``benchmarks/shared/common.py`` into ``benchmarks/.cache``), the same PPO settings and the same seed.  Every
run happens in its own subprocess -- TRL under the TRL virtual environment's interpreter
(``--trl-python``), lmppo under ``--lmppo-python`` -- alternating trl, lmppo, trl, lmppo, ... for
``--repeats`` rounds (default: 6 short rounds of 40 episodes, 5 iterations of 8).  Afterwards the saved
policies of the first ``--eval-rounds`` rounds are scored by one shared evaluation subprocess
(``common.evaluate_policy``: 2 samples per held-out prompt at temperature 1.0, reward read at the
last real token), so the scores are comparable.

The figures to quote (the "per-iteration figures" block printed last): every iteration's wall and CPU time,
split into rollout / reward / update / other for both trainers (TRL's phases by wrapping the functions its loop
calls, lmppo's from its own timers), the first iteration of each run dropped as warm-up; the figure is the p10
of the iteration times over all rounds, with the spread (p50/p10, max/min) and the lmppo/TRL ratio of every round.
A shared machine slows some iterations, never speeds one up, so a low percentile is the stable figure; a WARNING
line says when a spread is too wide to trust a figure to 10%.  The same run probes the machine at its start and
end: torch's CPU capability, native bf16 (AVX-512 BF16, AMX), fp32 and bf16 matmul rates and the load average.

What is measured, per run:
  * eps        episodes / wall time of the trainer's ``train()`` call (model loading, tokenizer and
               dataset set-up, trainer construction and the final save are excluded; TRL does not
               compile anything, so nothing else needs excluding).  ``eps_steady`` also drops the first
               PPO update (time from the end of update 1 to the end of the last update).
  * peak RSS   ``ru_maxrss`` of the worker subprocess (whole process: imports, 4 models, training),
               read by the parent with ``os.wait4`` -- so it cannot be lowered by anything in the worker.
  * score      mean reward of the trained policy on the held-out prompts (and of the untrained one).

Usage::

    python benchmarks/speed/compare_trl.py [--configs base,len64,epoch1,shared] [--episodes 40] [--repeats 6]
        [--trl-python /tmp/trlvenv/bin/python] [--lmppo-python .venv/bin/python] [--sides trl,lmppo]
        [--real] [--profile] [--eval-rounds 1] [--no-eval]

The driver itself needs only the standard library.  Worker modes (used by the driver)::

    python benchmarks/speed/compare_trl.py --worker trl|lmppo --cfg run.json --result out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # benchmarks/shared: bench_path
import bench_path  # noqa: E402  (every benchmark folder on the path)
import common  # noqa: E402  (stdlib-only at import time)

HERE = bench_path.BENCHMARKS

# ----------------------------------------------------------------------------------------------
# Configurations.  Each is a set of overrides on common.BASE_SETTINGS.
# ----------------------------------------------------------------------------------------------
CONFIGS: dict[str, dict] = {
    "base": {},  # (a) batch 8, 32-token responses, 4 PPO epochs, fp32, 1 thread
    "len64": {"response_length": 64},  # (b)
    "epoch1": {"ppo_epochs": 1},  # (c)
    "shared": {"shared_value_head": True},  # (d) lmppo with a value head on the policy; TRL side == base
    "bf16": {"precision": "bf16"},  # lmppo with bf16 autocast; TRL side == base (fp32)
    "shared_bf16": {"shared_value_head": True, "precision": "bf16"},
    "real": {  # (e) opt-in --real: SmolLM2-135M, full weights
        "response_length": 24,
        "threads": 2,
        "learning_rate": 3e-6,
        "kind": "real",
        "eval_prompts": 32,
    },
}
# settings that only the lmppo side reads: a TRL run of a config that differs from another config
# only in these is the same run, and is reused instead of repeated.
LMPPO_ONLY_KEYS = {"shared_value_head", "precision"}
DEFAULT_EPISODES = {"tiny": 40, "real": 32}


# ================================================================================================
# TRL side (runs under the TRL venv's interpreter)
# ================================================================================================


def _set_threads(n: int):
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:
        pass


def run_trl(cfg: dict) -> dict:
    """Train TRL's PPOTrainer (``trl.experimental.ppo`` in TRL 1.12) with ``cfg``; save the policy.

    cfg keys: see ``make_run_cfg``.  Returns a dict with timings, TRL's own logged metrics and versions."""
    t_start = time.perf_counter()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    _set_threads(cfg["threads"])
    import accelerate
    import torch
    import transformers
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

    import trl

    try:
        from trl.experimental.ppo import PPOTrainer
    except ImportError:  # older TRL
        from trl import PPOTrainer

    transformers.set_seed(cfg["seed"])
    cache = Path(cfg["cache"])
    out = Path(cfg["out_dir"])
    dtype = getattr(torch, cfg["dtype"])
    tok = AutoTokenizer.from_pretrained(cache / "tokenizer")
    tok.padding_side = "left"
    policy = AutoModelForCausalLM.from_pretrained(cache / "policy", dtype=dtype)
    ref = AutoModelForCausalLM.from_pretrained(cache / "policy", dtype=dtype)
    critic = AutoModelForSequenceClassification.from_pretrained(cache / "critic", dtype=dtype)
    reward = AutoModelForSequenceClassification.from_pretrained(cache / "reward", dtype=dtype)
    prompts = common.load_prompts(cache)
    train_ds = Dataset.from_dict({"input_ids": prompts["train"]})
    eval_ds = Dataset.from_dict({"input_ids": prompts["eval"][: cfg["batch_size"]]})

    args = trl_args(cfg, out / "trl_output")

    phases = _TRLPhases(reward)

    class Recorder(TrainerCallback):
        def __init__(self):
            self.step_end, self.logs = [], []

        def on_train_begin(self, args, state, control, **kw):
            phases.begin()

        def on_step_end(self, args, state, control, **kw):
            self.step_end.append(time.perf_counter())
            phases.end_iteration()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs:
                self.logs.append({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    class StopAfter(Exception):
        """cfg["stop_after"]: training ends after that many updates."""

    class SavePolicy(TrainerCallback):
        """cfg["save_policy_every"]: the policy every N updates, as out/policy-iter-N (a KL/reward trajectory)."""

        trainer = None

        def on_step_end(self, args, state, control, **kw):
            every = cfg.get("save_policy_every")
            if every and state.global_step % every == 0 and self.trainer is not None:
                folder = out / f"policy-iter-{state.global_step:03d}"
                self.trainer.accelerator.unwrap_model(self.trainer.model).policy.save_pretrained(folder)
                tok.save_pretrained(folder)
            if cfg.get("stop_after") and state.global_step >= cfg["stop_after"]:
                raise StopAfter  # the learning-rate schedule stays that of the whole run: its first updates, finer

    rec, saver = Recorder(), SavePolicy()
    limits = _matmul_limits(cfg["threads"])
    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        train_dataset=train_ds,
        value_model=critic,
        eval_dataset=eval_ds,
        callbacks=[rec, saver],
    )
    saver.trainer = trainer
    setup_s = time.perf_counter() - t_start

    prof = None
    if cfg.get("profile"):
        import cProfile

        prof = cProfile.Profile()
    t0, c0 = time.perf_counter(), time.process_time()
    if prof:
        prof.enable()
    with phases.installed():
        try:
            trainer.train()
        except StopAfter:
            pass
    if prof:
        prof.disable()
    t1, c1 = time.perf_counter(), time.process_time()
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    episodes = trainer.state.episode
    steady = None
    if len(rec.step_end) >= 2:
        steady = (episodes - args.batch_size) / (rec.step_end[-1] - rec.step_end[0])
    pol = trainer.accelerator.unwrap_model(trainer.model).policy
    pol.save_pretrained(out / "policy")
    tok.save_pretrained(out / "policy")
    res = dict(
        side="trl",
        episodes=episodes,
        updates=len(rec.step_end),
        train_seconds=t1 - t0,
        eps=episodes / (t1 - t0),
        eps_steady=steady,
        train_cpu_seconds=c1 - c0,
        eps_cpu=episodes / (c1 - c0) * cfg["threads"],
        cpu_util=(c1 - c0) / (t1 - t0),
        setup_seconds=setup_s,
        worker_maxrss_mb=rss_kb / 1024,
        train_scores_first=[l.get("objective/scores") for l in rec.logs[:3]],
        train_scores_last=[l.get("objective/scores") for l in rec.logs[-3:]],
        train_kl_last=rec.logs[-1].get("objective/kl") if rec.logs else None,
        optimizer=type(
            trainer.updater.optimizer.optimizer
            if hasattr(trainer.updater.optimizer, "optimizer")
            else trainer.updater.optimizer
        ).__name__,
        optim=str(args.optim),
        torch_threads=torch.get_num_threads(),
        **limits,
        iterations=phases.iterations,
        versions=dict(
            trl=trl.__version__,
            transformers=transformers.__version__,
            accelerate=accelerate.__version__,
            torch=torch.__version__,
            python=sys.version.split()[0],
        ),
    )
    if prof:
        res["profile"] = _summarize_profile(prof, out / "trl_profile.txt", t1 - t0)
    return res


class _TRLPhases:
    """Per-iteration wall and CPU time of TRL's PPOTrainer.train(), split into the phases lmppo logs.

    TRL's loop calls its module's functions by global name, so wrapping them there times them: rollout =
    ``batch_generation`` + the reference ``forward`` (no grad) + the value model's ``get_reward``; reward = the
    reward model's ``get_reward``; update = from the first forward with gradients to the end of the step; other =
    the rest of the iteration (KL, advantages, bookkeeping)."""

    def __init__(self, reward_model):
        self.reward_model = reward_model
        self.iterations: list[dict] = []
        self._reset()

    def _reset(self):
        self.current = {"rollout": 0.0, "reward": 0.0}
        self.update_started = None

    def begin(self):
        self.last_wall, self.last_cpu = time.perf_counter(), time.process_time()
        self._reset()

    def end_iteration(self):
        wall, cpu = time.perf_counter(), time.process_time()
        it = dict(wall=wall - self.last_wall, cpu=cpu - self.last_cpu, **self.current)
        it["update"] = wall - self.update_started if self.update_started else 0.0
        it["other"] = it["wall"] - it["rollout"] - it["reward"] - it["update"]
        self.iterations.append(it)
        self.last_wall, self.last_cpu = wall, cpu
        self._reset()

    def _timed(self, fn, phase_of):
        def wrapper(*args, **kwargs):
            phase = phase_of(*args)
            if phase == "update":
                if self.update_started is None:
                    self.update_started = time.perf_counter()
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if phase:
                    self.current[phase] += time.perf_counter() - start

        return wrapper

    @contextlib.contextmanager
    def installed(self):
        import torch
        from trl.experimental.ppo import ppo_trainer as pt

        originals = {name: getattr(pt, name) for name in ("batch_generation", "forward", "get_reward")}
        pt.batch_generation = self._timed(originals["batch_generation"], lambda *a: "rollout")
        pt.forward = self._timed(originals["forward"], lambda *a: "update" if torch.is_grad_enabled() else "rollout")
        pt.get_reward = self._timed(
            originals["get_reward"], lambda model, *a: "reward" if model is self.reward_model else "rollout"
        )
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(pt, name, fn)


def lmppo_config(cfg: dict, output_dir: Path):
    """lmppo's Config for the run settings ``cfg`` (see ``make_run_cfg``): the same work as ``trl_args`` asks of TRL."""
    from lmppo.config import Config, RewardSourceConfig

    cache = Path(cfg["cache"])
    c = Config()
    c.output_dir = str(output_dir)
    c.overwrite = True
    c.seed = cfg["seed"]
    c.device = "cpu"
    c.total_episodes = cfg["episodes"]
    c.precision = cfg.get("precision", "fp32")
    c.data.max_prompt_length = 64
    c.data.shuffle = True
    c.rollout.batch_size = cfg["batch_size"]
    c.rollout.max_new_tokens = cfg["response_length"]
    c.rollout.temperature = cfg["temperature"]
    c.rollout.stop_token = cfg["stop_token"] or "none"
    # the reward model shares the policy's tokenizer and reads the sampled ids, as TRL's does (not decoded text:
    # re-encoding a decoded sample often gives other ids, and this reward model scores particular tokens)
    c.reward.sources = [RewardSourceConfig(kind="model", path=str(cache / "reward"), name="rm", input="tokens")]
    c.reward.truncation = "none" if cfg["missing_eos_penalty"] is None else "penalty"
    if cfg["missing_eos_penalty"] is not None:
        c.reward.penalty, c.reward.penalty_mode = -float(cfg["missing_eos_penalty"]), "add"
    c.kl.coef, c.kl.controller, c.kl.estimator, c.kl.placement = cfg["kl_coef"], "fixed", "k1", "reward"
    c.value.mode = "shared" if cfg.get("shared_value_head") else "critic"
    c.value.init_from = str(cache / "critic")
    p = c.ppo
    p.num_epochs, p.num_minibatches = cfg["ppo_epochs"], cfg["num_mini_batches"]
    p.micro_batch_size = cfg["batch_size"] // cfg["num_mini_batches"]
    p.learning_rate, p.lr_schedule = cfg["learning_rate"], cfg["lr_schedule"]
    p.clip_range, p.value_clip_range, p.vf_coef = cfg["cliprange"], cfg["cliprange_value"], cfg["vf_coef"]
    p.gamma, p.lam, p.adam_eps, p.max_grad_norm = cfg["gamma"], cfg["lam"], 1e-8, 0.0
    c.log.trackers, c.log.sample_every, c.log.progress = [], 0, False
    return c


def trl_args(cfg: dict, output_dir: Path, config_cls=None, **extra):
    """TRL's PPOConfig for the run settings ``cfg`` (see ``make_run_cfg``); ``config_cls``: another class with TRL's
    fields (``lmppo.trl.PPOConfig``, the drop-in); ``extra``: further fields."""
    if config_cls is not None:
        PPOConfig = config_cls
    else:
        try:
            from trl.experimental.ppo import PPOConfig
        except ImportError:  # older TRL
            from trl import PPOConfig

    return PPOConfig(
        **extra,
        **dict(
            output_dir=str(output_dir),
            per_device_train_batch_size=cfg["batch_size"],
            gradient_accumulation_steps=1,
            num_mini_batches=cfg["num_mini_batches"],
            num_ppo_epochs=cfg["ppo_epochs"],
            response_length=cfg["response_length"],
            total_episodes=cfg["episodes"],
            local_rollout_forward_batch_size=cfg["batch_size"],
            stop_token=cfg["stop_token"],
            missing_eos_penalty=cfg["missing_eos_penalty"],
            temperature=cfg["temperature"],
            kl_coef=cfg["kl_coef"],
            cliprange=cfg["cliprange"],
            cliprange_value=cfg["cliprange_value"],
            vf_coef=cfg["vf_coef"],
            gamma=cfg["gamma"],
            lam=cfg["lam"],
            learning_rate=cfg["learning_rate"],
            lr_scheduler_type=cfg["lr_schedule"],
            num_sample_generations=0,
            report_to="none",
            bf16=False,
            fp16=False,
            use_cpu=True,
            gradient_checkpointing=False,  # TRL's PPOTrainer never enables it anyway (it bypasses Trainer.__init__)
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            seed=cfg["seed"],
            per_device_eval_batch_size=cfg["batch_size"],
            dataloader_num_workers=0,
        ),
    )


def _time_saves(trainer) -> list:
    """Count the CPU time of the trainer's checkpoint and final-model saves (into the returned one-item list), so
    that eps_cpu leaves them out as eps does: TRL's train() saves nothing, its final save comes after."""
    spent = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.process_time() - start

        return wrapper

    trainer.save_checkpoint, trainer.save_model = timed(trainer.save_checkpoint), timed(trainer.save_model)
    return spent


def _matmul_limits(threads: int) -> dict:
    """The machine's matmul throughput in this process (fp32 and bf16), for the FLOP-utilisation figure."""
    import flops

    return {
        "matmul_gflops_float32": flops.matmul_gflops("float32", threads, seconds=0.3),
        "matmul_gflops_bfloat16": flops.matmul_gflops("bfloat16", threads, seconds=0.3),
    }


def probe_machine(threads: int) -> dict:
    """What the figures of this run were measured on: torch's CPU capability, native bf16 (AVX-512 BF16 / AMX),
    the CPU's name, and matmul throughput in fp32 and bf16 (a short probe at the benchmark's thread count)."""
    import platform

    import torch

    name = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = dict(
        cpu=name,
        cpus=os.cpu_count(),
        torch=torch.__version__,
        capability=torch.backends.cpu.get_cpu_capability(),
        avx512_bf16=bool(torch.cpu._is_avx512_bf16_supported()),
        amx_tile=bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()),
        threads=threads,
        loadavg=os.getloadavg(),
    )
    info.update(_matmul_limits(threads))
    return info


def _summarize_profile(prof, path: Path, total: float) -> dict:
    """Write cProfile stats to ``path`` and return seconds (cumulative) for the phases of a PPO update."""
    import io
    import pstats

    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("cumulative").print_stats(60)
    st.sort_stats("tottime").print_stats(40)
    path.write_text(s.getvalue())
    # phases: cumulative time of the functions that make up a PPO update (each counted once)
    from trl.experimental import utils as tu
    from trl.experimental.ppo import ppo_trainer as pt

    code_of = lambda f: (f.__code__.co_filename, f.__code__.co_firstlineno, f.__code__.co_name)
    ct = {k: v[3] for k, v in st.stats.items()}
    by_name = lambda name: sum(v for (f, _l, fn), v in ct.items() if fn == name)
    train_fwd = ct.get(code_of(pt.PolicyAndValueWrapper.forward), 0.0)
    all_fwd = ct.get(code_of(pt.forward), 0.0)  # ref-policy forward (rollout) + the train forward
    phases = {
        "rollout: generate (HF generate, 8 x response_length tokens)": ct.get(code_of(pt.batch_generation), 0.0),
        "rollout: ref policy forward": all_fwd - train_fwd,
        "rollout: critic + reward forward (get_reward)": ct.get(code_of(tu.get_reward), 0.0),
        "train: forward policy + critic": train_fwd,
        "train: backward": sum(v for (f, _l, fn), v in ct.items() if fn == "backward" and "accelerate" in f),
        "train: optimizer.step (AdamW)": sum(
            v for (f, _l, fn), v in ct.items() if fn == "step" and f.endswith(("optim/adam.py", "optim/adamw.py"))
        ),
        "gc.collect (2 per update)": by_name("<built-in method gc.collect>"),
    }
    phases["other"] = total - sum(phases.values())
    return {"train_total": total, **phases}


# ================================================================================================
# lmppo side -- TO BE PLUGGED IN BY THE LEAD
# ================================================================================================


def run_lmppo(cfg: dict) -> dict:
    """Train lmppo with ``cfg`` (the same keys as ``run_trl``), save the policy, return the same kind of dict.

    Like for like with TRL: the same policy, critic (a separate value model initialised from the cached
    critic) and reward model; batch 8, one minibatch, no gradient accumulation; fixed KL coefficient with the
    k1 estimator in the reward; AdamW with eps 1e-8; the same LR schedule; gradient clipping off (TRL 1.12 does not
    apply its max_grad_norm). The reward model reads the sampled token ids (`input: tokens`), as TRL's does. ``eps`` is
    episodes / wall time of the training loop (``trainer.train_seconds``:
    from the first rollout to the end of the last iteration's logging; model loading, trainer set-up, and
    the final save and checkpoint are excluded, as TRL's final save is); ``eps_wall`` also counts those.
    ``eps_cpu`` likewise leaves out the CPU time of checkpoint and model saves.
    """
    t_start = time.perf_counter()
    _set_threads(cfg["threads"])
    import accelerate
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmppo.training.trainer import PPOTrainer

    cache, out = Path(cfg["cache"]), Path(cfg["out_dir"])
    tok = AutoTokenizer.from_pretrained(cache / "tokenizer")
    tok.padding_side = "left"
    policy = AutoModelForCausalLM.from_pretrained(cache / "policy", dtype=getattr(torch, cfg["dtype"]))
    prompts = common.load_prompts(cache)

    c = lmppo_config(cfg, out / "lmppo_run")
    iterations = _LmppoIterations()
    trainer = PPOTrainer(c, policy=policy, tokenizer=tok, prompts=prompts["train"], callbacks=[iterations])
    setup_s = time.perf_counter() - t_start
    limits = _matmul_limits(cfg["threads"])

    save_cpu = _time_saves(trainer)
    prof = None
    if cfg.get("profile"):
        import cProfile

        prof = cProfile.Profile()
    t0, c0 = time.perf_counter(), time.process_time()
    if prof:
        prof.enable()
    history = trainer.train()
    if prof:
        prof.disable()
    t1, c1 = time.perf_counter(), time.process_time()
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trainer.policy.save_pretrained(out / "policy")
    tok.save_pretrained(out / "policy")

    episodes = trainer.episode
    loop_s = trainer.train_seconds
    per_iter = [sum(v for k, v in m.items() if k.startswith("time/")) for m in history]
    steady = (episodes - cfg["batch_size"]) / sum(per_iter[1:]) if len(per_iter) > 1 else None
    phases = {k: sum(m.get(k, 0.0) for m in history) for k in history[-1] if k.startswith("time/")}
    res = dict(
        side="lmppo",
        episodes=episodes,
        updates=len(history),
        train_seconds=loop_s,
        eps=episodes / loop_s,
        eps_wall=episodes / (t1 - t0),
        eps_steady=steady,
        train_cpu_seconds=c1 - c0 - save_cpu[0],
        save_cpu_seconds=save_cpu[0],
        eps_cpu=episodes / (c1 - c0 - save_cpu[0]) * cfg["threads"],
        cpu_util=(c1 - c0) / (t1 - t0),
        setup_seconds=setup_s,
        worker_maxrss_mb=rss_kb / 1024,
        phase_seconds=phases,
        train_scores_first=[m.get("objective/scores") for m in history[:3]],
        train_scores_last=[m.get("objective/scores") for m in history[-3:]],
        train_kl_last=history[-1].get("objective/kl"),
        torch_threads=torch.get_num_threads(),
        **limits,
        iterations=iterations.iterations,
        response_length_mean=sum(m["response/length_mean"] for m in history) / len(history),
        versions=dict(
            transformers=transformers.__version__,
            accelerate=accelerate.__version__,
            torch=torch.__version__,
            python=sys.version.split()[0],
        ),
    )
    if prof:
        import pstats

        prof.dump_stats(str(out / "lmppo_profile.prof"))
        res["profile_top"] = _top_functions(pstats.Stats(prof), 15)
    return res


class _LmppoIterations:
    """A trainer callback: per-iteration wall and CPU time (iteration end to iteration end, logging included, as
    TRL's step ends) and lmppo's own phase timers: rollout, reward (``time/score``), update, other (the rest)."""

    def __init__(self):
        self.iterations: list[dict] = []

    def on_train_begin(self, trainer):
        self.last_wall, self.last_cpu = time.perf_counter(), time.process_time()

    def on_iteration_end(self, trainer, metrics):
        wall, cpu = time.perf_counter(), time.process_time()
        it = dict(
            wall=wall - self.last_wall,
            cpu=cpu - self.last_cpu,
            rollout=metrics.get("time/rollout", 0.0),
            reward=metrics.get("time/score", 0.0),
            update=metrics.get("time/update", 0.0),
            compile=metrics.get("time/compile", 0.0),  # `ppo.compile`: first calls of new shapes, not in update
        )
        it["other"] = it["wall"] - it["rollout"] - it["reward"] - it["update"] - it["compile"]
        self.iterations.append(it)
        self.last_wall, self.last_cpu = wall, cpu


def _top_functions(stats, n: int) -> list[str]:
    stats.sort_stats("tottime")
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [f"{v[2]:8.2f}s  {fn}  ({os.path.basename(f)}:{line})" for (f, line, fn), v in rows]


# ================================================================================================
# Driver (standard library only)
# ================================================================================================


def make_run_cfg(
    name: str, side: str, seed: int, episodes: int, cache: Path, out_dir: Path, profile: bool = False
) -> dict:
    over = dict(CONFIGS[name])
    kind = over.pop("kind", "tiny")
    cfg = dict(common.BASE_SETTINGS)
    cfg.update(over)
    cfg.update(
        config=name,
        side=side,
        kind=kind,
        seed=seed,
        episodes=episodes,
        cache=str(cache),
        out_dir=str(out_dir),
        lr_schedule="constant",
        profile=profile,
    )
    return cfg


def _child_env(threads: int) -> dict:
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[k] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["TRL_EXPERIMENTAL_SILENCE"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    return env


def _spawn(cmd: list[str], log: Path, env: dict, timeout: float) -> tuple[int, float, float]:
    """Run cmd, output to log.  Returns (exit code, wall seconds, child's peak RSS in MB via wait4)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(HERE.parent))
        deadline = time.monotonic() + timeout
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                p.kill()
                pid, status, ru = os.wait4(p.pid, 0)
                break
            time.sleep(0.05)
        p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, time.perf_counter() - t0, ru.ru_maxrss / 1024


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def run_worker(side: str, python: str, cfg: dict, timeout: float) -> dict:
    out = Path(cfg["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    cfg_path, res_path, log = out / "cfg.json", out / "result.json", out / "worker.log"
    cfg_path.write_text(json.dumps(cfg, indent=1))
    if res_path.exists():
        res_path.unlink()
    cmd = [python, str(Path(__file__).resolve()), "--worker", side, "--cfg", str(cfg_path), "--result", str(res_path)]
    load0 = os.getloadavg()[0]
    rc, wall, rss = _spawn(cmd, log, _child_env(cfg["threads"]), timeout)
    load1 = os.getloadavg()[0]
    if rc != 0 or not res_path.exists():
        tail = _tail(log)
        err = "not implemented" if "NotImplementedError" in tail else f"exit {rc}"
        return dict(side=side, ok=False, error=err, log=str(log), log_tail=tail)
    res = json.loads(res_path.read_text())
    res.update(ok=True, peak_rss_mb=rss, process_seconds=wall, log=str(log), loadavg_before=load0, loadavg_after=load1)
    return res


def run_probe(python: str, out: Path, threads: int, timeout: float) -> dict:
    """probe_machine in its own subprocess under `python` (the lmppo interpreter: the torch lmppo runs on)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg_path, res_path, log = out / "cfg.json", out / "result.json", out / "worker.log"
    cfg_path.write_text(json.dumps({"threads": threads}))
    cmd = [
        python,
        str(Path(__file__).resolve()),
        "--worker",
        "probe",
        "--cfg",
        str(cfg_path),
        "--result",
        str(res_path),
    ]
    rc, _, _ = _spawn(cmd, log, _child_env(threads), timeout)
    if rc != 0 or not res_path.exists():
        sys.exit(f"the machine probe failed (see {log}):\n{_tail(log)}")
    return json.loads(res_path.read_text())


def run_eval(
    python: str, policy_dir: Path, cache: Path, cfg: dict, eval_seed: int, timeout: float, dest: Path | None = None
) -> dict:
    """Score a saved policy in its own subprocess (1 thread: robust on a busy machine); results go to
    ``dest`` (default: beside the policy folder -- pass a run folder for the cached untrained policy)."""
    dest = dest or policy_dir.parent
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / f"eval_{policy_dir.name}.json"
    log = dest / f"eval_{policy_dir.name}.log"
    cmd = [
        python,
        str(HERE / "shared" / "common.py"),
        "eval",
        "--policy",
        str(policy_dir),
        "--cache",
        str(cache),
        "--seed",
        str(eval_seed),
        "--response-length",
        str(cfg["response_length"]),
        "--temperature",
        "1.0",
        "--samples-per-prompt",
        str(cfg["eval_samples_per_prompt"]),
        "--n-prompts",
        str(cfg["eval_prompts"]),
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    rc, _, _ = _spawn(cmd, log, _child_env(1), timeout)
    if rc != 0 or not out.exists():
        return dict(ok=False, error=f"eval exit {rc}", log_tail=_tail(log))
    r = json.loads(out.read_text())
    r["ok"] = True
    return r


def build_cache(python: str, kind: str, cache: Path, model_dir: str | None, timeout: float):
    if kind == "tiny":
        cmd = [python, str(HERE / "shared" / "common.py"), "build", "--cache", str(cache)]
    else:
        cmd = [
            python,
            str(HERE / "shared" / "common.py"),
            "build-real",
            "--model-dir",
            str(model_dir),
            "--cache",
            str(cache),
        ]
    cache.parent.mkdir(parents=True, exist_ok=True)
    log = cache.parent / f"build_{cache.name}.log"
    rc, wall, _ = _spawn(cmd, log, _child_env(os.cpu_count() or 1), timeout)
    if rc != 0:
        sys.exit(f"building the {kind} cache failed (see {log}):\n{_tail(log)}")
    return json.loads((cache / "manifest.json").read_text())


def resolve_real_model(lmppo_python: str) -> str:
    code = "from lmppo.models.assets import resolve_model; print(resolve_model('smollm2'))"
    env = dict(os.environ)  # works from a source checkout too (src layout)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent / "src"), env.get("PYTHONPATH")) if p)
    p = subprocess.run([lmppo_python, "-c", code], capture_output=True, text=True, cwd=str(HERE.parent), env=env)
    if p.returncode != 0:
        sys.exit(
            "--real needs lmppo.models.assets.resolve_model('smollm2') (or pass --real-model DIR):\n" + p.stderr[-2000:]
        )
    return p.stdout.strip().splitlines()[-1]


def _fmt(x, spec=".2f", dash="-"):
    return dash if x is None else format(x, spec)


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _spread(xs):
    """(max-min)/median in percent -- the noise estimate across repeats."""
    xs = [x for x in xs if x is not None]
    if len(xs) < 2:
        return None
    return 100.0 * (max(xs) - min(xs)) / statistics.median(xs)


def flop_utilisation(run: dict, name: str, shape: dict, prompt_len: float, response_len: float) -> tuple[float, float]:
    """(needed GFLOP per iteration, percent of the measured matmul limit) of one run: the FLOPs the algorithm
    needs (flops.iteration_flops, non-padding tokens) per CPU-second of train(), over the matmul throughput the
    same process measured in the number format its matmuls run in (bf16 for lmppo's bf16 configs)."""
    import flops

    settings = dict(common.BASE_SETTINGS, **CONFIGS[name])
    lmppo_side = run["side"] == "lmppo"
    separate_critic = not (lmppo_side and settings.get("shared_value_head"))
    per_iteration = flops.iteration_flops(
        shape,
        settings["batch_size"],
        prompt_len,
        response_len,
        settings["ppo_epochs"],
        separate_critic,
        settings["num_mini_batches"],
    )["total"]
    bf16 = lmppo_side and settings.get("precision") == "bf16"
    limit = run.get("matmul_gflops_bfloat16" if bf16 else "matmul_gflops_float32")
    busy = run["train_cpu_seconds"] / run.get("torch_threads", 1)
    if not limit or not busy:
        return per_iteration / 1e9, None
    return per_iteration / 1e9, 100 * per_iteration * run["updates"] / busy / (limit * 1e9)


def summarize(results: dict, untrained: dict, flop_inputs: dict | None = None) -> str:
    """Per configuration: medians over repeats, spread (noise), the lmppo/TRL ratio and FLOP utilisation."""
    lines = [
        "eps = episodes / wall time of train(); eps_cpu = episodes / CPU time of train() x threads "
        "(robust to other load on the machine); util = CPU / wall of train() (1.0 per thread when alone);",
        "spread = (max - min) / median of eps over repeats; peak RSS = ru_maxrss of the worker process; "
        "score = mean reward on held-out prompts after training (sd over repeats).",
    ]
    for name, sides in results.items():
        lines.append(f"\n== {name}: {json.dumps(CONFIGS[name]) if CONFIGS[name] else 'base settings'} ==")
        u = untrained.get(name)
        if u and u.get("ok"):
            lines.append(f"untrained policy score: {u['score_mean']:+.3f} (sem {u['score_sem']:.3f}, n {u['n']})")
        lines.append(
            f"{'':6} {'eps':>7} {'steady':>7} {'spread%':>7} {'eps_cpu':>7} {'cpu%':>5} "
            f"{'peakMB':>7} {'score':>7} {'sd':>6} {'n':>2}"
        )
        med = {}
        for side in ("trl", "lmppo"):
            allr = sides.get(side, [])
            ok = [r for r in allr if r.get("ok")]
            if not allr:
                continue
            if not ok:
                lines.append(f"{side:6} ({allr[0].get('error', 'failed')})")
                continue
            sc = [r.get("eval", {}).get("score_mean") for r in ok]
            sc = [x for x in sc if x is not None]
            med[side] = dict(
                eps=_median([r["eps"] for r in ok]),
                eps_cpu=_median([r.get("eps_cpu") for r in ok]),
                rss=_median([r["peak_rss_mb"] for r in ok]),
            )
            lines.append(
                f"{side:6} {_fmt(med[side]['eps'], '.3f'):>7} "
                f"{_fmt(_median([r.get('eps_steady') for r in ok]), '.3f'):>7} "
                f"{_fmt(_spread([r['eps'] for r in ok]), '.1f'):>7} {_fmt(med[side]['eps_cpu'], '.3f'):>7} "
                f"{_fmt(_median([100 * r['cpu_util'] for r in ok if r.get('cpu_util')]), '.0f'):>5} "
                f"{_fmt(med[side]['rss'], '.0f'):>7} {_fmt(_median(sc), '+.3f'):>7} "
                f"{_fmt(statistics.stdev(sc) if len(sc) > 1 else None, '.3f'):>6} {len(ok):>2}"
            )
        if flop_inputs:
            runs = [r for side in ("trl", "lmppo") for r in sides.get(side, []) if r.get("ok")]
            lengths = [r["response_length_mean"] for r in runs if r.get("response_length_mean")]
            response_len = _median(lengths) or CONFIGS[name].get(
                "response_length", common.BASE_SETTINGS["response_length"]
            )
            for side in ("trl", "lmppo"):
                figures = [
                    flop_utilisation(r, name, flop_inputs["shape"], flop_inputs["prompt_len"], response_len)
                    for r in sides.get(side, [])
                    if r.get("ok")
                ]
                if figures:
                    limit_key = (
                        "matmul_gflops_bfloat16"
                        if side == "lmppo" and CONFIGS[name].get("precision") == "bf16"
                        else "matmul_gflops_float32"
                    )
                    limit = _median([r.get(limit_key) for r in sides[side] if r.get("ok")])
                    lines.append(
                        f"{side:6} needs {figures[0][0]:.0f} GFLOP/iteration (prompt {flop_inputs['prompt_len']:.1f} + "
                        f"response {response_len:.1f} tokens): {_fmt(_median([f[1] for f in figures]), '.0f')}% "
                        f"of the measured {limit_key.split('_')[-1]} matmul limit ({_fmt(limit, '.0f')} GFLOP/s)"
                    )
        if "trl" in med and "lmppo" in med:
            t, l = med["trl"], med["lmppo"]
            lines.append(
                f"lmppo/TRL: eps x{l['eps'] / t['eps']:.2f}"
                + (f", eps_cpu x{l['eps_cpu'] / t['eps_cpu']:.2f}" if t["eps_cpu"] and l["eps_cpu"] else "")
                + f", peak RSS x{l['rss'] / t['rss']:.2f}"
            )
        if any(r.get("reused_from") for r in sides.get("trl", [])):
            lines.append("(TRL side reused from an identical TRL run of another config)")
    return "\n".join(lines)


PHASES = ("rollout", "reward", "update", "other")
NOISY_ITERATIONS = 1.15  # p50 / p10 of one side's iteration times above this: the machine was too busy
NOISY_RATIO = 0.10  # (max - min) / median of the per-round lmppo/TRL ratios above this: the ratio is not settled


def _percentile(xs: list, q: float):
    """The q-th percentile (0-100) of xs, linear between order statistics; None for no data."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def steady_iterations(run: dict) -> list[dict]:
    """A run's per-iteration records without the first iteration (warm-up: allocator, lazy init, first caches)."""
    its = run.get("iterations") or []
    return its[1:] if len(its) > 1 else its


def iteration_stats(runs: list[dict], key: str = "wall") -> Optional[dict]:
    """p10, median, min, max of per-iteration `key` seconds over the steady iterations of all `runs`."""
    xs = [it[key] for r in runs for it in steady_iterations(r)]
    if not xs:
        return None
    return dict(n=len(xs), p10=_percentile(xs, 10), p50=_percentile(xs, 50), min=min(xs), max=max(xs))


def drop_weights(out_dir: Path) -> None:
    """A worker's model files once its figures are taken (the run folder with its checkpoint, TRL's output, the saved
    policy: about 0.7 GB a run on the tiny configs, 14 GB for a default `make bench`); logs and results stay."""
    for name in ("lmppo_run", "trl_output", "policy"):
        shutil.rmtree(out_dir / name, ignore_errors=True)


def round_ratios(trl_runs: list[dict], lmppo_runs: list[dict], key: str = "wall") -> list[float]:
    """Per round: TRL's median iteration time over lmppo's (> 1: lmppo faster), rounds paired in run order."""
    out = []
    for t, m in zip(trl_runs, lmppo_runs):
        tt = _percentile([it[key] for it in steady_iterations(t)], 50)
        mm = _percentile([it[key] for it in steady_iterations(m)], 50)
        if tt and mm:
            out.append(tt / mm)
    return out


def machine_lines(probes: list[dict]) -> list[str]:
    """The machine the figures come from, probed at the start and the end of the run."""
    if not probes:
        return []
    p = probes[0]
    lines = [
        f"machine: {p['cpu']}, {p['cpus']} CPUs, torch {p['torch']}, capability {p['capability']}, "
        f"AVX-512 BF16 {'yes' if p['avx512_bf16'] else 'no'}, AMX {'yes' if p['amx_tile'] else 'no'}"
    ]
    for label, q in zip(("start", "end"), probes):
        f32, b16 = q["matmul_gflops_float32"], q["matmul_gflops_bfloat16"]
        lines.append(
            f"  {label}: matmul 512x512x1536 at {q['threads']} thread(s): fp32 {f32:.0f} GFLOP/s, bf16 "
            f"{b16:.0f} GFLOP/s (bf16/fp32 {b16 / f32:.2f}); load average {q['loadavg'][0]:.2f} "
            f"{q['loadavg'][1]:.2f} {q['loadavg'][2]:.2f}"
        )
    return lines


def robust_summary(results: dict, probes: list[dict]) -> str:
    """The figures to quote: per-iteration times (steady iterations of many short alternating rounds), their p10
    as the figure, the spread, the per-round ratios, a phase split of both trainers, and warnings."""
    lines = machine_lines(probes)
    lines.append(
        "\nper-iteration seconds over the steady iterations of all rounds (the first iteration of each run "
        "dropped); figure = p10 (a low percentile: what the code does when the machine lets it), spread = "
        "p50/p10 and max/min; cpu = process CPU time per iteration; ratio = TRL / lmppo (> 1: lmppo faster)"
    )
    header = (
        f"{'config':12} {'side':6} {'n':>3} {'p10 s':>7} {'p50/p10':>7} {'max/min':>7} {'cpu p10':>7} "
        f"{'eps@p10':>7} | " + " ".join(f"{ph:>7}" for ph in PHASES)
    )
    warnings = []
    lines.append(header)
    lines.append("-" * len(header))
    ratio_lines = []
    for name, sides in results.items():
        ok = {side: [r for r in runs if r.get("ok")] for side, runs in sides.items()}
        batch = dict(common.BASE_SETTINGS, **CONFIGS[name])["batch_size"]
        stats = {}
        for side in ("trl", "lmppo"):
            runs = ok.get(side) or []
            st, cpu = iteration_stats(runs), iteration_stats(runs, "cpu")
            if st is None:
                continue
            stats[side] = (st, cpu)
            its = [it for r in runs for it in steady_iterations(r)]
            phases = " ".join(f"{_percentile([it[ph] for it in its], 50):7.3f}" for ph in PHASES)
            lines.append(
                f"{name:12} {side:6} {st['n']:>3} {st['p10']:7.3f} {st['p50'] / st['p10']:7.2f} "
                f"{st['max'] / st['min']:7.2f} {cpu['p10']:7.3f} {batch / st['p10']:7.2f} | {phases}"
            )
            threads = runs[0].get("torch_threads") or 1
            if st["p10"] * threads / cpu["p10"] > 1.0 + NOISY_RATIO * 2:
                warnings.append(
                    f"WARNING {name}/{side}: wall time per iteration is {st['p10'] * threads / cpu['p10']:.1f}x "
                    f"its CPU time at {threads} thread(s): other processes took the CPU; quote the cpu "
                    "figures, not the wall-clock ones"
                )
            if st["p50"] / st["p10"] > NOISY_ITERATIONS:
                warnings.append(
                    f"WARNING {name}/{side}: iteration times spread {st['p50'] / st['p10']:.2f}x "
                    f"(p50/p10 > {NOISY_ITERATIONS}): the machine was busy or the responses' lengths "
                    "varied; its figure cannot be trusted to 10%"
                )
        if len(stats) == 2:
            (t, tc), (m, mc) = stats["trl"], stats["lmppo"]
            text = (
                f"{name:12} lmppo/TRL speed at p10: wall x{t['p10'] / m['p10']:.2f}, cpu x{tc['p10'] / mc['p10']:.2f}"
            )
            for key in ("wall", "cpu"):
                rounds = round_ratios(ok["trl"], ok["lmppo"], key)
                if not rounds:
                    continue
                spread = (max(rounds) - min(rounds)) / statistics.median(rounds)
                text += (
                    f"\n{'':12} per round ({key}, median iteration): "
                    + ", ".join(f"{x:.2f}" for x in rounds)
                    + f" (spread {100 * spread:.0f}%)"
                )
                if key == "cpu" and len(rounds) > 1 and spread > NOISY_RATIO:
                    warnings.append(
                        f"WARNING {name}: the per-round lmppo/TRL CPU-time ratios spread "
                        f"{100 * spread:.0f}% (> {100 * NOISY_RATIO:.0f}%): quote the p10 ratio with that "
                        "spread, or rerun on a quieter machine"
                    )
            ratio_lines.append(text)
    lines.append(
        "phases: median wall seconds per iteration; rollout = sampling + reference/value passes, reward = reward "
        "model, update = PPO epochs, other = the rest (KL, advantages, logging)"
    )
    lines += ratio_lines
    if len(probes) == 2:
        a, b = probes[0]["matmul_gflops_float32"], probes[1]["matmul_gflops_float32"]
        if abs(a - b) / max(a, b) > 0.10:
            warnings.append(
                f"WARNING: the fp32 matmul rate moved {100 * abs(a - b) / max(a, b):.0f}% between the "
                "start and the end of the run: the machine's speed changed while it ran"
            )
    lines += warnings or ["no noise warning: every spread is within its limit"]
    return "\n".join(lines)


def flop_inputs(cache: Path) -> dict:
    """The policy's shape and the mean prompt length of the training prompts, for flop_utilisation."""
    import flops

    prompts = json.loads((cache / "prompts.json").read_text())["train"]
    return {
        "shape": flops.llama_shape(cache / "policy" / "config.json"),
        "prompt_len": sum(len(p) for p in prompts) / len(prompts),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="lmppo vs TRL PPO speed benchmark",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument("--configs", default="base,len64,epoch1,shared")
    ap.add_argument("--episodes", type=int, default=None, help="episodes per run (default 40 tiny, 32 real)")
    ap.add_argument("--repeats", type=int, default=6, help="alternating rounds (each: every config, TRL then lmppo)")
    ap.add_argument(
        "--eval-rounds",
        type=int,
        default=1,
        help="score the trained policies of the first N rounds on the held-out prompts (0: none)",
    )
    ap.add_argument("--seed", type=int, default=0, help="repeat r trains with seed+r (both trainers)")
    ap.add_argument("--eval-seed", type=int, default=1234, help="sampling seed of the evaluation (same for all)")
    ap.add_argument("--sides", default="trl,lmppo")
    ap.add_argument("--real", action="store_true", help="run only the opt-in SmolLM2-135M config")
    ap.add_argument(
        "--real-model", default=None, help="HF folder for --real (default: lmppo.models.assets.resolve_model)"
    )
    ap.add_argument("--trl-python", default=sys.executable)
    ap.add_argument("--lmppo-python", default=sys.executable)
    ap.add_argument("--eval-python", default=None, help="interpreter for caches + evaluation (default: --trl-python)")
    ap.add_argument("--cache-dir", type=Path, default=common.DEFAULT_CACHE_ROOT)
    ap.add_argument("--out", type=Path, default=HERE / ".cache" / "runs")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--threads", type=int, default=None, help="override torch threads of every run (default: config's)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="instead of the comparison: one cProfiled TRL run per config, printing where its time goes",
    )
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument(
        "--keep-runs",
        action="store_true",
        help="keep every worker's run folder and saved policy (by default deleted once evaluated)",
    )
    # worker mode
    ap.add_argument("--worker", choices=["trl", "lmppo", "probe"], help=argparse.SUPPRESS)
    ap.add_argument("--cfg", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.worker:
        cfg = json.loads(a.cfg.read_text())
        res = {"trl": run_trl, "lmppo": run_lmppo, "probe": lambda c: probe_machine(c["threads"])}[a.worker](cfg)
        a.result.write_text(json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))
        return

    eval_python = a.eval_python or a.trl_python
    sides = [s for s in a.sides.split(",") if s]
    names = ["real"] if a.real else [c for c in a.configs.split(",") if c]
    for n in names:
        if n not in CONFIGS:
            sys.exit(f"unknown config {n!r}; known: {', '.join(CONFIGS)}")
    kind = "real" if a.real else "tiny"
    episodes = a.episodes or DEFAULT_EPISODES[kind]
    cache = a.cache_dir / ("smollm2" if a.real else "tiny")
    model_dir = None
    if a.real:
        model_dir = a.real_model or resolve_real_model(a.lmppo_python)
    print(f"building/reusing the {kind} cache at {cache} ...", flush=True)
    manifest = build_cache(eval_python, kind, cache, model_dir, a.timeout)
    print(
        f"cache {manifest['content_sha256'][:12]}; episodes/run {episodes}; repeats {a.repeats}; "
        f"sides {sides}; configs {names}",
        flush=True,
    )

    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = a.out / stamp
    probe_threads = a.threads or CONFIGS[names[0]].get("threads", common.BASE_SETTINGS["threads"])
    probes = [run_probe(a.lmppo_python, root / "probe_start", probe_threads, a.timeout)]
    print("\n".join(machine_lines(probes)), flush=True)
    results: dict[str, dict[str, list]] = {n: {s: [] for s in sides} for n in names}
    untrained: dict[str, dict] = {}
    pythons = {"trl": a.trl_python, "lmppo": a.lmppo_python}
    if a.profile:
        for n in names:
            cfg = make_run_cfg(n, "trl", a.seed, episodes, cache, root / n / "trl_profile", profile=True)
            if a.threads:
                cfg["threads"] = a.threads
            print(f"profiling TRL, config {n} ...", flush=True)
            res = run_worker("trl", a.trl_python, cfg, a.timeout)
            if not res.get("ok"):
                sys.exit(f"failed: {res['log']}\n{res.get('log_tail', '')}")
            prof = res["profile"]
            tot = prof.pop("train_total")
            print(
                f"train() {tot:.1f} s under cProfile for {res['episodes']} episodes "
                f"(eps {res['eps']:.3f}, cpu util {res['cpu_util']:.2f}); full stats: {cfg['out_dir']}/trl_profile.txt"
            )
            for k, v in prof.items():
                print(f"  {k:62} {v:7.2f} s  {100 * v / tot:5.1f}%")
        return
    for n in names:  # score of the untrained policy, once per config (response length may differ)
        if a.no_eval:
            break
        cfg0 = make_run_cfg(n, "none", a.seed, episodes, cache, root / n / "untrained")
        (root / n).mkdir(parents=True, exist_ok=True)
        untrained[n] = run_eval(
            eval_python, cache / "policy", cache, cfg0, a.eval_seed, a.timeout, dest=root / n / "untrained"
        )
        (root / n / "untrained.json").write_text(json.dumps(untrained[n], indent=1))
    for r in range(a.repeats):
        for n in names:
            for side in sides:
                cfg = make_run_cfg(n, side, a.seed + r, episodes, cache, root / n / side / f"r{r}")
                if a.threads:
                    cfg["threads"] = a.threads
                reuse = None
                if side == "trl":
                    key = {k: v for k, v in cfg.items() if k not in LMPPO_ONLY_KEYS | {"config", "out_dir"}}
                    for m in names[: names.index(n)]:
                        prev = results[m]["trl"]
                        if len(prev) > r and prev[r].get("ok") and prev[r]["_key"] == key:
                            reuse = dict(prev[r], reused_from=m)
                if reuse:
                    res = reuse
                else:
                    print(f"[repeat {r + 1}/{a.repeats}] {n:7} {side:6} ...", end=" ", flush=True)
                    res = run_worker(side, pythons[side], cfg, a.timeout)
                    if side == "trl":
                        res["_key"] = {k: v for k, v in cfg.items() if k not in LMPPO_ONLY_KEYS | {"config", "out_dir"}}
                    if res.get("ok") and not a.no_eval and r < a.eval_rounds:
                        res["eval"] = run_eval(
                            eval_python, Path(cfg["out_dir"]) / "policy", cache, cfg, a.eval_seed, a.timeout
                        )
                    if not a.keep_runs:
                        drop_weights(Path(cfg["out_dir"]))
                    if res.get("ok"):
                        st = iteration_stats([res])
                        print(
                            f"iteration p10 {_fmt(st and st['p10'], '.3f')} s, "
                            f"eps {res['eps']:.3f} (steady {_fmt(res.get('eps_steady'), '.3f')}), "
                            f"peak RSS {res['peak_rss_mb']:.0f} MB, score "
                            f"{_fmt(res.get('eval', {}).get('score_mean'), '+.3f')}",
                            flush=True,
                        )
                    else:
                        print(res["error"], "-", res["log"], flush=True)
                results[n][side].append(res)
    probes.append(run_probe(a.lmppo_python, root / "probe_end", probe_threads, a.timeout))
    summary = (
        summarize(results, untrained, flop_inputs(cache))
        + "\n\n== per-iteration figures ==\n"
        + robust_summary(results, probes)
    )
    print(summary)
    root.mkdir(parents=True, exist_ok=True)
    (root / "results.json").write_text(
        json.dumps(
            dict(
                results=results,
                untrained=untrained,
                manifest=manifest,
                argv=sys.argv,
                episodes=episodes,
                machine=probes,
            ),
            indent=1,
            default=str,
        )
    )
    (root / "summary.txt").write_text(summary + "\n")
    print(f"\nresults: {root / 'results.json'}")


if __name__ == "__main__":
    main()
