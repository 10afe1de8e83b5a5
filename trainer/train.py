"""One GTPO (or GRPO) training run, top to bottom: ``gtpo-train`` (``python -m gtpo_train``; ``python -m trainer``
in a checkout), or under ``torchrun --nproc_per_node K -m gtpo_train`` for K processes.

    load the task (rows, prompts, rewards), the model -> evaluate -> for each step:
        sample G completions for each of this process's prompts          (rollout.py)
        rewards -> group-relative advantages -> conflict weights of the (whole, local) groups
        old log-probs and the initial entropy from hidden states          (no [N, L, V] logits)
        GTPO loss on hidden states over micro-batches, with the whole batch's counts across processes;
        no optimiser step when no completion carries signal              (update.py)
        log (process 0: metrics.jsonl and --report-to), evaluate every k steps, checkpoint every k steps
    -> evaluate, save, plot, summary                                      (evaluation.py, report.py)

``--prompts-per-step`` is the global batch: each of the K processes samples its share of the prompts, so
prompt groups and their conflict weights stay within a process, and the loss divides by the whole
batch's counts (all-reduced), which makes K processes update exactly as one would (tested).
"""

from __future__ import annotations

import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import torch
from tqdm.auto import tqdm

from gtpo_kernels import GTPOMetrics

from .adapters import reference_weights
from .checkpoint import RunState, latest_checkpoint, read_optimizer_state, read_trainer_state
from .config import ConfigError, TrainConfig, parse_args
from .decode import Decoder
from .distributed import Distributed, full_parameters, full_state, load_optimizer_state
from .intervals import metric_intervals
from .metrics_log import MetricsLog
from .offline.plots import plot_run
from .precision import Machine, autocast
from .report import print_summary, save_final, summarise
from .rollout import Rollout, compiles_decode, rollout
from .scoring import RewardError, stop_together
from .seeding import step_seed
from .session import Session, check_before_loading, load_session, step_rows
from .stopping import Interrupted, Stopped, StopReason
from .task import load_task
from .totals import Totals
from .tracking import Trackers
from .update import advance_schedule, no_signal_cause, token_stats, update

# Steps in a row without any learning signal before the run warns (it keeps going).
NO_SIGNAL_WARNING_AFTER = 3


def run(config: TrainConfig, dist: Optional[Distributed] = None) -> dict:
    """The whole run; returns its summary. Under torchrun the process group it starts (``dist`` not given) is
    closed when the run ends (not after an error: a peer may be gone)."""
    run_started = time.time()  # wall clock of the whole run: loading, evaluations and saving included
    started_here = dist is None
    dist = dist or Distributed.start(config.device)
    result = run_in(config, dist, run_started)
    if started_here:
        dist.close()
    return result


def run_in(config: TrainConfig, dist: Distributed, run_started: float) -> dict:
    """`run` in the processes of ``dist``, started at ``run_started``."""
    session, log, state = start(config, dist)
    try:
        started = time.time()
        stopped, after = train_and_evaluate(session, state, log, started)
        if after is None:  # stopped by a signal: save the last completed step, say how to go on, exit non-zero
            session.checkpoint(state, log)
            if dist.is_main:
                print(
                    f"stopped at step {state.step} of {config.steps} ({stopped.message}); checkpoint saved; resume "
                    f"with: gtpo-train --config {Path(config.output_dir) / 'config.json'} --resume",
                    file=sys.stderr,
                    flush=True,
                )
            return {
                "interrupted": True,
                "step": state.step,
                "reason": stopped.message,
                "exit_status": session.stop.exit_status,
            }
        return finish(session, state, log, after, stopped, started, run_started)
    finally:
        log.close()


