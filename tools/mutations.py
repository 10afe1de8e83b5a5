"""The mutation check: each "seen failing with X removed" claim of the project, held as data and re-run.

    python -m tools.mutations                 # every mutant; writes tools/mutations-report.md
    python -m tools.mutations --only NAME ... # some of them (the report is printed, not written)
    python -m tools.mutations --list          # the mutants and the tests each must fail

Each `Mutant` names a file, a piece of its text and what to put in its place (the bug a test claims to catch), and
the tests that must then fail. For each one the check copies the working tree to a scratch folder, applies the
change there (refusing a mutant whose text is not found exactly once: the code moved, so the claim must be
re-aimed), runs those tests with pytest, and calls the mutant *killed* when pytest reports failures (exit 1). Exit 0
(the tests still pass: the claim is false) and any other exit (collection error, timeout) are reported as such.

It runs on demand, not in CI (a few minutes a mutant for the torchrun and TRL tests). A test that guards a fix
belongs here, with the break it was seen to catch.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Tuple

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "tools" / "mutations-report.md"


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the repository root
    old: str  # found exactly once in the file
    new: str
    tests: Tuple[str, ...]  # pytest's arguments: node ids or files relative to the root (and -k EXPR)
    claim: str  # what the tests must notice
    # A C++ mutant in code only one build holds: the tests run with GTPO_CPU_CAPABILITY set to it, and are not
    # run on a CPU that lacks it (reported so). "" = whatever the CPU loads.
    cpu_variant: str = ""


MUTANTS: Tuple[Mutant, ...] = (
    # ---------------------------------------------------------------- a user's task: data, prompts, rewards, trackers
    Mutant(
        "rewards: None scored as 0 instead of 'does not apply'",
        "trainer/scoring.py",
        "            if value is None:\n                continue",
        "            if value is None:\n                value = 0.0",
        ("tests/test_tasks.py::test_none_means_the_reward_does_not_apply",),
        "None leaves the reward out of that completion's sum and mean, as in TRL",
    ),
    Mutant(
        "rewards: a plain sum, so one None makes the completion's reward NaN",
        "trainer/scoring.py",
        "(scores * torch.tensor(weights, dtype=scores.dtype)).nansum(dim=1)",
        "(scores * torch.tensor(weights, dtype=scores.dtype)).sum(dim=1)",
        ("tests/test_tasks.py::test_combine_is_trls_weighted_nansum",),
        "TRL's weighted nansum over the rewards that apply",
    ),
    Mutant(
        "rewards: the failing row not looked for",
        "trainer/scoring.py",
        "        except Exception:  # noqa: BLE001\n            return i",
        "        except Exception:  # noqa: BLE001\n            return None",
        ("tests/test_tasks.py::test_score_names_the_row_and_function",),
        "a reward that raises is reported with the row it raised on",
    ),
    Mutant(
        "rewards: the count not checked",
        "trainer/scoring.py",
        "    if len(values) != n:",
        "    if len(values) > n:",
        ("tests/test_tasks.py::test_a_failing_reward_stops_the_run_in_one_line_with_its_checkpoint_intact",),
        "a reward returning too few values stops the run in one line",
    ),
    Mutant(
        "rewards: a non-finite value let through",
        "trainer/scoring.py",
        " or not math.isfinite(value):",
        ":",
        ("tests/test_tasks.py::test_a_failing_reward_stops_the_run_in_one_line_with_its_checkpoint_intact",),
        "a NaN reward stops the run, naming the function and the row",
    ),
    Mutant(
        "rewards: the columns a reward needs not checked before loading",
        "trainer/scoring.py",
        "        missing = [c for c in required_columns(fn) if c not in columns]",
        "        missing = []",
        ("tests/test_tasks.py::test_a_bad_dataset_or_reward_stops_before_the_model_loads",),
        "a reward needing a column the data lacks is refused before the model loads",
    ),
    Mutant(
        "rewards: a reward file executed once per reward naming it",
        "trainer/scoring.py",
        "    loaded = sys.modules.get(module_name)",
        "    loaded = None",
        ("tests/test_tasks.py::test_a_conversational_jsonl_trains_with_a_reward_file",),
        "two rewards of one file share its module (and its globals)",
    ),
    Mutant(
        "task: conversational completions handed over as strings",
        "trainer/task.py",
        '        return [{"role": "assistant", "content": text}] if self.conversational else text',
        "        return text",
        ("tests/test_tasks.py::test_a_conversational_jsonl_trains_with_a_reward_file",),
        "completions come in the prompt's format, as TRL hands them to reward functions",
    ),
    Mutant(
        "task: --no-chat-template drops the system prompt",
        "trainer/task.py",
        '        return prompt if self.system_prompt is None else f"{self.system_prompt}\\n\\n{prompt}"',
        "        return prompt",
        ("tests/test_tasks.py::test_no_chat_template_puts_the_plain_text_to_the_model",),
        "plain-text prompts keep the system prompt before the prompt",
    ),
    Mutant(
        "task: --max-prompt-length drops nothing",
        "trainer/task.py",
        "            keep = [i for i, n in enumerate(lengths) if n <= limit]",
        "            keep = list(range(len(lengths)))",
        ("tests/test_tasks.py::test_prompts_longer_than_the_limit_are_dropped_and_counted",),
        "the rows with longer prompts are dropped and counted",
    ),
    Mutant(
        "task: the built-in task's maj@k votes on text, not on the number",
        "trainer/task.py",
        "        answer_key=numeric_answer(config.answer_in_block) if numeric else last_answer,",
        "        answer_key=last_answer,",
        ("tests/test_tasks.py::test_the_builtin_task_is_one_task_like_any_other",),
        "the default's maj@k votes on the number its correctness reward reads, as before the task refactor",
    ),
    Mutant(
        "data: a DatasetDict folder read at 'train' whatever the split",
        "trainer/data.py",
        "            ds = ds[split]",
        '            ds = ds["train"]',
        ("tests/test_tasks.py::test_a_save_to_disk_folder_with_a_test_split",),
        "--eval-split test reads the folder's test split",
    ),
    Mutant(
        "data: held-out rows of a split shuffled by the seed",
        "trainer/data.py",
        "held_out.select(range(min(config.eval_size, len(held_out))))",
        "held_out.shuffle(seed=config.seed).select(range(min(config.eval_size, len(held_out))))",
        ("tests/test_tasks.py::test_a_save_to_disk_folder_with_a_test_split",),
        "the held-out rows are the same for every seed",
    ),
    Mutant(
        "evaluation: accuracy reported for a reward that is not 0/1",
        "trainer/evaluation.py",
        "        totals.not_binary += bool((~values.isnan() & (values != 0) & (values != 1)).any())",
        "        totals.not_binary += 0",
        ("tests/test_tasks.py::test_a_conversational_jsonl_trains_with_a_reward_file",),
        "accuracy, pass@k and maj@k only where the accuracy reward is 0 or 1",
    ),
    Mutant(
        "train rows: accuracy logged for a reward that is not 0/1",
        "trainer/train.py",
        "    if not totals.not_binary:",
        "    if True:",
        ("tests/test_tasks.py::test_a_conversational_jsonl_trains_with_a_reward_file",),
        "a step's accuracy only where the accuracy reward is 0 or 1",
    ),
    Mutant(
        "structure: a function grown past 80 lines",
        "trainer/offline/study.py",
        "def mean(values: Sequence[float]) -> float:\n",
        "def mean(values: Sequence[float]) -> float:\n" + "    values = list(values)\n" * 80,
        ("tests/test_structure.py::test_no_function_grows_past_80_lines",),
        "no function over 80 lines but the listed ones, none of which grows",
    ),
    Mutant(
        "train rows: a reward's mean divided by every completion, not those it applies to",
        "trainer/train.py",
        '        figures[f"rewards/{name}"] = value / count if count else None',
        '        figures[f"rewards/{name}"] = value / float(totals.completions)',
        ("tests/test_tasks.py::test_a_conversational_jsonl_trains_with_a_reward_file",),
        "rewards/NAME is the mean over the completions the reward applies to (None where none)",
    ),
    Mutant(
        "tracking: TensorBoard's steps one off",
        "trainer/tracking.py",
        "            self.writer.add_scalar(key, value, global_step=step)",
        "            self.writer.add_scalar(key, value, global_step=step + 1)",
        ("tests/test_tracking.py::test_every_tracker_records_the_metrics_rows",),
        "each tracker holds metrics.jsonl's numbers at their steps",
    ),
    Mutant(
        "tracking: booleans logged as numbers",
        "trainer/tracking.py",
        "        and not isinstance(value, bool)\n",
        "",
        ("tests/test_tracking.py::test_scalars_are_the_rows_numbers_under_their_kind",),
        "only numbers are logged",
    ),
    Mutant(
        "tracking: a missing tracker found only when the run reaches it",
        "trainer/tracking.py",
        "importlib.util.find_spec(PACKAGES[t][0]) is None]",
        "False]",
        ("tests/test_tracking.py::test_a_tracker_that_is_not_installed_stops_before_loading",),
        "a tracker that is not installed stops the run before the model loads, with the pip command",
    ),
    Mutant(
        "evaluation: a reward's failure on one process not shared with the others",
        "trainer/evaluation.py",
        "    stop_together(dist, failed)\n",
        "",
        ("tests/test_trainer_distributed.py::test_a_reward_failing_on_one_process_stops_every_process",),
        "a reward failing on one process stops every process in one line each",
    ),
    Mutant(
        "rewards: math_verify reads answer before solution",
        "trainer/rewards.py",
        "    gold = solution if solution is not None else answer",
        "    gold = answer if answer is not None else solution",
        ("tests/test_tasks.py::test_the_math_verify_reward_reads_solution_then_answer",),
        "the reference is the solution column where there is one (TRL's accuracy_reward reads it)",
    ),
    Mutant(
        "structure: a trainer module imports the script",
        "trainer/offline/answers.py",
        "from ..distributed import Distributed\n",
        "from ..distributed import Distributed\nfrom ..train import main as _script  # noqa: F401\n",
        ("tests/test_structure.py::test_the_trainer_reads_in_short_functions_and_nothing_imports_the_script",),
        "no module imports trainer/train.py",
    ),
    # ---------------------------------------------------------------- the held-out figures' intervals
    Mutant(
        "intervals: the normal approximation instead of Wilson's",
        "trainer/intervals.py",
        "    return max(0.0, min(share, centre - half)), min(1.0, max(share, centre + half))",
        "    half = z * math.sqrt(share * (1 - share) / n)\n    return max(0.0, share - half), min(1.0, share + half)",
        ("tests/test_intervals.py",),
        "the score interval's ends solve its defining equation and match Newcombe's published values; the naive "
        "interval shrinks to a point at 0 and 1",
    ),
    Mutant(
        "intervals: the centre not pulled towards 1/2",
        "trainer/intervals.py",
        "centre = (share + z2n / 2) / (1 + z2n)",
        "centre = share",
        (
            "tests/test_intervals.py::test_bounds_solve_the_score_equation",
            "tests/test_intervals.py::test_published_values",
        ),
        "Wilson's interval is centred between the share and 1/2",
    ),
    Mutant(
        "trainer summary: 'up' when the after figure is above the before interval",
        "trainer/report.py",
        'verdict = "up" if a_low > b_high else',
        'verdict = "up" if after[key] > b_high else',
        ("tests/test_trainer.py::test_the_summary_says_whether_each_figure_moved_beyond_its_interval",),
        "a gain counts only when the two intervals do not overlap (0.50 -> 0.55 of 64 problems is noise)",
    ),
    Mutant(
        "bench trainer: gtpo-train's scoring counted with its sampling",
        "bench/trainer.py",
        '"scoring": row["time_generation"] - totals["sampling"],',
        '"scoring": row["time_generation"],',
        ("tests/test_bench.py::test_trainer_benchmark_harness",),
        "a step's parts add up to at most the step: sampling is not counted twice",
    ),
    Mutant(
        "bench trainer: the timing wrappers left on the trainer module",
        "bench/trainer.py",
        "        for undo in undoes:\n            undo()",
        "        pass",
        ("tests/test_bench.py::test_trainer_benchmark_harness",),
        "the bench's in-process worker leaves gtpo-train's functions as it found them",
    ),
    Mutant(
        "one config: the policy's loss the default GTPOConfig, not the run's",
        "trainer/update.py",
        "keywords = dict(config=config.loss_config(), **rows.row_keywords())",
        "keywords = dict(config=type(config.loss_config())(), **rows.row_keywords())",
        ("tests/test_trainer.py::test_loss_is_on_the_sampling_distribution",),
        "each micro-batch's loss is the one the run's config asks for (here sum, not the preset's sequence_mean)",
    ),
    Mutant(
        "one config: the rollout's advantages not scaled as the run's loss asks",
        "trainer/rollout.py",
        "normalize_std=loss_config.normalize_advantages_by_std)",
        "normalize_std=True)",
        ("tests/test_trainer.py::test_the_rollouts_advantages_and_conflicts_follow_the_runs_one_config",),
        "the rollout's advantages are scaled as the run's loss asks (GTPO's presets centre; GRPO's divide by the std)",
    ),
    Mutant(
        "study: the spec's threads ignored (cores / jobs for every cell)",
        "trainer/offline/study.py",
        "        return self.threads or max(1, (os.cpu_count() or 1) // jobs)",
        "        return max(1, (os.cpu_count() or 1) // jobs)",
        ("tests/test_study.py", "-k", "only_runs"),
        "a spec's threads reach every cell whatever --jobs, so that paired cells differ in their one change only",
    ),
    Mutant(
        "study: an --only pattern without a seed names no cell",
        "trainer/offline/study.py",
        '        return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + "/*")  # any seed',
        "        return fnmatch.fnmatchcase(name, pattern)",
        ("tests/test_study.py", "-k", "only_runs"),
        "--only TASK/VARIANT runs that variant's every seed",
    ),
    Mutant(
        "study: an --only pattern naming no cell not checked before the cells are",
        "trainer/offline/study.py",
        "        chosen(spec.cells(), args.only)  # a pattern that names no cell: one line, before anything runs",
        "        pass",
        ("tests/test_study.py", "-k", "only_runs"),
        "--only with a pattern that names no cell is one line from the command, before any cell is checked or run",
    ),
    Mutant(
        "study: --only's cells not the only ones checked",
        "trainer/offline/study.py",
        "    for cell in chosen(spec.cells(), only):",
        "    for cell in spec.cells():",
        ("tests/test_study.py", "-k", "only_checks"),
        "a session running one task's cells (--only) needs no other task's data",
    ),
    Mutant(
        "study: a training cell's time estimated from evaluation-only cells",
        "trainer/offline/study.py",
        "        lambda c: c.trains == cell.trains,",
        "        lambda c: True,",
        ("tests/test_study.py", "-k", "estimated_from_finished"),
        "the dry run's estimate of a training cell never comes from the untrained model's evaluation-only cells",
    ),
    Mutant(
        "study: a cell's time not estimated from its variant on other tasks",
        "trainer/offline/study.py",
        "        lambda c: c.variant == cell.variant,\n",
        "",
        ("tests/test_study.py", "-k", "estimated_from_finished"),
        "a variant's time on one task estimates it on the others before any mix of variants does",
    ),
    Mutant(
        "study: a variant's change from the untrained model not taken from the untrained figure",
        "trainer/offline/study.py",
        "            change = mean(values) - before",
        "            change = mean(values)",
        ("tests/test_study.py", "-k", "change_from_the_untrained"),
        "each variant's table row shows how far training moved each figure from the untrained model's",
    ),
    Mutant(
        "study: every change from the untrained model marked larger than the seed spread",
        "trainer/offline/study.py",
        '            beyond = " (> spread)" if len(values) > 1 and abs(change) > spread else ""',
        '            beyond = " (> spread)" if len(values) > 1 else ""',
        ("tests/test_study.py", "-k", "change_from_the_untrained"),
        "the mark says training moved a figure by more than the seeds disagree, and only then",
    ),
    Mutant(
        "trainer: summary.json without the machine the run ran on",
        "trainer/report.py",
        '        "machine": None if machine is None else machine.as_dict(),',
        '        "machine": None,',
        ("tests/test_trainer.py", "-k", "test_a_few_steps_run_with_finite_losses"),
        "a run's summary names the CPU (and GPU), cores, bf16 units and torch its minutes are of",
    ),
    Mutant(
        "study: a finished cell's machine not read from its summary",
        "trainer/offline/study.py",
        '    if summary.get("machine"):',
        "    if False:",
        ("tests/test_study.py", "-k", "names_each_cells_machine"),
        "the report names the machine each finished cell ran on, from its summary",
    ),
    Mutant(
        "study: a pair run on two machines not flagged",
        "trainer/offline/study.py",
        "            if mine and theirs and mine != theirs:",
        "            if False:",
        ("tests/test_study.py", "-k", "names_each_cells_machine"),
        "a pair whose cells ran on different machines is listed: its difference holds the machines' too",
    ),
    Mutant(
        "allocator: freed memory not handed back before an evaluation",
        "trainer/allocator.py",
        "    return bool(trim(0))",
        "    return True",
        ("tests/test_allocator.py", "-k", "stay_in_the_process"),
        "release_freed_memory gives training's freed pages back to the kernel (two evaluating cells ran out of memory)",
    ),
    Mutant(
        "evaluation: no release of freed memory before each batch",
        "trainer/evaluation.py",
        "            release_freed_memory()  # (trainer/allocator.py)",
        "            pass",
        ("tests/test_allocator.py", "-k", "first_releases"),
        "every evaluation on the CPU hands training's freed memory back before its cache comes on top",
    ),
    Mutant(
        "study: a cell's code version not recorded",
        "trainer/offline/study.py",
        '"code": code_version(), ',
        "",
        ("tests/test_study.py", "-k", "records_the_code"),
        "study-cell.json holds the commit each cell ran from, so that a pair run across a code change shows",
    ),
    Mutant(
        "study: a cell's machine not recorded where it starts",
        "trainer/offline/study.py",
        ', "machine": str(Machine.this())}',
        "}",
        ("tests/test_study.py", "-k", "records_the_code"),
        "study-cell.json names the machine each cell started on",
    ),
    Mutant(
        "study: a threads value not checked",
        "trainer/offline/study.py",
        "(isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):",
        "(False):",
        ("tests/test_study.py", "-k", "mistake"),
        "a spec's threads of 0 or true is one line naming 'threads'",
    ),
    Mutant(
        "study: the cells' flags and tasks not checked before any runs",
        "trainer/offline/study.py",
        "        if not args.report_only:\n            check_cells(spec, args.only)",
        "        pass",
        ("tests/test_study.py", "-k", "first_second"),
        "a mistake that would stop every cell in its first second stops the study first, naming a cell",
    ),
    Mutant(
        "study: the trainer's checks before loading not run for the cells",
        "trainer/offline/study.py",
        "            check_before_loading(config, world=1)  # a cell is one process",
        "            pass",
        ("tests/test_study.py", "-k", "first_second"),
        "a cell whose --model is not a model stops the study before any cell runs, as gtpo-train would at start",
    ),
    Mutant(
        "study: a cell's task not loaded before any runs",
        "trainer/offline/study.py",
        "            load_task(config, train_size=config.prompts_per_step)",
        "            pass",
        ("tests/test_study.py", "-k", "first_second"),
        "a missing dataset stops the study before any cell runs, naming the cell and the folder paths are read from",
    ),
    Mutant(
        "study: a failed cell listed without its log's last line",
        "trainer/offline/study.py",
        '            said = f": {last[0]}" if last else ""',
        '            said = ""',
        ("tests/test_study.py::test_a_failed_cell_is_listed_with_the_last_line_of_its_log",),
        "a failed cell's line says why, from its log, without opening it",
    ),
    Mutant(
        "bench trainer: the ratio's numerator the checkout that ran first",
        "bench/trainer.py",
        '    first = "gtpo-train"  # this checkout',
        "    first = next(iter(results))  # this checkout",
        ("tests/test_bench.py::test_the_trainer_tables_ratio_is_this_checkouts_step_whichever_ran_first",),
        "with --against-first the ratio is still this checkout's step over the other's",
    ),
    Mutant(
        "bench trainer: --against-first ignored (this checkout always first)",
        "bench/trainer.py",
        "        if args.against_first:\n            runs.reverse()",
        "        pass",
        ("tests/test_bench.py", "-k", "against_first_runs"),
        "--against-first measures the other checkout before this one",
    ),
    Mutant(
        "bench trainer: --against-first passed to an older checkout's parser",
        "bench/trainer.py",
        '"--against-first": 0, ',
        "",
        ("tests/test_bench.py::test_the_trainer_tables_ratio_is_this_checkouts_step_whichever_ran_first",),
        "an older checkout's parser never sees this bench's newer options",
    ),
    Mutant(
        "compare: older summaries' problem count not read from config.json",
        "trainer/offline/compare.py",
        'summary.setdefault("eval_problems", (config or {}).get("eval_size"))',
        'summary.setdefault("eval_problems", None)',
        ("tests/test_compare.py::test_each_seeds_final_figure_comes_with_its_interval",),
        "runs saved before the count was kept still get their intervals, from config.json's eval_size",
    ),
    Mutant(
        "compare: the held-out panel's pass@k and maj@k prefixes not expanded",
        "trainer/offline/compare.py",
        '[key] if not key.endswith("@") else largest(key)',
        "[key]",
        ("tests/test_compare.py::test_the_held_out_panel_draws_pass_and_maj_at_each_k",),
        "the curve of the default's 48 steps plots pass@4 and maj@4 beside greedy accuracy",
    ),
    # ---------------------------------------------------------------- checkpoints: folders, rotation, nothing unpickled
    Mutant(
        "checkpoint: a failed write leaves its partial folder",
        "trainer/checkpoint.py",
        "        shutil.rmtree(tmp, ignore_errors=True)  # a partial folder would hold the space the next write "
        "needs\n",
        "",
        ("tests/test_trainer.py::test_a_checkpoint_that_cannot_be_written_is_one_clear_error_and_leaves_the_last_one",),
        "a checkpoint write that fails part-way (a full disk) removes its partial checkpoint-STEP.tmp folder",
    ),
    Mutant(
        "checkpoint: a full disk's OSError passed through as a traceback",
        "trainer/checkpoint.py",
        "    except (OSError, RuntimeError, ValueError) as exc:  # torch and safetensors report a full disk variously",
        "    except (RuntimeError, ValueError) as exc:",
        ("tests/test_trainer.py::test_a_checkpoint_that_cannot_be_written_is_one_clear_error_and_leaves_the_last_one",),
        "a full disk becomes one line naming the folder, the free space, --save-total-limit and --save-every 0",
    ),
    Mutant(
        "checkpoint: rotation keeps one more than --save-total-limit",
        "trainer/checkpoint.py",
        "checkpoints(out_dir)[:-save_total_limit]",
        "checkpoints(out_dir)[: -save_total_limit - 1]",
        ("tests/test_trainer.py::test_rotation_keeps_the_newest_checkpoints",),
        "--save-total-limit 2 leaves the two newest checkpoint folders",
    ),
    Mutant(
        "checkpoint: --resume takes the oldest checkpoint",
        "trainer/checkpoint.py",
        "        return found[-1][1]",
        "        return found[0][1]",
        ("tests/test_trainer.py::test_rotation_keeps_the_newest_checkpoints",),
        "--resume continues from the newest checkpoint-STEP folder",
    ),
    Mutant(
        "checkpoint: a half-written .tmp folder counts as a checkpoint",
        "trainer/checkpoint.py",
        "(m := NAME.fullmatch(p.name))",
        "(m := NAME.match(p.name))",
        ("tests/test_trainer.py::test_rotation_keeps_the_newest_checkpoints",),
        "a checkpoint-STEP.tmp folder a crash left behind is never resumed from",
    ),
    Mutant(
        "checkpoint: pickled weight files beside the safetensors not refused",
        "trainer/model.py",
        '    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl"))',
        "    pickled = []",
        ("tests/test_real_models.py::test_a_tampered_checkpoint_is_refused_without_running_its_code",),
        "a checkpoint folder holding a pickle (pytorch_model.bin) is refused, naming the file, without opening it",
    ),
    Mutant(
        "checkpoint: weight files not opened before loading",
        "trainer/model.py",
        '    for path in sorted(folder.glob("*.safetensors")):',
        "    for path in []:",
        ("tests/test_real_models.py::test_a_tampered_checkpoint_is_refused_without_running_its_code",),
        "a cut model.safetensors is one error naming that file",
    ),
    Mutant(
        "checkpoint: a resume starts from the base weights, not the checkpoint's",
        "trainer/session.py",
        "weights_from=None if lora else resume_from",
        "weights_from=None",
        ("tests/test_real_models.py::test_full_training_checkpoint_loads_with_from_pretrained_and_resumes_exactly",),
        "a resumed full-training run loads the checkpoint's model (from_pretrained of checkpoint-STEP/)",
    ),
    # ---------------------------------------------------------------- real models: LoRA, KL, bf16 weights, heads
    Mutant(
        "bf16: no float32 master weights",
        "trainer/optimizer.py",
        "        if master and any(p.dtype != torch.float32 for p in self.params):",
        "        if False:",
        ("tests/test_real_models.py::test_master_weights_keep_updates_a_bf16_weight_cannot_hold",),
        "AdamW on float32 copies keeps updates below bf16's resolution, which plain bf16 AdamW loses",
    ),
    Mutant(
        "bf16: the checkpoint leaves the master weights out",
        "trainer/optimizer.py",
        "        if self.master is not None:  # the float32 weights: the bf16 ones in the checkpoint are rounded",
        "        if False:",
        ("tests/test_real_models.py::test_bf16_weights_train_and_resume_exactly",),
        "a bf16 run's checkpoint holds its float32 master weights, so that a resume is exact",
    ),
    Mutant(
        "beta: the reference under LoRA keeps its adapters on",
        "trainer/adapters.py",
        "    with model.disable_adapter():\n        yield model",
        "    yield model",
        ("tests/test_real_models.py::test_beta_logs_the_kl_to_the_starting_policy",),
        "under LoRA the KL's reference is the model with its adapters off: the KL grows as the adapters move",
    ),
    Mutant(
        "beta: the reference log-probs never reach the loss",
        "trainer/rollout.py",
        "            ref_logprobs=pick(self.ref_logprobs),",
        "            ref_logprobs=None,",
        ("tests/test_real_models.py::test_beta_logs_the_kl_to_the_starting_policy",),
        "--beta hands the reference log-probs to the loss's KL term, which the metrics log",
    ),
    Mutant(
        "lora: --merge-lora saves the base model with its adapters unmerged",
        "trainer/report.py",
        "        merged = copy.deepcopy(model).merge_and_unload()",
        "        merged = copy.deepcopy(model).unload()",
        ("tests/test_real_models.py::test_lora_trains_and_saves_only_the_adapters",),
        "final/merged holds the base model with the adapters merged in: its logits are the adapted model's",
    ),
    Mutant(
        "heads: the fused loss ignores a soft-capped head",
        "trainer/update.py",
        "                **head_arguments(self.head),\n",
        "",
        ("tests/test_real_models.py::test_a_soft_capped_head_trains_through_the_fused_loss",),
        "a Gemma-2-style head's soft cap reaches the fused loss: the loss and gradients of the model's own logits",
    ),
    # ---------------------------------------------------------------- sampling knobs and our own cache
    Mutant(
        "sampling: top-p keeps the token that crosses the mass and the next",
        "trainer/sampling.py",
        "        drop = before >= top_p",
        "        drop = before > top_p",
        ("tests/test_sampling.py::test_cut_logits_keeps_what_each_cut_should",),
        "top-p keeps the smallest set of tokens whose probability reaches p",
    ),
    Mutant(
        "sampling: min-p ignored",
        "trainer/sampling.py",
        "    if min_p > 0.0:",
        "    if False:",
        ("tests/test_sampling.py::test_cut_logits_keeps_what_each_cut_should",),
        "min-p drops tokens below min_p times the most likely token's probability",
    ),
    Mutant(
        "sampling: the cut logits not used for the draw",
        "trainer/sampling.py",
        "        return draw_tokens(cut_logits(logits.float() / temperature, top_k, top_p, min_p), uniform=uniform)",
        "        return draw_tokens(logits, temperature, uniform)",
        ("tests/test_sampling.py::test_top_p_sampling_draws_only_from_the_nucleus_in_its_proportions",),
        "sample() draws from the nucleus only, in the renormalised proportions",
    ),
    Mutant(
        "sampling: only the first EOS id ends a row",
        "trainer/sampling.py",
        "        ended = ~finished & torch.isin(next_token, eos)",
        "        ended = ~finished & (next_token == eos[:1])",
        ("tests/test_sampling.py::test_a_row_ends_at_any_eos_id_and_what_follows_is_padding",),
        "any of several EOS ids ends a row, with padding after it",
    ),
    Mutant(
        "sampling: the generation config's EOS ids left out",
        "trainer/rollout.py",
        "    ids += configured if isinstance(configured, (list, tuple)) else [configured]\n",
        "",
        ("tests/test_sampling.py::test_every_eos_id_of_the_generation_config_ends_a_completion",),
        "every EOS id of the model's generation config ends a completion",
    ),
    Mutant(
        "sampling: stop strings looked for in the last token only",
        "trainer/sampling.py",
        "        self.window = max(map(len, self.strings)) + 8",
        "        self.window = 1",
        ("tests/test_sampling.py::test_stop_strings_end_a_row_with_the_token_that_completes_them",),
        "a stop string spanning tokens ends the row at the token that completes it",
    ),
    # ---------------------------------------------------------------- issue 64: the update's grouped attention
    Mutant(
        "grouped attention: the softmax's backward without its row sum",
        "gtpo_kernels/hf/llama_layers.py",
        "    grad_s = grad_p.to(wide).sub_(rowsum)",
        "    grad_s = grad_p.to(wide)",
        ("tests/test_grouped_attention.py::test_grouped_attention_equals_a_float64_softmax_over_every_key",),
        "dS = P * (dP - rowsum(dO * O)): the softmax's backward",
    ),
    Mutant(
        "grouped attention: a prompt's key gradient from its last chunk only",
        "gtpo_kernels/hf/llama_layers.py",
        "                grad_prompt_k[b] += prompt_k_part",
        "                grad_prompt_k[b] = prompt_k_part",
        ("tests/test_grouped_attention.py::test_grouped_attention_equals_a_float64_softmax_over_every_key",),
        "a group's completions split across chunks each add to its prompt keys' gradient",
    ),
    Mutant(
        "grouped attention: the chunks leave completions out",
        "gtpo_kernels/hf/llama_layers.py",
        "(slice(i, i + 1), slice(j, min(j + per_chunk, size)))",
        "(slice(i, i + 1), slice(j, min(j + per_chunk, size - 1)))",
        ("tests/test_grouped_attention.py::test_grouped_attention_equals_a_float64_softmax_over_every_key",),
        "every completion of a group is in one of the chunks",
    ),
    Mutant(
        "grouped pass: every position runs, not only those under the mask",
        "gtpo_kernels/hf/llama_layers.py",
        "    index = completion_mask.bool().flatten().nonzero().squeeze(1)",
        "    index = torch.arange(completion_mask.numel(), device=completion_mask.device)",
        ("tests/test_prefix_sharing.py::test_the_update_runs_the_shared_prefix_once_and_equals_the_whole_rows",),
        "the layers' per-token work runs on the completion tokens only, packed",
    ),
    Mutant(
        "grouped pass: taken on any device",
        "gtpo_kernels/hf/llama_layers.py",
        '    if weight is not None and weight.device.type != "cpu":',
        "    if False:",
        ("tests/test_grouped_attention.py::test_the_grouped_pass_is_taken_only_where_it_is_exact_and_measured",),
        "a GPU keeps transformers' fused attention until this pass is measured there",
    ),
    Mutant(
        "grouped pass: taken in training with attention dropout",
        "gtpo_kernels/hf/llama_layers.py",
        "    if decoder.training and float(",
        "    if False and float(",
        ("tests/test_grouped_attention.py::test_the_grouped_pass_is_taken_only_where_it_is_exact_and_measured",),
        "this pass draws no attention dropout, so a model that would is refused",
    ),
    Mutant(
        "grouped pass: a completion attends to its later positions",
        "gtpo_kernels/hf/llama_layers.py",
        "    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()",
        "    causal = torch.ones(length, length, dtype=torch.bool, device=x.device)",
        (
            "tests/test_hf.py::test_grouped_hidden_states_equal_the_full_rows_in_value_and_gradient",
            "tests/test_prefix_sharing.py::test_the_update_runs_the_shared_prefix_once_and_equals_the_whole_rows",
        ),
        "causal attention among a completion's own positions, as in the whole row's forward",
    ),
    Mutant(
        "grouped pass: a prompt's left padding attended to",
        "gtpo_kernels/hf/llama_layers.py",
        "    prompt_bias = torch.where(prompt_attention.bool(), zero, blocked)",
        "    prompt_bias = torch.where(prompt_attention.bool() | True, zero, blocked)",
        ("tests/test_hf.py::test_grouped_hidden_states_equal_the_full_rows_in_value_and_gradient",),
        "completions attend to their prompt's tokens, not to its left padding",
    ),
    Mutant(
        "grouped pass: Qwen3's per-head q/k norms skipped",
        "gtpo_kernels/hf/llama_layers.py",
        '        if getattr(attn, "q_norm", None) is not None:  # Qwen3: RMSNorm per head before the rotation\n'
        "            q, k = attn.q_norm(q), attn.k_norm(k)\n"
        "        q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # [T",
        "        q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # [T",
        ("tests/test_architectures.py::test_family_shares_prompt_passes_exactly",),
        "Qwen3's q_norm/k_norm apply in the completions' pass as in its forward",
    ),
    # ---------------------------------------------------------------- issue 57: the step at the machine's limit
    Mutant(
        "decode: the shared prefix's keys and values left out of attention",
        "trainer/decode.py",
        "    c = cache.prefix\n",
        "    c = 0\n",
        ("tests/test_sampling.py::test_decode_step_logits_equal_the_whole_sequence_forward",),
        "our step attends to the shared prefix, held once for every row, as the whole-sequence forward does",
    ),
    Mutant(
        "decode: left padding attended to",
        "trainer/decode.py",
        '.masked_fill(~valid, float("-inf"))',
        '.masked_fill(valid & False, float("-inf"))',
        ("tests/test_sampling.py::test_decode_step_logits_equal_the_whole_sequence_forward",),
        "a row attends to its own prompt tokens and the tokens since, not to its left padding nor the empty room",
    ),
    Mutant(
        "decode: Qwen3's per-head q/k norms skipped",
        "trainer/decode.py",
        '        if getattr(attn, "q_norm", None) is not None:',
        "        if False:",
        ("tests/test_sampling.py::test_decode_step_logits_equal_the_whole_sequence_forward",),
        "Qwen3's q_norm/k_norm apply before the rotation, as in its forward",
    ),
    Mutant(
        "decode: the rotation's sign lost",
        "gtpo_kernels/hf/llama_layers.py",
        "    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)",
        "    rotated = torch.cat((x[..., half:], x[..., :half]), dim=-1)",
        ("tests/test_sampling.py::test_decode_step_logits_equal_the_whole_sequence_forward",),
        "the rotary embedding of the half-split layout",
    ),
    # (Writing a token's keys one position late in its row's buffer is an equivalent mutant, not listed: attention
    # does not depend on where in the buffer a key sits, the positions live in the rotation.)
    Mutant(
        "decode: the new token never marked as attended",
        "trainer/decode.py",
        "    cache.valid.index_fill_(1, index, True)\n",
        "",
        ("tests/test_sampling.py::test_decode_step_logits_equal_the_whole_sequence_forward",),
        "each new token attends to itself and the tokens before it",
    ),
    Mutant(
        "decode: a stop request waits for the end of the rollout",
        "trainer/train.py",
        "                on_token=(lambda t: stop.check()) if dist.world == 1 else None,",
        "                on_token=None,",
        ("tests/test_trainer.py::test_a_stop_request_ends_a_rollout_within_a_token",),
        "Ctrl-C during sampling stops within a token (our decoding step runs no layer hooks)",
    ),
    Mutant(
        "decode: a failed compile raises instead of decoding eagerly",
        "trainer/decode.py",
        "            except Exception as exc:  # noqa: BLE001 (a model the compiler cannot take: decode eagerly)\n"
        "                self._fall_back(exc)",
        "            except ImportError as exc:\n                self._fall_back(exc)",
        ("tests/test_sampling.py::test_a_step_the_compiler_cannot_take_falls_back_to_the_eager_step",),
        "a step the compiler cannot take decodes eagerly, with one warning naming why",
    ),
    Mutant(
        "decode: a sliding-window model taken by our step",
        "gtpo_kernels/hf/llama_layers.py",
        '    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):',
        "    if False:",
        ("tests/test_sampling.py::test_models_our_decoder_does_not_take_decode_through_transformers",),
        "models with sliding-window layers keep transformers' decoding",
    ),
    Mutant(
        "decode: the compile's time not logged",
        "trainer/train.py",
        "    if not compiles_decode(session.config, session.dist.device):\n        return {}",
        "    if True:\n        return {}",
        ("tests/test_trainer.py::test_a_compiled_decoding_step_logs_its_compile_time",),
        "under --compile-decode each train row carries the seconds spent compiling the sampler's step",
    ),
    Mutant(
        "precision: bf16 taken whenever it is faster at all",
        "trainer/precision.py",
        "        faster = bf16 <= BF16_MUST_TAKE * fp32",
        "        faster = bf16 <= fp32",
        ("tests/test_precision.py::test_auto_takes_bf16_only_where_it_is_measured_faster",),
        "bf16 only where it is clearly faster (a 10 % win is timing noise)",
    ),
    Mutant(
        "precision: oneDNN's 'supported' trusted again",
        "trainer/precision.py",
        "        faster = bf16 <= BF16_MUST_TAKE * fp32",
        "        faster = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())",
        ("tests/test_precision.py::test_auto_takes_bf16_only_where_it_is_measured_faster",),
        "an AVX-512 CPU that emulates bf16 runs in float32",
    ),
    Mutant(
        "precision: measured again at every call",
        "trainer/precision.py",
        "    if shape not in _measured:\n        fp32 = time_product",
        "    if True:\n        fp32 = time_product",
        ("tests/test_precision.py::test_auto_takes_bf16_only_where_it_is_measured_faster",),
        "the choice is measured once per process and reused by every later autocast",
    ),
    Mutant(
        "precision: a tiny model timed",
        "trainer/precision.py",
        "    if shape not in _measured and shape[0] * shape[1] < TIMED_BELOW:",
        "    if shape not in _measured and shape[0] * shape[1] < 0:",
        ("tests/test_precision.py::test_a_tiny_model_runs_in_float32_untimed",),
        "a tiny model runs in float32 untimed, the same in every process",
    ),
    Mutant(
        "update: the shared prefix run with every prompt",
        "gtpo_kernels/hf/prompt_cache.py",
        "    prompt, cache, prompt_attention, lengths = prompt_pass(decoder, prompt_ids, prompt_mask)",
        "    prompt, cache, prompt_attention, lengths = prompt_pass(\n"
        "        decoder, prompt_ids, prompt_mask, share_prefix=False\n    )",
        ("tests/test_prefix_sharing.py",),
        "the update's decoder and the --beta reference pass run the shared prefix once per micro-batch",
    ),
    Mutant(
        "update: the shared prefix at the wrong positions",
        "gtpo_kernels/hf/prompt_cache.py",
        "        position_ids=torch.arange(c, device=prefix.device)[None],",
        "        position_ids=torch.arange(c, device=prefix.device)[None] + 1,",
        ("tests/test_prefix_sharing.py",),
        "hidden states, gradients (LoRA too) and reference log-probs equal the whole rows'",
    ),
    Mutant(
        "bench trainer: decoding counted for every completion position",
        "bench/trainer.py",
        "    decode_tokens = sum(max(n - 1, 0) for n in lengths)",
        "    decode_tokens = sum(lengths)",
        ("tests/test_bench.py::test_the_roofline_counts_each_phases_products_by_hand",),
        "the roofline's work is each phase's products, counted by hand on the tiny model",
    ),
    # ---------------------------------------------------------------- issue 64: the bf16 step at the CPU's limit
    Mutant(
        "allocator: large blocks still get mappings of their own, unmapped on free",
        "trainer/allocator.py",
        "mallopt(M_MMAP_MAX, 0) and ",
        "",
        ("tests/test_allocator.py::test_freed_blocks_stay_in_the_process",),
        "freed 8 MiB blocks stay in the process for the next step",
    ),
    Mutant(
        "allocator: the session does not apply the settings",
        "trainer/session.py",
        "        keep_freed_memory()  #",
        "        pass  #",
        ("tests/test_allocator.py::test_a_cpu_session_sets_the_allocator",),
        "a CPU training process keeps its freed activations",
    ),
    Mutant(
        "decode: the cache kept in float32 under autocast (cast whole at every layer of every step)",
        "trainer/decode.py",
        "                source = source.to(dtype or source.dtype)\n",
        "",
        ("tests/test_sampling.py::test_under_autocast_the_cache_is_held_in_its_dtype_and_the_logits_stay_the_models",),
        "under bf16 autocast the cache holds bf16",
    ),
    Mutant(
        "decode: compaction drops each kept row's last written position",
        "trainer/decode.py",
        "buffer[:kept, :, :used] = buffer[rows, :, :used]",
        "buffer[:kept, :, : used - 1] = buffer[rows, :, : used - 1]",
        ("tests/test_sampling.py::test_rows_that_end_leave_the_batch_and_the_rows_that_go_on_take_the_same_tokens",),
        "the rows that go on take the tokens they take when every row decodes to the end",
    ),
    Mutant(
        "sampling: the rows that go on keep the positions of the rows that were there",
        "trainer/sampling.py",
        "            rows[0] = rows[0][kept]\n",
        "",
        ("tests/test_sampling.py::test_rows_that_end_leave_the_batch_and_the_rows_that_go_on_take_the_same_tokens",),
        "each kept row decodes at its own position",
    ),
    Mutant(
        "sampling: one number per row still decoding, so a compacted row draws another",
        "trainer/sampling.py",
        "torch.rand((rows, 1), dtype=torch.float64, device=device)[alive]",
        "torch.rand((alive.numel(), 1), dtype=torch.float64, device=device)",
        ("tests/test_sampling.py::test_rows_that_end_leave_the_batch_and_the_rows_that_go_on_take_the_same_tokens",),
        "a row draws the same number whether or not others left the batch",
    ),
    Mutant(
        "sampling: attention reads one position short (the token just written left out)",
        "trainer/sampling.py",
        "used=start + step + 1)",
        "used=start + step)",
        ("tests/test_sampling.py::test_rows_that_end_leave_the_batch_and_the_rows_that_go_on_take_the_same_tokens",),
        "the step's attention reads every position written, its own token's included",
    ),
    Mutant(
        "decode: the written positions read one short",
        "trainer/decode.py",
        "    used = bias.shape[-1]\n",
        "    used = bias.shape[-1] - 1\n    bias = bias[..., :used]\n",
        ("tests/test_sampling.py::test_decode_step_logits_equal_the_whole_sequence_forward",),
        "the step's logits are the whole-sequence forward's when it reads only the positions written",
    ),
    Mutant(
        "bench trainer: decoding's attention left out of the roofline's FLOPs",
        "bench/trainer.py",
        "* decode_tokens + pair * decode_pairs)",
        "* decode_tokens)",
        ("tests/test_bench.py::test_the_roofline_counts_each_phases_products_by_hand",),
        "each phase's FLOPs include attention's, counted by hand",
    ),
    Mutant(
        "bench trainer: a row's last token counted as decoded",
        "bench/trainer.py",
        "decode_tokens = sum(max(n - 1, 0) for n in lengths)",
        "decode_tokens = rows * (length - 1)",
        ("tests/test_bench.py::test_the_roofline_counts_each_phases_products_by_hand",),
        "decoding runs each row's tokens but its last, not the longest row's for every row",
    ),
    Mutant(
        "bench trainer: --precision auto left in the argv handed to an older checkout",
        "bench/trainer.py",
        'argv = without_option(argv, "--precision") + ["--precision", choice.name]',
        'argv = argv + ["--precision", choice.name]',
        ("tests/test_bench.py::test_precision_auto_is_resolved_once_and_passed_to_both_checkouts",),
        "both checkouts get the resolved precision and no 'auto' an older parser refuses",
    ),
    # ---------------------------------------------------------------- issue 65: one-answer collapse measured
    Mutant(
        "evaluation: a problem left unanswered counted as one more distinct answer",
        "trainer/evaluation.py",
        "    given = answers_given(answers)\n",
        "    given = Counter(answers)\n",
        ("tests/test_answers.py::test_every_evaluation_counts_distinct_greedy_answers_and_warns_of_one_answer",),
        "distinct answers count the answers given, not the problems left unanswered",
    ),
    Mutant(
        "evaluation: the top answer's share of the answered problems, not of all",
        "trainer/evaluation.py",
        '"top_answer_share": top / problems if problems else 0.0',
        '"top_answer_share": top / sum(given.values()) if given else 0.0',
        ("tests/test_answers.py::test_every_evaluation_counts_distinct_greedy_answers_and_warns_of_one_answer",),
        "the top answer's share is of every held-out problem",
    ),
    Mutant(
        "evaluation: no warning of one answer",
        "trainer/evaluation.py",
        "        warn_of_one_answer(answers, float(totals.problems), desc)\n",
        "        pass\n",
        ("tests/test_answers.py::test_every_evaluation_counts_distinct_greedy_answers_and_warns_of_one_answer",),
        "a run warns where one greedy answer passes half the problems",
    ),
    Mutant(
        "evaluation: pass@k's estimate draws with replacement",
        "trainer/evaluation.py",
        "        miss *= 1.0 - k / i\n",
        "        miss *= 1.0 - 1 / i\n",
        (
            "tests/test_answers.py::test_pass_at_k_is_the_share_of_k_sample_subsets_holding_a_right_one",
            "tests/test_answers.py::test_every_evaluation_reports_pass_at_k_to_eval_k_and_the_reasoning_share",
        ),
        "pass@k is the unbiased estimate: k samples drawn without replacement",
    ),
    Mutant(
        "evaluation: pass@k at every k, not at powers of two",
        "trainer/evaluation.py",
        "        k *= 2\n",
        "        k += 1\n",
        (
            "tests/test_answers.py::test_pass_at_k_is_the_share_of_k_sample_subsets_holding_a_right_one",
            "tests/test_answers.py::test_every_evaluation_reports_pass_at_k_to_eval_k_and_the_reasoning_share",
        ),
        "pass@1, @2, @4, ... up to eval_k",
    ),
    Mutant(
        "evaluation: the greedy completion counted among pass@k's samples",
        "trainer/evaluation.py",
        "            samples_right = int(right[1:].sum())\n",
        "            samples_right = int(right.sum())\n",
        ("tests/test_answers.py::test_every_evaluation_reports_pass_at_k_to_eval_k_and_the_reasoning_share",),
        "pass@k is of the eval_k samples only",
    ),
    Mutant(
        "evaluation: any word besides the answer counted as reasoning",
        "trainer/evaluation.py",
        "        totals.reasoning += sum(w >= REASONING_MIN_WORDS for w in words)\n",
        "        totals.reasoning += sum(w > 0 for w in words)\n",
        ("tests/test_answers.py::test_every_evaluation_reports_pass_at_k_to_eval_k_and_the_reasoning_share",),
        "a completion reasons where it writes at least 10 words besides its answer",
    ),
    Mutant(
        "task: the reasoning tags counted as words",
        "trainer/task.py",
        '        return _TAGS.sub(" ", _ANSWER_BLOCK.sub(" ", text))\n',
        '        return _ANSWER_BLOCK.sub(" ", text)\n',
        (
            "tests/test_answers.py::test_every_evaluation_reports_pass_at_k_to_eval_k_and_the_reasoning_share",
            "tests/test_answers.py::test_the_reasoning_is_what_a_completion_writes_besides_its_answer",
        ),
        "the reasoning's words are the completion's own, not its layout",
    ),
    Mutant(
        "compare: the held-out panel draws the smallest k's pass@k",
        "trainer/offline/compare.py",
        "max(ks, key=lambda f: int(f[len(prefix) :]))",
        "min(ks, key=lambda f: int(f[len(prefix) :]))",
        ("tests/test_compare.py::test_the_held_out_panel_draws_pass_and_maj_at_each_k",),
        "the panel draws pass@k at k = eval_k",
    ),
    # ---------------------------------------------------------------- issue 65: the reasoning recipe
    Mutant(
        "workings: chain_sum's subtraction written as an addition",
        "examples/reasoning_gym/workings.py",
        'after = total + int(term) if op == "+" else total - int(term)',
        "after = total + int(term)",
        ("tests/test_reasoning_gym_example.py::test_each_working_ends_on_the_entrys_answer",),
        "each working ends on reasoning-gym's answer",
    ),
    Mutant(
        "workings: letter_counting counts one case only",
        "examples/reasoning_gym/workings.py",
        "        here = word.lower().count(letter.lower())\n",
        "        here = word.count(letter)\n",
        ("tests/test_reasoning_gym_example.py::test_each_working_ends_on_the_entrys_answer",),
        "the letter's count is reasoning-gym's (either case)",
    ),
    Mutant(
        "make_data: the reasoning recipe's worked example reasons 'The answer is X.'",
        "examples/reasoning_gym/make_data.py",
        'working(task, entry) if recipe == "reasoning" else',
        "working(task, entry) if False else",
        (
            "tests/test_reasoning_gym_example.py::test_the_reasoning_recipe_shows_its_steps_and_refuses_a_task_without_them",
        ),
        "--recipe reasoning shows the working step by step",
    ),
    Mutant(
        "make_data: the reasoning recipe keeps the short answer's system turn",
        "examples/reasoning_gym/make_data.py",
        "    system = SYSTEM_PROMPTS[args.recipe]\n",
        '    system = SYSTEM_PROMPTS["answer"]\n',
        (
            "tests/test_reasoning_gym_example.py::test_the_reasoning_recipe_shows_its_steps_and_refuses_a_task_without_them",
        ),
        "--recipe reasoning asks for the working step by step",
    ),
    # ---------------------------------------------------------------- issue 65: remedies as settings
    Mutant(
        "update: a mini-batch's loss divided by the whole batch's counts",
        "trainer/update.py",
        "    mask = rollout.completions.completion_mask[first * rollout.group_size : end * rollout.group_size]\n",
        "    mask = rollout.completions.completion_mask\n",
        ("tests/test_trainer.py::test_mini_batches_step_on_each_share_of_the_groups_and_let_the_clip_bind",),
        "each mini-batch's loss is divided by its own tokens",
    ),
    Mutant(
        "train: every mini-batch steps on the whole batch",
        "trainer/train.py",
        "            result = update(policy, session.optimizer, batch, config, dist, state.initial_entropy, groups)\n",
        "            result = update(policy, session.optimizer, batch, config, dist, state.initial_entropy, None)\n",
        ("tests/test_trainer.py::test_mini_batches_step_on_each_share_of_the_groups_and_let_the_clip_bind",),
        "--mini-batches M steps on each 1/M of the prompt groups in turn",
    ),
    Mutant(
        "train: mini-batches without the sampling policy's log-probs",
        "trainer/train.py",
        "    off_policy = config.updates_per_rollout > 1",
        "    off_policy = config.num_iterations > 1",
        ("tests/test_trainer.py::test_mini_batches_step_on_each_share_of_the_groups_and_let_the_clip_bind",),
        "the later mini-batches' ratio is to the sampling policy, so the clip binds",
    ),
    Mutant(
        "config: --epsilon-high not passed to the loss",
        "trainer/config.py",
        '            overrides["clip_eps_high"] = float(self.epsilon_high)\n',
        "            pass\n",
        ("tests/test_trainer.py::test_mini_batches_step_on_each_share_of_the_groups_and_let_the_clip_bind",),
        "--epsilon-high sets the clip's upper side",
    ),
    Mutant(
        "config: a clip that cannot bind accepted",
        "trainer/config.py",
        "self.epsilon_high is not None) and self.updates_per_rollout == 1:",
        "self.epsilon_high is not None) and False:",
        ("tests/test_trainer.py::test_mini_batches_step_on_each_share_of_the_groups_and_let_the_clip_bind",),
        "--epsilon with one step per rollout batch is refused",
    ),
    Mutant(
        "objective: the scoped entropy shift still reaches tied groups",
        "gtpo_kernels/objective.py",
        "            shift = torch.where(advantages != 0, shift, torch.zeros_like(shift))\n",
        "            pass\n",
        (
            "tests/test_parity.py::test_the_entropy_shift_scoped_to_nonzero_advantages",
            "tests/test_fused_linear.py::test_the_entropy_shift_scoped_to_nonzero_advantages",
        ),
        "every backend, the fused path included, leaves a tied group unshifted under the scope",
    ),
    Mutant(
        "reference: the oracle ignores the entropy shift's scope",
        "gtpo_kernels/reference.py",
        '(config.entropy_shift_scope == "all" or a != 0)',
        "True",
        ("tests/test_parity.py::test_the_entropy_shift_scoped_to_nonzero_advantages",),
        "the float64 oracle's tied group gives no gradient under the scope",
    ),
    Mutant(
        "config: --entropy-shift-scope not passed to the loss",
        "trainer/config.py",
        '            overrides["entropy_shift_scope"] = self.entropy_shift_scope\n',
        "            pass\n",
        ("tests/test_trainer.py::test_the_entropy_shift_scope_reaches_the_loss_and_is_refused_without_a_shift",),
        "the trainer's flag sets the loss's scope",
    ),
    Mutant(
        "GTPOConfig: the scope accepted with the entropy penalty",
        "gtpo_kernels/config.py",
        'if self.entropy_shift_scope != "all" and self.entropy_mode != "advantage_shift":',
        "if False:",
        ("tests/test_config.py::test_the_entropy_shift_scope_is_checked",),
        "a scope of the shift is refused where there is no shift",
    ),
    # ---------------------------------------------------------------- issue 58's study runner
    Mutant(
        "study: finished cells run again",
        "trainer/offline/study.py",
        '        if (self.folder / "summary.json").exists():\n            return "finished"',
        '        if False:\n            return "finished"',
        ("tests/test_study.py::test_a_smoke_study_runs_resumes_and_reports_paired_differences",),
        "a cell with a summary.json is skipped: a second call runs nothing",
    ),
    Mutant(
        "reasoning-gym data: only --train draws, most of them held-out questions",
        "examples/reasoning_gym/make_data.py",
        "    draws = args.train + args.test + 1",
        "    draws = args.train",
        (
            "tests/test_reasoning_gym_example.py::test_the_training_rows_are_as_many_as_asked_though_the_seeds_streams_overlap",
        ),
        "the training rows are as many as --train asks, none held out",
    ),
    Mutant(
        "bench fused_linear: --remedies adds no rows",
        "bench/fused_linear.py",
        "    if remedies:\n",
        "    if False:\n",
        ("tests/test_bench.py::test_fused_linear_benchmark_rows_for_the_settings_against_collapse",),
        "the settings against collapse have their bench rows beside today's loss",
    ),
    Mutant(
        "study: the report's mechanisms table left empty",
        "trainer/offline/study.py",
        "            mechanisms.append(mechanisms_row(task, variant, runs))",
        "            pass",
        ("tests/test_study.py::test_a_smoke_study_runs_resumes_and_reports_paired_differences",),
        "each variant's filter, conflict, clip and signal fractions are in the report",
    ),
    Mutant(
        "study: the mechanisms table's signal column reads the filtered fraction",
        "trainer/offline/study.py",
        '    ("with signal", "signal_fraction"),',
        '    ("with signal", "filtered_fraction"),',
        ("tests/test_study.py::test_a_smoke_study_runs_resumes_and_reports_paired_differences",),
        "each column of the mechanisms table is its own step figure",
    ),
    Mutant(
        "study: an interrupted cell started afresh",
        "trainer/offline/study.py",
        '        resume = ["--resume"] if self.state == "interrupted" else []',
        "        resume = []",
        ("tests/test_study.py::test_a_smoke_study_runs_resumes_and_reports_paired_differences",),
        "a cell killed after a checkpoint continues from it with --resume",
    ),
    Mutant(
        "study: the paired difference taken the other way round",
        "trainer/offline/study.py",
        "[final_metrics(o)[metric] - final_metrics(b)[metric] for b, o in pairs]",
        "[final_metrics(b)[metric] - final_metrics(o)[metric] for b, o in pairs]",
        ("tests/test_study.py::test_the_report_pairs_each_seed_with_the_baseline",),
        "each variant minus the baseline, seed by seed, as read from the summaries",
    ),
    Mutant(
        "study: the bootstrap resamples one value",
        "trainer/offline/study.py",
        "sum(rng.choice(values) for _ in range(n))",
        "sum(values[0] for _ in range(n))",
        ("tests/test_study.py::test_the_bootstrap_interval_holds_the_mean_and_narrows_with_agreement",),
        "the interval comes from resampling the seeds' differences",
    ),
    # ---------------------------------------------------------------- issue 58's study, second session
    Mutant(
        "study: the t interval with the normal quantile",
        "trainer/intervals.py",
        "    half = (T975[n - 2] if n - 1 <= len(T975) else Z95) * sd / math.sqrt(n)",
        "    half = Z95 * sd / math.sqrt(n)",
        ("tests/test_study.py::test_the_report_pairs_each_seed_with_the_baseline",),
        "a mean of few seeds has Student's t interval (two seeds: +-12.7 standard errors), not the normal's",
    ),
    Mutant(
        "study: the verdict read from the bootstrap",
        "trainer/offline/study.py",
        "        return t_interval(self.differences)",
        "        return bootstrap_interval(self.differences)",
        ("tests/test_study.py::test_the_bootstrap_interval_holds_the_mean_and_narrows_with_agreement",),
        "four seeds, three agreeing: the bootstrap excludes 0, the t interval (the verdict's) does not",
    ),
    Mutant(
        "study: a reference variant paired",
        "trainer/offline/study.py",
        "        if mine.reference or variant == self.baseline:",
        "        if variant == self.baseline:",
        ("tests/test_study.py::test_variants_run_their_own_seeds_and_tasks_and_pair_with_their_partner",),
        "the untrained model's cell is shown, not paired",
    ),
    Mutant(
        "study: a variant's own seeds ignored",
        "trainer/offline/study.py",
        "        return self.variants[variant].seeds or self.seeds",
        "        return self.seeds",
        ("tests/test_study.py::test_variants_run_their_own_seeds_and_tasks_and_pair_with_their_partner",),
        "a variant given seeds runs those only",
    ),
    Mutant(
        "study: a variant's own tasks ignored",
        "trainer/offline/study.py",
        "        return self.variants[variant].tasks or tuple(self.tasks)",
        "        return tuple(self.tasks)",
        ("tests/test_study.py::test_variants_run_their_own_seeds_and_tasks_and_pair_with_their_partner",),
        "a variant given tasks runs those only",
    ),
    Mutant(
        "study: against ignored",
        "trainer/offline/study.py",
        "        return mine.against or self.baseline",
        "        return self.baseline",
        ("tests/test_study.py::test_variants_run_their_own_seeds_and_tasks_and_pair_with_their_partner",),
        "a variant is paired with its against (the stress GTPO with the stress GRPO)",
    ),
    Mutant(
        "study: a cell's recorded flags not compared",
        "trainer/offline/study.py",
        "            if recorded is not None and recorded != list(cell.flags):",
        "            if False:",
        ("tests/test_study.py::test_a_cell_run_with_other_flags_is_refused_before_anything_runs",),
        "a cell another spec ran with other flags is refused",
    ),
    Mutant(
        "study: the untrained figures not a run's first evaluation",
        "trainer/offline/study.py",
        '            run["evals"].insert(0, {**untrained, "step": 0})',
        "            pass",
        ("tests/test_study.py::test_the_untrained_figures_are_each_runs_first_evaluation",),
        "a run ending far below the untrained model counts as collapsed",
    ),
    Mutant(
        "study: models kept with keep_models false",
        "trainer/offline/study.py",
        '    if status == 0 and not keep_models and cell.state == "finished":',
        "    if False:",
        ("tests/test_study.py::test_a_smoke_study_runs_resumes_and_reports_paired_differences",),
        "keep_models: false deletes a finished cell's checkpoints and final model",
    ),
    Mutant(
        "trainer: evaluated before training despite --no-eval-before",
        "trainer/train.py",
        "        if state.eval_step < 0 and config.eval_before and config.steps > 0:",
        "        if state.eval_step < 0 and config.steps > 0:",
        ("tests/test_study.py::test_a_smoke_study_runs_resumes_and_reports_paired_differences",),
        "the study's cells log no step-0 evaluation",
    ),
    Mutant(
        "trainer: --steps 0 evaluates twice",
        "trainer/train.py",
        "        if state.eval_step < 0 and config.eval_before and config.steps > 0:",
        "        if state.eval_step < 0 and config.eval_before:",
        ("tests/test_trainer.py::test_steps_0_only_evaluates_the_model_once",),
        "the untrained model's cell logs one evaluation",
    ),
    Mutant(
        "trainer: --steps -1 accepted",
        "trainer/config.py",
        '        for name in ("steps", "warmup_steps", "eval_every", "eval_k", "save_every", "seed"):',
        '        for name in ("warmup_steps", "eval_every", "eval_k", "save_every", "seed"):',
        ("tests/test_trainer.py::test_every_bad_setting_stops_before_loading_in_one_line",),
        "--steps must be a non-negative integer, in one line before loading",
    ),
    Mutant(
        "trainer: --loss-reduction ignored",
        "trainer/config.py",
        '            overrides["loss_reduction"] = self.loss_reduction',
        "            pass",
        ("tests/test_trainer.py::test_loss_reduction_token_mean_on_grpo_is_trls_dapo",),
        "--algo grpo --loss-reduction token_mean is TRL's dapo",
    ),
    Mutant(
        "plots: a run without train rows fails",
        "trainer/offline/plots.py",
        "    first = train[0] if train else {}",
        "    first = train[0]",
        ("tests/test_study.py::test_a_run_without_train_rows_is_plotted",),
        "a --steps 0 run's plot is drawn",
    ),
    Mutant(
        "make_data: held-out repeats kept",
        "examples/reasoning_gym/make_data.py",
        '        if distinct and entry["question"] in seen:',
        "        if False:",
        ("tests/test_reasoning_gym_example.py::test_held_out_questions_are_distinct_and_not_trained_on",),
        "every held-out question once",
    ),
    Mutant(
        "reasoning-gym reward: partial credit counted as solved",
        "examples/reasoning_gym/reward.py",
        "    return [1.0 if score == 1.0 else 0.0 for score in",
        "    return [1.0 if score > 0 else 0.0 for score in",
        ("tests/test_reasoning_gym_example.py::test_solved_is_reasoning_gyms_full_marks",),
        "solved is reasoning-gym's full marks",
    ),
    Mutant(
        "held-out answers: every sample counted right",
        "trainer/evaluation.py",
        '                        "samples_right": int((problem.scores[1:, acc] == 1).sum()),',
        '                        "samples_right": len(problem.texts) - 1,',
        ("tests/test_answers.py::test_the_final_evaluation_writes_each_problems_greedy_answer",),
        "each problem's count of right samples, as pass@k reads them",
    ),
    Mutant(
        "held-out answers: the completion, not its answer",
        "trainer/train.py",
        '            key = session.task.answer_key(row["completion"])',
        '            key = row["completion"]',
        ("tests/test_answers.py::test_the_final_evaluation_writes_each_problems_greedy_answer",),
        "the answer by the task's rule (the number the built-in task votes on)",
    ),
    Mutant(
        "held-out answers: every greedy answer written right",
        "trainer/train.py",
        '                "correct": row["correct"],',
        '                "correct": True,',
        ("tests/test_answers.py::test_the_final_evaluation_writes_each_problems_greedy_answer",),
        "whether the accuracy reward scored the greedy answer 1",
    ),
    Mutant(
        "resume: the final evaluation run and logged again",
        "trainer/train.py",
        "        if state.after_step == state.step:  # a run stopped after its final evaluation",
        "        if False:  # a run stopped after its final evaluation",
        ("tests/test_trainer.py::test_resume_anywhere_reproduces_the_uninterrupted_run",),
        "a run killed while saving its model resumes to the uninterrupted run's log (one final evaluation)",
    ),
    Mutant(
        "resume: the final evaluation's row logged twice",
        "trainer/train.py",
        "    if state.after_step != state.step:  # (a resumed run logged it before it stopped)",
        "    if True:  # (a resumed run logged it before it stopped)",
        ("tests/test_trainer.py::test_resume_anywhere_reproduces_the_uninterrupted_run",),
        "a run killed while saving its model resumes to the uninterrupted run's log (one final evaluation)",
    ),
    Mutant(
        "study: the answers' spread counted by the first answer",
        "trainer/offline/study.py",
        "        top, n = Counter(answers).most_common(1)[0]",
        "        top, n = answers[0], Counter(answers)[answers[-1]]",
        ("tests/test_study.py::test_the_untrained_figures_are_each_runs_first_evaluation",),
        "the most common greedy answer and its share (3 of 4 problems answered 1)",
    ),
    Mutant(
        "study: a run with one answer for every problem not counted as collapsed",
        "trainer/offline/study.py",
        "        return self.share >= ONE_ANSWER",
        "        return self.share > ONE_ANSWER",
        ("tests/test_study.py::test_a_run_answering_one_thing_to_every_problem_has_collapsed",),
        "one greedy answer on at least 90 % of the problems is a collapse, whatever the accuracy",
    ),
    Mutant(
        "study: answers compared in file order, not problem by problem",
        "trainer/offline/study.py",
        '    return [str(row["answer"]) for row in sorted(rows, key=lambda row: row["problem"])]',
        '    return [str(row["answer"]) for row in rows]',
        ("tests/test_study.py::test_paired_cells_are_compared_answer_by_answer",),
        "two cells' answers are paired by problem",
    ),
    Mutant(
        "study: the final entropy over every step",
        "trainer/offline/study.py",
        '    last = [t["entropy"] for t in run["train"][-3:]]',
        '    last = [t["entropy"] for t in run["train"]]',
        ("tests/test_study.py::test_the_final_train_entropy_is_paired_too",),
        "the final entropy is the last 3 steps' mean, paired seed by seed",
    ),
    Mutant(
        "study: a verdict from two seeds",
        "trainer/offline/study.py",
        "MIN_SEEDS_FOR_VERDICT = 3",
        "MIN_SEEDS_FOR_VERDICT = 2",
        ("tests/test_study.py::test_the_bootstrap_interval_holds_the_mean_and_narrows_with_agreement",),
        "two seeds that agree give a zero-width interval: no verdict below three seeds",
    ),
    Mutant(
        "compare: an empty panel kept",
        "trainer/offline/compare.py",
        "    return [c if drawable(c) else FALLBACK.get(c[0], c) for c in CURVES]",
        "    return list(CURVES)",
        ("tests/test_compare.py::test_a_task_without_a_held_out_format_rate_shows_the_rollouts_accuracy_instead",),
        "a task without a held-out format rate shows the rollouts' accuracy in its place",
    ),
    Mutant(
        "compare: a setting an older run lacks left out of the comparison",
        "trainer/offline/compare.py",
        "    known = [with_defaults(c) for c in configs if c]",
        "    known = [c for c in configs if c]",
        ("tests/test_compare.py::test_a_setting_an_older_run_lacks_counts_at_its_default",),
        "a LoRA run against full-training runs saved before --lora-r existed is a variant named by lora_r",
    ),
    Mutant(
        "compare: runs at another precision or learning rate pooled with the seeds",
        "trainer/offline/compare.py",
        "    settings = differing_settings([config for _, config in found])",
        "    settings = []",
        ("tests/test_compare.py::test_runs_that_differ_in_more_than_their_seed_are_not_one_variant",),
        "a float32 run among bf16 seeds (or an lr 3e-5 one among lr 2e-5 seeds) is its own variant, not a seed",
    ),
    Mutant(
        "compare: runs split by their folder and evaluation cadence",
        "trainer/offline/compare.py",
        "set.intersection(*(set(c) for c in known)) - NOT_A_VARIANT - LOSS_SETTINGS",
        "set.intersection(*(set(c) for c in known)) - LOSS_SETTINGS",
        ("tests/test_compare.py::test_runs_that_differ_in_more_than_their_seed_are_not_one_variant",),
        "seeds that differ in output_dir or eval_every are still one variant",
    ),
    Mutant(
        "compare: one run's gain called larger than its spread",
        "trainer/offline/compare.py",
        'if len(runs) > 1 else "- (one seed)"',
        'if len(runs) > 0 else "- (one seed)"',
        ("tests/test_compare.py::test_tables_and_plot",),
        "a variant of one run has no spread to beat: its verdict is '- (one seed)', not 'yes'",
    ),
    # ---------------------------------------------------------------- the default run (issue 39)
    Mutant(
        "data: the training stream drawn freely",
        "trainer/data.py",
        "train_size, seed=seed, difficulty=difficulty, balanced=True, exclude=",
        "train_size, seed=seed, difficulty=difficulty, balanced=False, exclude=",
        ("tests/test_trainer.py::test_training_stream_mixes_the_operations_evenly",),
        "every step's prompts mix the operations evenly (a stream that drifted to one taught it everywhere)",
    ),
    Mutant(
        "data: a held-out problem redrawn with any operation",
        "trainer/data.py",
        "            q, a = _problem(rng, difficulty, kind)\n        questions",
        "            q, a = _problem(rng, difficulty)\n        questions",
        ("tests/test_trainer.py::test_training_stream_mixes_the_operations_evenly",),
        "a training problem drawn again because it is held out keeps its place's operation",
    ),
    Mutant(
        "answers: a sample judged instead of the greedy answer",
        "trainer/evaluation.py",
        '"completion": problem.texts[0],\n                        "correct": bool(problem.scores[0, acc] == 1),',
        '"completion": problem.texts[1],\n                        "correct": bool(problem.scores[1, acc] == 1),',
        ("tests/test_answers.py::test_wrong_greedy_answers_come_from_the_final_evaluation",),
        "the wrong answers listed are the greedy ones the summary's accuracy counts",
    ),
    Mutant(
        "answers: the training problems instead of the held-out ones",
        "trainer/offline/answers.py",
        "    task = load_task(config, train_size=config.prompts_per_step)\n",
        "    task = load_task(config, train_size=config.prompts_per_step)\n"
        "    task.held_out = task.train.select(range(len(task.held_out)))\n",
        ("tests/test_answers.py::test_wrong_greedy_answers_come_from_the_final_evaluation",),
        "the report is of the run's held-out problems",
    ),
    # ---------------------------------------------------------------- the token draw in two levels
    Mutant(
        "sampling: the entry looked up without the earlier blocks' mass",
        "trainer/sampling.py",
        "    within = within + before\n",
        "",
        (
            "tests/test_sampling.py::test_draw_tokens_inverts_the_whole_cumulative_distribution",
            "tests/test_sampling.py::test_draw_tokens_follows_the_tempered_distribution",
        ),
        "the block-then-entry lookup takes the token of one cumulative sum over the whole vocabulary",
    ),
    Mutant(
        "sampling: the block chosen by the sum before it, not its own",
        "trainer/sampling.py",
        "block = torch.searchsorted(block_cdf, u, right=True)",
        "block = torch.searchsorted(block_cdf, u, right=False)",
        ("tests/test_sampling.py::test_draw_tokens_at_the_ends_of_the_draw_take_the_first_and_last_possible_tokens",),
        "the lowest draw skips whole blocks of probability 0 to the first possible token",
    ),
    Mutant(
        "sampling: the draw not kept under its block's entry-by-entry sum",
        "trainer/sampling.py",
        "    u = torch.minimum(u, torch.nextafter(within[:, -1:], torch.zeros_like(u)))\n",
        "",
        ("tests/test_sampling.py::test_the_highest_draw_stays_in_its_block_when_the_block_sums_round_apart",),
        "a draw between the two roundings of a block's sum would take the entry past the block's end",
    ),
    Mutant(
        "sampling: a vocabulary's last partial block left unpadded",
        "trainer/sampling.py",
        "    if blocks * DRAW_BLOCK != vocab:",
        "    if False:",
        ("tests/test_sampling.py::test_draw_tokens_inverts_the_whole_cumulative_distribution",),
        "a vocabulary that is not a whole number of blocks (V = 515, 5137) is still drawn from",
    ),
    # ---------------------------------------------------------------- grouped-query attention on the CPU
    Mutant(
        "model: SDPA's grouped-query attention left off in a float32 run on the CPU",
        "trainer/model.py",
        '        os.environ.setdefault(FORCE_GQA, "1")',
        '        os.environ.setdefault(FORCE_GQA, "0")',
        (
            "tests/test_cpu_attention.py::test_a_float32_run_on_the_cpu_turns_grouped_query_attention_on_and_keeps_a_users_choice",
        ),
        "loading a float32 run's policy on a CPU turns transformers' switch on",
    ),
    Mutant(
        "model: the user's own setting of the switch overwritten",
        "trainer/model.py",
        '        os.environ.setdefault(FORCE_GQA, "1")',
        '        os.environ[FORCE_GQA] = "1"',
        (
            "tests/test_cpu_attention.py::test_a_float32_run_on_the_cpu_turns_grouped_query_attention_on_and_keeps_a_users_choice",
        ),
        "a value the user set is kept",
    ),
    Mutant(
        "trainer: grouped-query attention turned on under bf16 autocast too",
        "trainer/session.py",
        'if dist.device.type == "cpu" and not precision.bf16 and dtype == torch.float32:',
        'if dist.device.type == "cpu" and dtype == torch.float32:',
        (
            "tests/test_cpu_attention.py::test_a_float32_run_on_the_cpu_turns_grouped_query_attention_on_and_keeps_a_users_choice",
        ),
        "transformers' own attention path stays under bf16 autocast, where the grouped kernel decodes slower",
    ),
    # ---------------------------------------------------------------- the trainer on several processes
    Mutant(
        "trainer: no world-size factor on the loss",
        "trainer/update.py",
        "(out.loss * dist.world).backward()",
        "out.loss.backward()",
        ("tests/test_trainer_distributed.py::test_two_processes_update_as_one",),
        "DDP averages the processes' gradients: without the factor two processes take half the one-process step",
    ),
    Mutant(
        "trainer: the world-size factor off by 1e-4 on two processes",
        "trainer/update.py",
        "(out.loss * dist.world).backward()",
        "(out.loss * dist.world * (1 + 1e-4 * (dist.world - 1))).backward()",
        ("tests/test_trainer_distributed.py::test_two_processes_update_as_one",),
        "the gradient the optimiser steps with is held to 1e-6 (AdamW's update, held to 1 % of the step, cannot "
        "see this)",
    ),
    Mutant(
        "trainer: --weight-decay not checked",
        "trainer/config.py",
        'raise bad("weight_decay", "must be a number >= 0 (AdamW\'s decoupled weight decay)")',
        "pass",
        (
            "tests/test_trainer.py::test_bad_config_values",
            "tests/test_trainer.py::test_every_bad_setting_stops_before_loading_in_one_line",
        ),
        "a negative or NaN weight decay stops the run in one line",
    ),
    Mutant(
        "trainer: --fsdp in one process ignored without a word",
        "trainer/distributed.py",
        "        if fsdp:\n            warnings.warn(",
        "        if False:\n            warnings.warn(",
        ("tests/test_trainer.py::test_fsdp_in_one_process_says_it_does_nothing",),
        "--fsdp without torchrun says that it does nothing",
    ),
    Mutant(
        "trainer: every stop finishes the run",
        "trainer/stopping.py",
        "return self.reason is StopReason.TIME_CAP",
        "return True",
        ("tests/test_trainer.py::test_only_the_time_cap_finishes_a_stopped_run",),
        "only the time cap evaluates and saves a stopped run as finished",
    ),
    Mutant(
        "packaging: gtpo_kernels.hf left out of the wheel",
        "pyproject.toml",
        '    "gtpo_kernels.hf",\n',
        "",
        ("tests/test_packaging.py::test_the_wheel_has_no_top_level_trainer_package",),
        "every module of the source tree is in the built wheel",
    ),
    # ---------------------------------------------------------------- vocabulary-parallel and packed inputs
    Mutant(
        "metrics: merged entropy weighted by completions instead of tokens",
        "gtpo_kernels/result.py",
        '    "entropy": "num_tokens",',
        '    "entropy": "num_sequences",',
        ("tests/test_vocab_parallel.py::test_ranks_against_the_whole_vocabulary_oracle[2 ranks]",),
        "a sliced call's merged entropy is the whole batch's token mean (the ranks' sliced cases compared the oracle's "
        "with itself before)",
    ),
    Mutant(
        "vocab-parallel: the entropy combination without its - log w_r term",
        "gtpo_kernels/vocab_parallel.py",
        "share * (entropy - log_share)",
        "share * entropy",
        ("tests/test_vocab_parallel.py::test_ranks_against_the_whole_vocabulary_oracle[2 ranks]",),
        "the mixture's entropy is sum_r w_r (H_r - log w_r)",
    ),
    Mutant(
        "torch backend: the target's gradient written at column 0 for an id outside [0, V)",
        "gtpo_kernels/backends/torch_backend.py",
        "torch.where(in_vocab[rows, pos, None], target, grad.gather(-1, at))",
        "target",
        ("tests/test_vocab_parallel.py::test_ranks_against_the_whole_vocabulary_oracle[2 ranks]",),
        "a neighbour shard's target is not this shard's column 0",
    ),
    Mutant(
        "soft cap: the cap's slope left out of the logits' gradient",
        "gtpo_kernels/fused_chunks.py",
        "            if slope is not None:\n                piece_logits.mul_(slope)\n",
        "",
        ("tests/test_fused_linear.py::test_transformed_head", "-k", "softcap and float32"),
        "a soft-capped head's gradient is d loss / d z times 1 - (z / c)^2",
    ),
    Mutant(
        "soft cap: the statistics of the uncapped logits",
        "gtpo_kernels/fused_chunks.py",
        "            logits.div_(self.softcap).tanh_().mul_(self.softcap)",
        "            pass",
        ("tests/test_fused_linear.py::test_transformed_head", "-k", "softcap and float32"),
        "the loss and statistics are those of c tanh(x / c)",
    ),
    Mutant(
        "logit scale: ignored by the walk",
        "gtpo_kernels/fused_chunks.py",
        "temperature = temperature / walk.logit_transform.scale if walk.logit_transform.scale != 1.0 else temperature",
        "pass",
        ("tests/test_fused_linear.py::test_transformed_head", "-k", "scale and float32"),
        "a scaled head's loss is that of scale * x, through the temperature",
    ),
    Mutant(
        "GTPOTrainer: a soft-capped or scaled policy's transform not handed to the fused walk",
        "gtpo_kernels/integrations/trl.py",
        "head_transform = dict(logit_scale=transform[1].scale, logit_softcap=transform[1].softcap)",
        "head_transform = {}",
        ("tests/test_trl.py::test_transformed_logits_take_the_fused_path",),
        "Gemma 2's and Granite's loss and gradient are those of their own logits",
    ),
    Mutant(
        "vocab parallel: the group registry holds strong references",
        "gtpo_kernels/vocab_parallel.py",
        "_GROUPS: weakref.WeakValueDictionary[str, object] = weakref.WeakValueDictionary()",
        "_GROUPS: dict = {}",
        ("tests/test_vocab_parallel.py::test_a_named_group_is_not_kept_alive",),
        "a process group the caller let go of is not kept until interpreter exit",
    ),
    Mutant(
        "packed: the fused walk writes d_hidden at the padded rows",
        "gtpo_kernels/fused_chunks.py",
        "return self.flat[t0:t1] if self.packed is None else self.packed[t0:t1]",
        "return self.flat[t0:t1]",
        ("tests/test_packed.py::test_packed_hidden_states_equal_the_padded_fused_call",),
        "packed hidden states' gradient lands at each token's packed row",
    ),
    Mutant(
        "packed: each position reads the next packed token",
        "gtpo_kernels/packed.py",
        "return self.pad(torch.arange(self.rows.numel(), device=self.rows.device))",
        "return self.pad((torch.arange(self.rows.numel(), device=self.rows.device) + 1) % self.rows.numel())",
        ("tests/test_packed.py::test_packed_hidden_states_equal_the_padded_fused_call",),
        "the packed log-probs are those of the padded call, not shifted by one",
    ),
    Mutant(
        "packed: the padded layout's tokens shifted by one position",
        "gtpo_kernels/packed.py",
        "return out.index_put((self.rows, self.positions), packed)",
        "return out.index_put((self.rows, (self.positions + 1) % self.shape[1]), packed)",
        ("tests/test_packed.py::test_packed_logits_equal_the_padded_call",),
        "packed logits equal the padded call",
    ),
    # ---------------------------------------------------------------- TRL
    Mutant(
        "trl: top_entropy_quantile without every process's group",
        "gtpo_kernels/integrations/trl.py",
        'loss_inputs["entropy_quantile_group"] = torch.distributed.group.WORLD',
        'loss_inputs["entropy_quantile_group"] = None',
        ("tests/test_trl_distributed.py",),
        "TRL's entropy quantile is over every process's tokens",
    ),
    Mutant(
        "trl: the row count doubled",
        "gtpo_kernels/integrations/trl.py",
        "num_sequences = rows * self.current_gradient_accumulation_steps",
        "num_sequences = 2 * rows * self.current_gradient_accumulation_steps",
        ("tests/test_trl.py::test_from_grpo_config_trains_as_grpo_trainer",),
        "GTPOTrainer's step equals GRPOTrainer's",
    ),
    Mutant(
        "trl: the adaptive entropy bonus without its gate",
        "gtpo_kernels/integrations/trl.py",
        "applied = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0",
        "applied = self.entropy_coef",
        ("tests/test_trl.py::test_the_adaptive_entropy_bonus_trains_as_grpo_trainer",),
        "TRL applies the bonus only while the entropy is below its target",
    ),
    Mutant(
        "trl: a MoE policy without its router loss",
        "gtpo_kernels/integrations/trl.py",
        "loss = loss + self.router_aux_loss_coef * router_loss / steps",
        "loss = loss",
        ("tests/test_trl.py::test_moe_router_loss_is_added_as_grpo_trainer_adds_it",),
        "the router's load-balancing loss is added as TRL adds it",
    ),
    Mutant(
        "trl: a bf16 head under cast_lm_head_to_fp32",
        "gtpo_kernels/integrations/trl.py",
        "head_precision = torch.autocast(hidden.device.type, enabled=False)",
        "head_precision = nullcontext()",
        ("tests/test_trl.py::test_a_float32_head_under_bf16_autocast_trains_as_grpo_trainer",),
        "TRL's float32 head: its gradients agree to 5e-7 of the largest, a bf16 head's are 1.2e-2 off",
    ),
    Mutant(
        "trl: TRL's batch-std advantages replaced by the group's",
        "gtpo_kernels/integrations/trl.py",
        'self.scale_rewards = ("batch" if batch_std else "group") if',
        'self.scale_rewards = "group" if',
        ("tests/test_trl.py::test_vllm_importance_sampling_trains_as_grpo_trainer", "-k", "batch-std"),
        "scale_rewards='batch' trains as GRPOTrainer's",
    ),
    # ---------------------------------------------------------------- TRL's own GRPO tests (issue 37)
    Mutant(
        "trl: an all-truncated window counted as 0 tokens",
        "gtpo_kernels/integrations/trl.py",
        "windows = windows.clamp(min=1.0) / self.accelerator.num_processes",
        "windows = windows / self.accelerator.num_processes",
        ("tests/test_trl_training_loop.py::test_a_step_whose_completions_are_all_truncated_is_a_zero_step",),
        "a step whose completions are all truncated is a zero step, not an error",
    ),
    Mutant(
        "trl: bnpo's micro-batch of no tokens counted as 0",
        "gtpo_kernels/integrations/trl.py",
        "_loss_mask(inputs).sum().to(torch.float64).clamp(min=1.0) * steps",
        "_loss_mask(inputs).sum().to(torch.float64) * steps",
        ("tests/test_trl_training_loop.py::test_a_step_whose_completions_are_all_truncated_is_a_zero_step",),
        "bnpo's all-truncated micro-batch is a zero step",
    ),
    Mutant(
        "trl: policy_loss not logged",
        "gtpo_kernels/integrations/trl.py",
        "self._log_policy_loss(out, config, num_tokens, mode)",
        "pass",
        ("tests/test_trl_training_loop.py::test_policy_loss_is_logged_beside_the_entropy_bonus",),
        "TRL's policy_loss is logged beside the entropy bonus, with GRPOTrainer's values",
    ),
    Mutant(
        "trl: policy_loss with the bonus left in",
        "gtpo_kernels/integrations/trl.py",
        "policy = out.loss.detach().double() + bonus",
        "policy = out.loss.detach().double()",
        ("tests/test_trl_training_loop.py::test_policy_loss_is_logged_beside_the_entropy_bonus",),
        "policy_loss is the loss without the entropy bonus",
    ),
    Mutant(
        "hf: PEFT's wrapped head not unwrapped",
        "gtpo_kernels/hf/model_config.py",
        'if saved is not None and hasattr(head, "original_module"):',
        "if False:",
        ("tests/test_trl_training_loop.py::test_a_head_kept_trainable_under_peft_trains_as_grpo_trainer",),
        "a head kept trainable under PEFT (modules_to_save) trains as in GRPOTrainer",
    ),
    Mutant(
        "trl: from_grpo_config's token means divided by each window's exact count",
        "gtpo_kernels/integrations/trl.py",
        "        self._gtpo_trl_token_average = (\n            config.preset",
        "        self._gtpo_trl_token_average = False and (\n            config.preset",
        (
            "tests/test_trl_training_loop.py::test_steps_per_generation_over_accumulation_trains_as_grpo_trainer",
            "-k",
            "dapo-2 or cispo-2",
        ),
        "TRL's average window for its token means: GRPOTrainer's gradients to 1e-5 (8-10 % off otherwise)",
    ),
    Mutant(
        "trl: steps spanning generation batches refused under a token mean",
        "gtpo_kernels/integrations/trl.py",
        '        self._gtpo_local_tokens = self.args.loss_type == "bnpo"\n',
        '        self._gtpo_local_tokens = self.args.loss_type == "bnpo"\n'
        '        if config.loss_reduction == "token_mean" and self.args.steps_per_generation % '
        "self.args.gradient_accumulation_steps:\n"
        '            raise ValueError("token_mean needs each optimiser step\'s token count")\n',
        (
            "tests/test_trl_training_loop.py::test_steps_per_generation_over_accumulation_trains_as_grpo_trainer",
            "-k",
            "dapo-3",
        ),
        "steps_per_generation 4 over accumulation 3 trains as GRPOTrainer",
    ),
    # ---------------------------------------------------------------- the objective
    Mutant(
        "vespo: the advantage's sign flipped in choosing k and lambda",
        "gtpo_kernels/objective.py",
        "nonneg = (masked.shaped >= 0)[:, None]",
        "nonneg = (masked.shaped < 0)[:, None]",
        ("tests/test_ratio_functions.py::test_vespo_by_hand",),
        "VESPO's k and lambda follow the sign of the shaped advantage",
    ),
    Mutant(
        "vespo: the sampler's weights left out of phi",
        "gtpo_kernels/objective.py",
        "log_w = log_w + (torch.clamp(torch.log(sampler), LOG_1E_8, 20.0) * masked.mask).sum(dim=1, keepdim=True)",
        "log_w = log_w",
        ("tests/test_parity.py", "-k", "vespo"),
        "TRL folds the sampler's token weights into VESPO's log w",
    ),
    Mutant(
        "cispo: the cap dropped",
        "gtpo_kernels/objective.py",
        "return ratio if cap is None else torch.clamp(ratio, max=cap)",
        "return ratio",
        ("tests/test_ratio_functions.py::test_cispo_by_hand",),
        "CISPO caps the ratio's weight at cispo_ratio_max",
    ),
    Mutant(
        "objective: the entropy bonus over the call's own tokens",
        "gtpo_kernels/objective.py",
        "    tokens = _batch_tokens(rows, masked.lengths)\n    return tokens if masked.kept_share",
        "    tokens = masked.lengths.sum().clamp(min=1)\n    return tokens if masked.kept_share",
        ("tests/test_sliced_batches.py::test_trls_terms_add_up_across_slices",),
        "the bonus is the optimiser step's token mean: slices of a batch add up",
    ),
    Mutant(
        "objective: top_entropy_quantile's mask left off the policy term",
        "gtpo_kernels/objective.py",
        "token_advantage = token_advantage * masked.high_entropy",
        "token_advantage = token_advantage",
        ("tests/test_top_entropy.py",),
        "the policy term acts on the tokens at or above the quantile only",
    ),
    Mutant(
        "rows: a slice without the call's counts",
        "gtpo_kernels/rows.py",
        "num_tokens=self.valid.sum() if self.num_tokens is None else self.num_tokens,",
        "num_tokens=self.num_tokens,",
        ("tests/test_rows.py",),
        "slices of a call keep its whole-batch token count, so they add up",
    ),
    # ---------------------------------------------------------------- this stop's fixes (issue 36)
    Mutant(
        "fused backward: a copy of every stored gradient",
        "gtpo_kernels/fused_linear.py",
        "(g.mul_(grad_loss.to(g.dtype)) if in_place else g * grad_loss.to(g.dtype))",
        "g * grad_loss.to(g.dtype)",
        ("tests/test_fused_linear.py::test_backward_hands_on_the_stored_gradients_without_a_copy",),
        "the backward makes no d_weight- or d_hidden-sized storage",
    ),
    Mutant(
        "fused backward: zero gradients materialised for the unused outputs",
        "gtpo_kernels/fused_linear.py",
        "    ctx.set_materialize_grads(False)\n",
        "",
        ("tests/test_fused_linear.py::test_backward_hands_on_the_stored_gradients_without_a_copy",),
        "the backward makes no d_weight- or d_hidden-sized storage",
    ),
    Mutant(
        "fused forward: gradients computed under torch.no_grad",
        "gtpo_kernels/fused_linear.py",
        "grad_enabled = torch.is_grad_enabled()",
        "grad_enabled = True",
        ("tests/test_fused_linear.py::test_no_grad_computes_no_gradient",),
        "an evaluation pays no backward",
    ),
    Mutant(
        "fused: tied groups under the entropy shift called signal-free",
        "gtpo_kernels/fused_linear.py",
        "if not config.warn_no_signal or shift or signal_beyond_advantages(",
        "if not config.warn_no_signal or signal_beyond_advantages(",
        ("tests/test_fused_linear.py::test_tied_groups_under_the_entropy_shift_are_not_called_signal_free",),
        "no warning that the loss is 0 when GTPO's shift gives tied groups a gradient",
    ),
    Mutant(
        "validation: isfinite of the whole head on every call",
        "gtpo_kernels/validation.py",
        "checks.add(~(torch.isfinite(low) & torch.isfinite(high)), explain)",
        "checks.add(~torch.isfinite(tensor).all(), explain)",
        ("tests/test_fused_linear.py::test_no_grad_computes_no_gradient",),
        "the finite check of the head makes no copy of it",
    ),
    Mutant(
        "triton: ids beyond int32 wrap into the vocabulary",
        "gtpo_kernels/backends/triton_token_stats.py",
        "ids = torch.where((ids < 0) | (ids > torch.iinfo(torch.int32).max), -1, ids)",
        "pass",
        ("tests/test_api.py::test_ids_beyond_int32_are_not_wrapped_into_the_vocabulary",),
        "2**32 + 5 is refused, not read as token 5",
    ),
    Mutant(
        "validation: old, reference and sampler log-probs not checked",
        "gtpo_kernels/validation.py",
        "            add_logprobs_check(checks, name, logprobs, valid)\n",
        "",
        ("tests/test_api.py::test_non_finite_given_logprobs_are_named",),
        "a NaN or infinite given log-prob is named, not a NaN loss",
    ),
    Mutant(
        "conflict_weights: a negative or NaN weight accepted",
        "gtpo_kernels/conflict.py",
        "not (math.isfinite(weight) and weight > 0):",
        "False:",
        ("tests/test_api.py::test_conflict_weight_must_be_positive_and_finite",),
        "conflict_weights(weight=) must be finite and > 0",
    ),
    Mutant(
        "advantages: NaN rewards accepted",
        "gtpo_kernels/advantages.py",
        "if not bool(torch.isfinite(rewards).all()):",
        "if False:",
        ("tests/test_api.py::test_compute_advantages_errors",),
        "a NaN reward is named",
    ),
    # ---------------------------------------------------------------- the C++ forward's one sweep (issue 64)
    Mutant(
        "C++ one sweep (AVX2 build): 2^r's polynomial off in its linear term",
        "csrc/gtpo_cpu.cpp",
        "p1(6.931469670336139e-1f)",
        "p1(6.941469670336139e-1f)",
        ("tests/test_cpu_one_sweep.py",),
        "the one-sweep blocks' exp is checked against float64 (lse, log p, entropy to 1e-5)",
        cpu_variant="avx2",
    ),
    Mutant(
        "C++ one sweep (AVX2 build): sum e x not turned back into natural log units",
        "csrc/gtpo_cpu.cpp",
        "w = (lanes_sum(vw0) + lanes_sum(vw1)) * kLn2;",
        "w = (lanes_sum(vw0) + lanes_sum(vw1));",
        ("tests/test_cpu_one_sweep.py",),
        "the entropy of rows whose later blocks take the one sweep is checked against float64",
        cpu_variant="avx2",
    ),
    Mutant(
        "C++ one sweep: a block that passes the running max kept",
        "csrc/gtpo_cpu.cpp",
        "if (below.block_max < m && std::isfinite(below.s)",
        "if (std::isfinite(below.s)",
        ("tests/test_cpu_one_sweep.py",),
        "the row's max is returned exactly (rows whose max rises block by block)",
    ),
    Mutant(
        "C++ one sweep (AVX2 build): the clamp drops a NaN",
        "csrc/gtpo_cpu.cpp",
        "const Vec x = at::vec::clamp_min((zi - vm) * vscale, floor_x);",
        "const Vec x = at::vec::clamp_min(floor_x, (zi - vm) * vscale);",
        ("tests/test_cpu_one_sweep.py",),
        "a NaN logit in a later block leaves that token's outputs non-finite",
        cpu_variant="avx2",
    ),
    Mutant(
        "C++ one sweep (AVX-512 build): 2^r's polynomial without its quadratic term",
        "csrc/gtpo_cpu.cpp",
        "kExp2P2 = 0.240224749f",
        "kExp2P2 = 0.f",
        ("tests/test_cpu_one_sweep.py",),
        "the one-sweep blocks' exp is checked against float64 (lse, log p, entropy to 1e-5; dropping the term is an "
        "error of up to 6e-5 a value)",
        cpu_variant="avx512",
    ),
    Mutant(
        "C++ one sweep (AVX-512 build): the table's halves swapped",
        "csrc/gtpo_cpu.cpp",
        "_mm512_permutex2var_ps(table.lo, _mm512_castps_si512(t), table.hi)",
        "_mm512_permutex2var_ps(table.hi, _mm512_castps_si512(t), table.lo)",
        ("tests/test_cpu_one_sweep.py",),
        "2^(j/32) is looked up at the right j",
        cpu_variant="avx512",
    ),
    Mutant(
        "C++ one sweep (AVX-512 build): a bfloat16 pair's odd value keeps its neighbour's bits",
        "csrc/gtpo_cpu.cpp",
        "_mm512_set1_epi32(static_cast<int>(0xFFFF0000u))",
        "_mm512_set1_epi32(static_cast<int>(0xFFFFFFFFu))",
        ("tests/test_cpu_one_sweep.py",),
        "bfloat16 rows are read exactly (checked against float64 in bf16)",
        cpu_variant="avx512",
    ),
    Mutant(
        "C++ one sweep (AVX-512 build): sum e d not scaled by 1/T",
        "csrc/gtpo_cpu.cpp",
        "_mm512_reduce_add_ps(_mm512_add_ps(vw0, vw1))) * inv_t;",
        "_mm512_reduce_add_ps(_mm512_add_ps(vw0, vw1)));",
        ("tests/test_cpu_one_sweep.py",),
        "the entropy at T != 1 of rows whose later blocks take the one sweep is checked against float64",
        cpu_variant="avx512",
    ),
    Mutant(
        "C++ one sweep (AVX-512 build): the clamp drops a NaN",
        "csrc/gtpo_cpu.cpp",
        "_mm512_max_ps(floor_d, _mm512_sub_ps(zi, vm))",
        "_mm512_max_ps(_mm512_sub_ps(zi, vm), floor_d)",
        ("tests/test_cpu_one_sweep.py",),
        "a NaN logit in a later block leaves that token's outputs non-finite",
        cpu_variant="avx512",
    ),
    Mutant(
        "bench cpu_kernels: the forward called with an argument it does not take",
        "bench/cpu_kernels.py",
        "return (lambda: forward(logits, ids, valid, 1.0)), logits",
        "return (lambda: forward(logits, ids, valid, 1.0, None)), logits",
        ("tests/test_bench.py::test_cpu_kernels_forward_against_a_read_runs",),
        "the benchmark's forward-against-a-read loop runs (at a small shape)",
    ),
    Mutant(
        "bench sampler: --profile ignored",
        "bench/sampler.py",
        '        if args.profile:\n            results["profile"] = profile_steps(ours(Decoder(model)))',
        '        if False:\n            results["profile"] = profile_steps(ours(Decoder(model)))',
        ("tests/test_bench.py::test_sampler_benchmark_harness",),
        "the sampler benchmark's table holds the profiler's operators when --profile is given",
    ),
    Mutant(
        "bench fused_linear: the Clip-Cov and KL-Cov rows left out of --remedies",
        "bench/fused_linear.py",
        'for mode in ("clip_cov", "kl_cov"):',
        "for mode in ():",
        ("tests/test_bench.py::test_fused_linear_benchmark_rows_for_the_settings_against_collapse",),
        "--remedies times Clip-Cov and KL-Cov beside today's loss",
    ),
    # ---------------------------------------------------------------- one objective, one walk, one seam (issue 38)
    Mutant(
        "per-completion temperature: the C++ kernels given the completions' scales in the wrong rows",
        "gtpo_kernels/backends/cpu_backend.py",
        "        return (1.0 / temperature.float()).contiguous()",
        "        return (1.0 / temperature.float().flip(0)).contiguous()",
        ("tests/test_parity.py", "-k", "per_completion_temperature and cpu"),
        "each completion's temperature is read inside the C++ kernels, per row",
    ),
    Mutant(
        "per-completion temperature: the Triton backward reads the first token's scale",
        "gtpo_kernels/backends/triton_token_stats.py",
        "    if PER_TOKEN_TEMPERATURE:\n        inv_temperature = tl.load(inv_temperature_ptr + token)",
        "    if PER_TOKEN_TEMPERATURE:\n        inv_temperature = tl.load(inv_temperature_ptr)",
        ("tests/test_parity.py", "-k", "per_completion_temperature and triton"),
        "the Triton backward scales each token by its own completion's 1 / T",
    ),
    Mutant(
        "per-completion temperature: the torch backend's blocks take their first token's temperature",
        "gtpo_kernels/backends/torch_backend.py",
        "    return temperature[rows, pos, None].to(dtype)",
        "    return temperature[rows, pos, None][:1, :1].to(dtype)",
        ("tests/test_parity.py", "-k", "per_completion_temperature and torch"),
        "the torch backend divides each token by its own temperature",
    ),
    Mutant(
        "per-completion temperature: the fused walk reads temperatures by chunk position, not by token",
        "gtpo_kernels/fused_chunks.py",
        "        return self.temperature[self.tokens.flat[t0:t1]][None]",
        "        return self.temperature[t0:t1][None]",
        ("tests/test_fused_linear.py", "-k", "per_completion_temperature and cpu"),
        "a chunk's tokens read their own completion's temperature (masked positions skipped)",
    ),
    Mutant(
        "GTPOTrainer: the batch's per-completion temperatures ignored by the loss",
        "gtpo_kernels/integrations/trl.py",
        'temperature=inputs.get("gtpo_temperature", self.temperature),',
        "temperature=self.temperature,",
        ("tests/test_trl.py::test_per_completion_temperatures_from_the_batch",),
        "a rollout's per-completion temperatures reach the loss",
    ),
    Mutant(
        "fused walk: a chunk's objective over its own token count (a slice without the call's counts)",
        "gtpo_kernels/rows.py",
        "num_tokens=self.valid.sum() if self.num_tokens is None else self.num_tokens,",
        "num_tokens=self.num_tokens,",
        ("tests/test_fused_linear.py", "-k", "test_against_float64_reference and penalty and cpu"),
        "each chunk is a slice of the call's rows with the call's counts: a token mean's chunks add up",
    ),
    Mutant(
        "config: an explicit change equal to the old preset's value thrown away",
        "gtpo_kernels/config.py",
        "        values.update(changes)\n        return GTPOConfig(**values)",
        "        values.update({k: v for k, v in changes.items() if not (k in PRESET_FIELDS and "
        "new_preset != self.preset and _same(v, _PRESET_VALUES[self.preset][k]))})"
        "\n        return GTPOConfig(**values)",
        ("tests/test_config.py::test_replace_keeps_an_explicit_value_and_depends_on_the_fields_only",),
        "config.replace(preset=..., knob=value) keeps the value even when it equals the old preset's",
    ),
    # ---------------------------------------------------------------- one chunk of logits alive at a time
    Mutant(
        "fused walk: the previous chunk's logits kept while the next chunk's are made",
        "gtpo_kernels/fused_chunks.py",
        "        logits = None  # the last chunk's logits freed before this chunk's are made (one alive at a time)\n",
        "",
        ("tests/test_fused_memory.py", "-k", "rows or soft"),
        "the peak of a step over several chunks stays under the gradients plus 1.5 chunks",
    ),
    Mutant(
        "fused walk: the previous piece's logits kept while the next piece's statistics are made",
        "gtpo_kernels/fused_chunks.py",
        "            logits = None  # the last piece's logits freed before this piece's are made\n",
        "",
        ("tests/test_fused_memory.py", "-k", "pieces"),
        "a completion longer than the budget is walked one piece of logits at a time",
    ),
    Mutant(
        "fused walk: the previous piece's gradient kept while the next piece's logits are made",
        "gtpo_kernels/fused_chunks.py",
        "            del piece_logits, slope  # freed before the next piece's logits are made\n",
        "",
        ("tests/test_fused_memory.py", "-k", "pieces"),
        "a long completion's gradient is taken one piece of logits at a time",
    ),
    # ---------------------------------------------------------------- the install and the torch internals
    Mutant(
        "setup.py: a variant that failed to compile kept among the install's extensions",
        "setup.py",
        "                self.extensions = [ext for ext in self.extensions if ext.name not in self.failed]\n",
        "",
        ("tests/test_build.py",),
        "an editable install with variants that do not compile succeeds (it copied the missing file and failed)",
    ),
    Mutant(
        "cpu_build: the C++ standard fixed at C++17 instead of torch's own",
        "gtpo_kernels/backends/cpu_build.py",
        'return ["-O3", "-fopenmp", *_FLAGS[variant]]',
        'return ["-O3", "-fopenmp", "-std=c++17", *_FLAGS[variant]]',
        ("tests/test_build.py::test_the_compile_flags_leave_the_standard_to_torch",),
        "the kernels build with the standard torch's headers need (torch 2.15's require C++20)",
    ),
    Mutant(
        "autograd: a second derivative through a closed-form backward let through as a constant",
        "gtpo_kernels/_autograd.py",
        "        raise RuntimeError(ctx.message)",
        "        return (None, *grads)",
        ("tests/test_structure.py", "-k", "double_backward"),
        "differentiating a gtpo_kernels gradient again raises instead of treating it as a constant",
    ),
    Mutant(
        "torch internals: a private torch name used outside torch_internals.py",
        "gtpo_kernels/_autograd.py",
        'internal("torch._is_functional_tensor")(tensor)',
        "torch._is_functional_tensor(tensor)",
        ("tests/test_torch_internals.py::test_no_other_module_of_the_package_reaches_into_torch_privately",),
        "every private torch name the package uses is in the one module whose test looks each up by name",
    ),
    Mutant(
        "operators: postponed (string) annotations in a module that registers operators",
        "gtpo_kernels/custom_ops.py",
        "from typing import List, Optional, Tuple\n",
        "from __future__ import annotations\n\nfrom typing import List, Optional, Tuple\n",
        ("tests/test_structure.py::test_modules_that_register_operators_keep_their_annotations_as_objects",),
        "torch 2.4-2.6's custom_op cannot read string annotations: the package would not import there",
    ),
    Mutant(
        "row keywords: one field of LossRows left out of the entry points' declared keywords",
        "gtpo_kernels/rows.py",
        '_COMPUTED = ("entropy_floor", "cov_selected")',
        '_COMPUTED = ("entropy_floor", "cov_selected", "num_tokens")',
        ("tests/test_rows.py", "-k", "every_entry_point_takes_every_row_keyword"),
        "every loss entry point (and the oracle) takes every per-row input LossRows declares, as a keyword",
    ),
    Mutant(
        "row keywords: a misspelt keyword handed to LossRows unchecked",
        "gtpo_kernels/rows.py",
        "        if name not in ROW_KEYWORDS or name in not_taken:\n",
        "        if name in not_taken:\n",
        ("tests/test_rows.py", "-k", "misspelt_row_keyword"),
        "a keyword no entry point takes is refused as Python refuses one, naming the entry point the user called",
    ),
    Mutant(
        "operators: token_stats' backward counts its None gradients",
        "gtpo_kernels/custom_ops.py",
        "    return gradients_for(token_stats, logits=grad)",
        "    return (grad,) + (None,) * 9",
        ("tests/test_structure.py::test_no_operator_is_read_by_index",),
        "around a registered operator, inputs, outputs and gradients are named, never counted by position",
    ),
    Mutant(
        "operators: the fused operator's setup reads its inputs by index",
        "gtpo_kernels/fused_linear.py",
        "    ctx.needed = [need and (i != 2 or given.bias is not None) for i, need in enumerate(given.need_grads)]",
        "    ctx.needed = [need and (i != 2 or inputs[2] is not None) for i, need in enumerate(inputs[-1])]",
        ("tests/test_structure.py::test_no_operator_is_read_by_index",),
        "the operator's setup reads need_grads and bias by name (an argument added anywhere would shift inputs[-1])",
    ),
    Mutant(
        "row inputs: a field of LossRows left out of the operator's declared arguments",
        "gtpo_kernels/rows.py",
        '    ("sampling_logprobs", Optional[torch.Tensor]),\n',
        "",
        ("tests/test_rows.py::test_every_field_of_the_bundle_reaches_the_operator",),
        "every per-row input but group_size and entropy_floor is an argument of the fused operator, by name",
    ),
    Mutant(
        "row inputs: a LossRows field dropped on the way into the operator",
        "gtpo_kernels/rows.py",
        '            initial_entropy=inputs["initial_entropy"],\n',
        "",
        ("tests/test_rows.py::test_the_operator_arguments_round_trip",),
        "the rows come out of the operator's arguments as they went in, field by field",
    ),
    Mutant(
        "rollout: a micro-batch's rows counted in prompts instead of completions",
        "trainer/rollout.py",
        "        return slice(groups.start * self.group_size, groups.stop * self.group_size)",
        "        return slice(groups.start, groups.stop * self.group_size)",
        ("tests/test_trainer.py::test_a_rollouts_rows_are_its_prompt_groups_completions",),
        "prompt groups g0..g1 of a rollout are completions g0*G..g1*G, every per-completion tensor sliced alike",
    ),
    Mutant(
        "rollout: the reference log-probs left out of a micro-batch's rows",
        "trainer/rollout.py",
        "            ref_logprobs=pick(self.ref_logprobs),\n",
        "",
        ("tests/test_trainer.py::test_a_rollouts_rows_are_its_prompt_groups_completions",),
        "the --beta reference log-probs reach the loss's rows (without them the KL term is silently gone)",
    ),
    Mutant(
        "totals: summed vectors read back at offsets that ignore a field's length",
        "trainer/totals.py",
        "            at += 1 if n is None else n\n",
        "            at += 1\n",
        ("tests/test_trainer.py::test_held_out_totals_add_over_processes_field_by_field",),
        "each field of a process-summed vector is read at its own offset (a vector field shifts the ones after it)",
    ),
    Mutant(
        "offline tools: the training loop imports the study's comparison",
        "trainer/train.py",
        "from .offline.plots import plot_run\n",
        "from .offline.compare import load  # noqa: F401\nfrom .offline.plots import plot_run\n",
        ("tests/test_structure.py::test_the_training_loop_does_not_import_the_offline_tools",),
        "the loop's modules import nothing of trainer/offline/ but the figure train.py draws at a run's end",
    ),
    Mutant(
        "offline tools: a study's cells run the offline subpackage instead of the trainer",
        "trainer/offline/study.py",
        '        module = (__package__ or "trainer.offline").rpartition(".")[0]',
        '        module = __package__ or "trainer"',
        ("tests/test_study.py::test_a_smoke_study_runs_resumes_and_reports_paired_differences",),
        "each cell is a plain run of the trainer (gtpo_train, or trainer in a checkout), wherever the study lives",
    ),
    # ---------------------------------------------------------------- issue 65's Clip-Cov and KL-Cov
    Mutant(
        "objective: the covariance without the log-probs' centring",
        "gtpo_kernels/objective.py",
        "(logp - (logp * mask).sum() / tokens.clamp(min=1))",
        "logp",
        ("tests/test_parity.py::test_clip_cov_and_kl_cov_equal_the_reference",),
        "every backend picks the tokens of the oracle's centred covariance",
    ),
    Mutant(
        "objective: Clip-Cov's picks keep their policy term",
        "gtpo_kernels/objective.py",
        "        clip_cov = (~masked.cov_selected).to(masked.dtype)\n",
        "        pass\n",
        (
            "tests/test_parity.py::test_clip_cov_and_kl_cov_equal_the_reference",
            "tests/test_fused_linear.py::test_clip_cov_and_kl_cov_pick_from_the_whole_call",
        ),
        "Clip-Cov takes the picked tokens' policy term away on every path",
    ),
    Mutant(
        "objective: KL-Cov's term without the absolute value",
        "gtpo_kernels/objective.py",
        "* (logp - masked.old(rows)).abs()",
        "* (logp - masked.old(rows))",
        (
            "tests/test_parity.py::test_clip_cov_and_kl_cov_equal_the_reference",
            "tests/test_fused_linear.py::test_clip_cov_and_kl_cov_pick_from_the_whole_call",
        ),
        "KL-Cov adds |logp - old| on every path",
    ),
    Mutant(
        "objective: the share of picked tokens rounded up",
        "gtpo_kernels/objective.py",
        "k = torch.floor(config.cov_share * tokens.double()).clamp(min=1)",
        "k = torch.ceil(config.cov_share * tokens.double()).clamp(min=1)",
        ("tests/test_parity.py::test_clip_cov_and_kl_cov_equal_the_reference",),
        "k = max(1, floor(share * tokens)) tokens are picked",
    ),
    Mutant(
        "objective: Clip-Cov picks tokens the PPO clip already holds",
        "gtpo_kernels/objective.py",
        "            eligible = eligible & ~(low | high)\n",
        "            pass\n",
        ("tests/test_parity.py::test_clip_cov_and_kl_cov_equal_the_reference",),
        "a token the clip holds is not a Clip-Cov candidate (the grpo config clips off-policy)",
    ),
    Mutant(
        "fused walk: each chunk picks its own tokens",
        "gtpo_kernels/fused_chunks.py",
        "rows = rows.replace(cov_selected=call_covariance_tokens(",
        "rows = rows.replace(cov_selected=None and call_covariance_tokens(",
        ("tests/test_fused_linear.py::test_clip_cov_and_kl_cov_pick_from_the_whole_call",),
        "the fused path's pick is the whole call's, not each chunk's",
    ),
    Mutant(
        "fused walk: reads a config field the operator does not take",
        "gtpo_kernels/fused_chunks.py",
        "config.cov_mode is not None\n",
        "config.cov_mode is not None or not config.validate_inputs\n",
        ("tests/test_fused_linear.py::test_the_config_fields_left_out_of_the_operator_are_not_read_inside_it",),
        "the operator's config holds defaults for the fields left out of its schema: the walk reads none of them",
    ),
    Mutant(
        "reference: the oracle's KL-Cov term without the absolute value",
        "gtpo_kernels/reference.py",
        "config.kl_cov_coef * flags * (lp - old).abs()",
        "config.kl_cov_coef * flags * (lp - old)",
        ("tests/test_parity.py::test_what_clip_cov_and_kl_cov_do_to_the_tokens_they_pick",),
        "the oracle's KL-Cov gradient is coef * sign(logp - old) on its picks",
    ),
    Mutant(
        "reference: the oracle's KL-Cov picks the lowest covariances",
        "gtpo_kernels/reference.py",
        "key=lambda j: (-cov[j], tokens[j][0], tokens[j][1])",
        "key=lambda j: (cov[j], tokens[j][0], tokens[j][1])",
        ("tests/test_parity.py::test_what_clip_cov_and_kl_cov_do_to_the_tokens_they_pick",),
        "the oracle's picks are the highest covariances, checked by hand",
    ),
    Mutant(
        "config: --cov-mode not passed to the loss",
        "trainer/config.py",
        "            cov_mode=self.cov_mode,\n",
        "",
        ("tests/test_trainer.py::test_clip_cov_and_kl_cov_reach_the_loss_and_its_metrics",),
        "the trainer's flag sets the loss's mode and its metric is logged",
    ),
    Mutant(
        "GTPOConfig: a Clip-Cov band with low above high accepted",
        "gtpo_kernels/config.py",
        "        if not self.clip_cov_low < self.clip_cov_high:",
        "        if False:",
        ("tests/test_config.py::test_clip_cov_and_kl_cov_settings_are_checked",),
        "a band whose low side is above its high side is refused",
    ),
    Mutant(
        "torch internals: eager_autograd without the dispatcher guard",
        "gtpo_kernels/_autograd.py",
        '    with internal("torch._C._ForceDispatchKeyGuard")(include, _EAGER_EXCLUDE):',
        "    with contextlib.nullcontext():",
        ("tests/test_torch_internals.py::test_eager_autograd_records_inside_a_registered_operator",),
        "inside a registered operator's body, autograd records again only with the guard",
    ),
)


def scratch_copy(dest: Path) -> None:
    """The working tree as git sees it (tracked files, and untracked ones it does not ignore) plus the built C++
    extension: no build output or egg-info that would stand in for what the tree itself says (a stale
    egg-info once let a package left off pyproject's list into the wheel)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    built = [p.relative_to(ROOT).as_posix() for p in (ROOT / "gtpo_kernels" / "backends").glob("_cpu_*.so")]
    for name in [n for n in listed if n] + built:
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def apply(mutant: Mutant, tree: Path) -> None:
    path = tree / mutant.file
    text = path.read_text()
    count = text.count(mutant.old)
    if count != 1:
        raise LookupError(f"{mutant.file}: the mutant's text occurs {count} times (re-aim it at the code as it is)")
    path.write_text(text.replace(mutant.old, mutant.new))


def rebuild_kernels_from_source(tree: Path) -> dict:
    """A mutant of the C++ source: the copied build of the kernels goes, so that the package JIT-compiles the
    mutated csrc/ on first use (about a minute), into a cache inside the scratch tree; the extra environment."""
    for built in (tree / "gtpo_kernels" / "backends").glob("_cpu_*.so"):
        built.unlink()
    return {"GTPO_KERNELS_CACHE": str(tree / ".kernels-cache")}


def cpu_lacks(variant: str) -> str:
    """Why a mutant of one CPU build cannot run here ("" when it can)."""
    if not variant:
        return ""
    from gtpo_kernels.backends import cpu_build, cpu_extension

    supported = cpu_extension.supported_variant()
    if cpu_build.VARIANTS.index(variant) < cpu_build.VARIANTS.index(supported):
        return f"not run: this CPU lacks {variant} (it supports up to {supported})"
    return ""


def run_tests(mutant: Mutant, tree: Path, timeout: float) -> Tuple[str, float, str]:
    """``(verdict, seconds, last lines of pytest's output)``."""
    env = dict(os.environ, PYTHONPATH=str(tree), TRITON_INTERPRET="1", PYTHONDONTWRITEBYTECODE="1")
    if mutant.file.startswith("csrc/"):
        env.update(rebuild_kernels_from_source(tree))
    if mutant.cpu_variant:
        env["GTPO_CPU_CAPABILITY"] = mutant.cpu_variant
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutant.tests]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start, ""
    seconds = time.monotonic() - start
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
    verdict = {0: "SURVIVED", 1: "killed"}.get(proc.returncode, f"error (pytest exit {proc.returncode})")
    return verdict, seconds, tail