def start(config: TrainConfig, dist: Distributed) -> Tuple[Session, MetricsLog, RunState]:
    """Everything before the first step. What can be checked without the model is checked first, before anything
    is loaded or written: a bad setting, dataset or reward costs a second and leaves no empty output folder."""
    out_dir = Path(config.output_dir)
    check_before_loading(config, dist.world)
    folder, saved = None, None
    if config.resume:  # the newest checkpoint, and its state file readable, before anything loads
        folder = latest_checkpoint(out_dir)
        saved = read_trainer_state(folder)
    task = load_task(config)
    if dist.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    session = load_session(config, dist, task, resume_from=folder)
    trackers = Trackers(
        [t for t in config.report_to if t != "none"],
        config.run_name or out_dir.resolve().name,
        out_dir,
        config.to_dict(),
        enabled=dist.is_main,
    )
    log = MetricsLog(out_dir / "metrics.jsonl", enabled=dist.is_main, trackers=trackers)
    if not config.resume:
        log.start()
        if dist.is_main:
            (out_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
        return session, log, RunState()
    load_optimizer_state(session.policy, session.optimizer, read_optimizer_state(folder, saved["optimizer"]))
    session.scheduler.load_state_dict(saved["scheduler"])
    state = RunState.from_dict(saved["state"])
    dropped = log.cut_back(state.step, state.eval_step)
    if dist.is_main:
        print(
            f"resumed from {folder} at step {state.step}"
            + (f" ({dropped} log rows after it dropped: those steps run again)" if dropped else "")
        )
    return session, log, state


def train_and_evaluate(
    session: Session, state: RunState, log: MetricsLog, started: float
) -> Tuple[Optional[Stopped], Optional[dict]]:
    """The evaluation before training (unless done), the steps (``started`` then, for --max-minutes), the final
    evaluation: ``(stopped, after)``, where ``after`` is None when a stop request ended the run before its final
    evaluation."""
    config, dist = session.config, session.dist
    with session.stop as stop:
        if dist.world == 1:  # one process stops mid-phase; several must agree, at step and batch boundaries
            stop.interrupt_layers(session.model.get_decoder().layers)
        if state.eval_step < 0 and config.eval_before and config.steps > 0:  # --steps 0: the final one is it
            before = session.evaluate(seed=0, desc="eval before")
            if before is None:
                return stop.stopped("during the first evaluation"), None
            state.before, state.eval_step = before, 0
            log.append(eval_row(session, 0, before))
            if dist.is_main:
                print(f"before training: {before}")
        evaluate_if_due(session, state, log)
        stopped = train_steps(session, state, log, started)
        if stopped is None and dist.any(stop.requested is not None):
            stopped = stop.stopped()
        if stopped is not None and stopped.finishes and dist.is_main:
            print(
                f"stopping early at step {state.step} of {config.steps}: {stopped.message}; evaluating and saving",
                flush=True,
            )
        if stopped is not None and not stopped.finishes:
            return stopped, None
        if state.after_step == state.step:  # a run stopped after its final evaluation was logged and checkpointed
            return stopped, state.after
        answers = [] if dist.world == 1 else None  # each process holds its own rows' answers
        after = session.evaluate(seed=config.steps, desc="eval after", greedy_answers=answers)
        if after is None:
            return stop.stopped("during the final evaluation"), None
        if answers is not None:
            write_held_out_answers(session, answers)
    return stopped, after


def train_steps(session: Session, state: RunState, log: MetricsLog, started: float) -> Optional[Stopped]:
    """The training steps from ``state.step`` on, each logged, evaluated and checkpointed when due; returns why they
    stopped early, or None."""
    config, dist, stop = session.config, session.dist, session.stop
    bar = tqdm(
        range(state.step, config.steps),
        initial=state.step,
        total=config.steps,
        desc=config.algo,
        disable=not dist.is_main,
    )
    try:
        for step in bar:
            if dist.any(stop.requested is not None):
                return stop.stopped()
            if config.max_minutes is not None and time.time() - started > 60 * config.max_minutes:
                return Stopped(StopReason.TIME_CAP, f"the --max-minutes cap ({config.max_minutes:g} min) was reached")
            try:
                row = train_step(session, state, step)
            except Interrupted:  # nothing of this step was applied: the run is at the previous one
                session.optimizer.zero_grad()
                return stop.stopped()
            log.append(row)
            state.step = step + 1
            postfix = {
                "reward": f"{row['reward']:.2f}",
                "H": f"{row['entropy']:.2f}",
                "s_step": f"{row['time_step']:.1f}",
            }
            if "accuracy" in row:
                postfix["acc"] = f"{row['accuracy']:.2f}"
            bar.set_postfix(**postfix)
            evaluate_if_due(session, state, log)
            if config.save_every and state.step % config.save_every == 0:
                session.checkpoint(state, log)
    finally:
        bar.close()
    return None


def train_step(session: Session, state: RunState, step: int) -> dict:
    """Rollout, old log-probs, num_iterations passes of mini_batches updates; returns the step's log row and
    advances ``state``'s initial entropy and no-signal streak. A stop request may cut it short (`Interrupted`)
    until its first optimiser step; after that the step completes."""
    config, dist, stop = session.config, session.dist, session.stop
    model, policy = session.model, session.policy
    t0 = time.time()
    # Every random draw of this step comes from (seed, step, rank): a replayed step draws the same.
    torch.manual_seed(step_seed(config.seed, "rollout", step, dist.rank))
    failed: Optional[RewardError] = None
    with full_parameters(policy), autocast(config, dist.device):
        try:
            batch = rollout(
                model,
                session.tokenizer,
                session.task,
                step_rows(session.task.train, step, config, dist),
                config,
                dist.device,
                # one process stops within a token of a request (our decoding step runs no layer hooks)
                on_token=(lambda t: stop.check()) if dist.world == 1 else None,
            )
        except RewardError as exc:
            failed = exc
    stop_together(dist, failed)
    t1 = time.time()
    batch.old_logprobs, batch.ref_logprobs = rollout_logprobs(session, state, batch)
    t2 = time.time()
    stepped, losses, grad_norms, updates = 0, [], [], []
    per_mini = batch.prompts // config.mini_batches
    for iteration in range(config.num_iterations):
        for part in range(config.mini_batches):
            if iteration or part:
                stop.paused = True  # the first update is applied: finish the step, so the checkpoint stays exact
            groups = slice(part * per_mini, (part + 1) * per_mini)
            result = update(policy, session.optimizer, batch, config, dist, state.initial_entropy, groups)
            advance_schedule(session.scheduler)
            stepped += result.stepped
            losses.append(result.loss)
            grad_norms.append(result.grad_norm)
            updates.append(result.metrics)
    t3 = time.time()
    stop.paused = False
    state.no_signal_streak = 0 if stepped else state.no_signal_streak + 1
    if state.no_signal_streak == NO_SIGNAL_WARNING_AFTER and dist.is_main:
        tqdm.write(
            f"warning: {NO_SIGNAL_WARNING_AFTER} steps in a row without any learning signal, so the weights "
            f"did not move: {no_signal_cause(result.metrics, config.loss_config())}",
            file=sys.stderr,
        )
    metrics = GTPOMetrics.merge(updates).to_dict()  # over every update of the step: its clip fractions, say
    return {
        "kind": "train",
        "step": step + 1,
        "loss": float(np.mean(losses)),
        **reward_figures(session, batch),
        **{k: v for k, v in metrics.items() if not k.startswith("num_")},
        "updates": stepped,
        "initial_entropy": state.initial_entropy,
        "grad_norm": float(np.nanmean(grad_norms)) if stepped else None,
        "lr": session.scheduler.get_last_lr()[0],
        "time_generation": t1 - t0,
        "time_old_logprobs": t2 - t1,
        "time_update": t3 - t2,
        "time_step": time.time() - t0,
        **decode_compile_time(session),
    }


def rollout_logprobs(session: Session, state: RunState, batch: Rollout):
    """``(old_logprobs, ref_logprobs)`` of the rollout, each None where the step needs none: the sampling policy's
    (with ``--num-iterations`` or ``--mini-batches`` above 1; on the first step its mean entropy, over all
    processes, becomes ``state``'s initial entropy) and the starting policy's (``--beta``: the KL term's reference)."""
    config, dist, model, policy = session.config, session.dist, session.model, session.policy
    old_logprobs = ref_logprobs = None
    off_policy = config.updates_per_rollout > 1  # an update after the first: the ratio moves
    if state.initial_entropy is None or off_policy:
        with full_parameters(policy), autocast(config, dist.device):
            logp, entropy = token_stats(model, batch, config, session.head)
        if state.initial_entropy is None:  # the policy's entropy before any update, over all processes
            mask = batch.completions.completion_mask
            sums = dist.all_sum(torch.stack([(entropy * mask).sum().double(), mask.sum().double()]))
            state.initial_entropy = float(sums[0] / sums[1].clamp(min=1))
        old_logprobs = logp if off_policy else None
    if config.beta:
        with full_parameters(policy), autocast(config, dist.device), reference_weights(model, session.reference) as ref:
            ref_logprobs, _ = token_stats(ref, batch, config, session.head)
    return old_logprobs, ref_logprobs


@dataclass
class RolloutTotals(Totals):
    """A rollout's sums and counts, added over processes as one vector (`Totals`)."""

    reward: torch.Tensor  # the summed total reward
    solved: torch.Tensor  # completions scoring 1 on the accuracy reward
    not_binary: torch.Tensor  # > 0 where some accuracy reward was neither 0 nor 1 (then no accuracy is reported)
    tokens: torch.Tensor  # completion tokens
    completions: torch.Tensor
    per_reward: torch.Tensor  # [R] each reward function's summed values where it applies
    applies: torch.Tensor  # [R] how many completions each reward function applies to


def reward_figures(session: Session, batch: Rollout) -> dict:
    """The step's rollout figures over all processes: the mean reward, each reward function's mean over the
    completions it applies to (``rewards/NAME``), the share scoring 1 on the accuracy reward (where its values are
    0 or 1) and the mean completion length."""
    task, dist = session.task, session.dist
    scores = batch.scores.double()
    applies = ~scores.isnan()
    acc = scores[:, task.reward_names.index(task.accuracy_reward)]
    mine = RolloutTotals(
        reward=batch.rewards.double().sum(),
        solved=(acc == 1).sum(),
        not_binary=~((acc == 0) | (acc == 1) | acc.isnan()).all(),
        tokens=batch.completions.completion_mask.sum(),
        completions=torch.tensor(len(scores)),
        per_reward=torch.where(applies, scores, 0).sum(0),
        applies=applies.sum(0),
    )
    sums, rewards = dist.all_sum(mine.to_sums().to(dist.device)).cpu(), len(task.rewards)
    totals = RolloutTotals.from_sums(sums, per_reward=rewards, applies=rewards)
    n = float(totals.completions)
    figures = {"reward": float(totals.reward) / n}
    for name, value, count in zip(task.reward_names, totals.per_reward.tolist(), totals.applies.tolist()):
        figures[f"rewards/{name}"] = value / count if count else None
    if not totals.not_binary:
        figures["accuracy"] = float(totals.solved) / n
    figures["completion_length"] = float(totals.tokens) / n
    return figures


def decode_compile_time(session: Session) -> dict:
    """Under ``--compile-decode``, the seconds the run has spent compiling the sampler's step so far (each first
    call of a new shape): ``{"time_decode_compile": s}``; else nothing."""
    if not compiles_decode(session.config, session.dist.device):
        return {}
    return {"time_decode_compile": Decoder.of(session.model, compile=True).compile_seconds}


def evaluate_if_due(session: Session, state: RunState, log: MetricsLog) -> None:
    """The evaluation every --eval-every steps, unless done (a resume may find it still owed)."""
    every, steps = session.config.eval_every, session.config.steps
    if every and state.step % every == 0 and 0 < state.step < steps and state.eval_step < state.step:
        result = session.evaluate(seed=state.step)
        if result is not None:
            log.append(eval_row(session, state.step, result))
            state.eval_step = state.step


def write_held_out_answers(session: Session, answers: list) -> None:
    """``held-out-answers.jsonl``: the final evaluation's greedy answer to each held-out problem (by the task's
    ``answer_key``), whether it is right and how many of the ``eval_k`` samples are: what a collapse to one answer,
    or a paired comparison problem by problem, reads. One process only (under torchrun each holds part)."""
    with open(Path(session.config.output_dir) / "held-out-answers.jsonl", "w") as f:
        for problem, row in enumerate(answers):
            key = session.task.answer_key(row["completion"])
            record = {
                "problem": problem,
                "answer": key if key is None or isinstance(key, (int, float)) else str(key),
                "correct": row["correct"],
                "samples_right": row["samples_right"],
                "completion": row["completion"],
            }
            f.write(json.dumps(record) + "\n")


def eval_row(session: Session, step: int, result: dict) -> dict:
    """An evaluation's log row: its figures, and each share's 95 % interval over the held-out rows."""
    return {
        "kind": "eval",
        "step": step,
        **result,
        "intervals_95": metric_intervals(result, len(session.task.held_out)),
    }


def finish(
    session: Session, state: RunState, log: MetricsLog, after: dict, stopped, started: float, run_started: float
) -> dict:
    """The final evaluation logged, the last checkpoint, the model saved, the plot and the summary."""
    config, dist = session.config, session.dist
    if state.after_step != state.step:  # (a resumed run logged it before it stopped)
        log.append(eval_row(session, state.step, after))
        state.eval_step, state.after, state.after_step = state.step, after, state.step
    session.checkpoint(state, log)
    summary = None
    out_dir = Path(config.output_dir)
    if dist.is_main:
        save_final(session.model, session.tokenizer, session.policy, out_dir / "final", config.merge_lora)
        plot = plot_run(
            log.path,
            out_dir / "training.png",
            title=f"{config.algo} ({config.loss_preset}) on {config.dataset}, seed {config.seed}",
        )
        now = time.time()
        summary = summarise(
            config,
            state,
            after,
            stopped,
            dist.world,
            len(session.task.held_out),
            (now - started) / 60,
            (now - run_started) / 60,
            Machine.this(dist.device),
        )
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        print_summary(summary, log, plot)
    else:
        full_state(session.policy, None)  # take part in save_final's gather
    dist.barrier()
    return summary or {"steps": state.step}


def main(argv=None) -> None:
    config = parse_args(argv)
    try:
        result = run(config)
        # FSDP2's modules sit in reference cycles that hold the process group: freed now, while the interpreter is
        # whole, not at its exit, where tearing down gloo's threads can abort a finished process (exit status -6,
        # seen in the two-process FSDP2 update test).
        gc.collect()
    except ConfigError as exc:  # a setting, model, dataset or reward that cannot be used: one line, not a traceback
        print(f"gtpo-train: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # a second Ctrl-C, or one before training started: stop at once
        print("gtpo-train: interrupted (the last saved checkpoint, if any, resumes with --resume)", file=sys.stderr)
        sys.exit(130)
    if result.get("interrupted"):  # a script or scheduler can tell a stopped run from a finished one
        sys.exit(result["exit_status"])


if __name__ == "__main__":
    main()