def check(mutants: List[Mutant], timeout: float) -> List[Tuple[Mutant, str, float, str]]:
    results = []
    with tempfile.TemporaryDirectory(prefix="gtpo-mutants-") as scratch:
        pristine = Path(scratch) / "pristine"
        scratch_copy(pristine)
        for mutant in mutants:
            tree = Path(scratch) / "tree"
            if tree.exists():
                shutil.rmtree(tree)
            shutil.copytree(pristine, tree, symlinks=True)
            try:
                apply(mutant, tree)
            except LookupError as exc:
                results.append((mutant, f"stale: {exc}", 0.0, ""))
                continue
            lacking = cpu_lacks(mutant.cpu_variant)
            if lacking:
                results.append((mutant, lacking, 0.0, ""))
                print(f"{'not run':>10}  {mutant.name}: {lacking}", flush=True)
                continue
            verdict, seconds, tail = run_tests(mutant, tree, timeout)
            print(f"{verdict:>10}  {seconds:6.1f} s  {mutant.name}", flush=True)
            results.append((mutant, verdict, seconds, tail))
    return results


def source_state() -> str:
    """The commit the working tree stands on, and whether it has uncommitted changes (taken before the copy)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode != 0
    return (commit.stdout.strip() or "?") + (" with uncommitted changes" if dirty else "")


def report(results, command: str, source: str) -> str:
    killed = sum(verdict == "killed" for _, verdict, _, _ in results)
    lines = [
        "# Mutation check",
        "",
        f"`{command}` on the working tree at {source}, {time.strftime('%Y-%m-%d')}: "
        f"**{killed} of {len(results)} mutants killed**.",
        "",
        "| mutant | file | tests that must fail | verdict | seconds |",
        "|---|---|---|---|---|",
    ]
    for mutant, verdict, seconds, _ in results:
        tests = "<br>".join(f"`{t}`" for t in mutant.tests)
        lines.append(f"| {mutant.name} | `{mutant.file}` | {tests} | {verdict} | {seconds:.0f} |")
    lines += ["", "What each mutant breaks, and what its tests hold:", ""]
    lines += [f"- **{mutant.name}**: {mutant.claim}." for mutant, _, _, _ in results]
    # A mutant not killed: the last lines pytest printed, so that the report says why (a survivor, a collection
    # error in the mutated code, a timeout).
    unkilled = [
        (mutant, verdict, tail)
        for mutant, verdict, _, tail in results
        if verdict != "killed" and not verdict.startswith("not run")
    ]
    for mutant, verdict, tail in unkilled:
        lines += ["", f"**{mutant.name}** ({verdict}):", "", "```", tail or "(no output)", "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.mutations", description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="TEXT", help="the mutants whose name contains one of these")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mutant (default 900)")
    args = parser.parse_args(argv)
    mutants = [m for m in MUTANTS if not args.only or any(text in m.name for text in args.only)]
    if args.list:
        for m in mutants:
            print(f"{m.name}\n    {m.file}\n    " + "\n    ".join(m.tests))
        return 0
    if not mutants:
        parser.error(f"no mutant's name contains any of {args.only}")
    source = source_state()
    results = check(mutants, args.timeout)
    text = report(results, "python -m tools.mutations" + (" --only ..." if args.only else ""), source)
    if args.only:
        print(text)
    else:
        REPORT.write_text(text)
        print(f"report: {REPORT.relative_to(ROOT)}")
    return 0 if all(verdict == "killed" or verdict.startswith("not run") for _, verdict, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
