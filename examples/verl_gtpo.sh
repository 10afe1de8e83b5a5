#!/usr/bin/env bash
# GTPO with verl (0.9.x): Qwen2.5-3B-Instruct on GSM8K, the paper's setting, on one node of 8 GPUs with vLLM
# rollouts. Not runnable on a CPU machine (verl's trainer needs GPUs, Ray and a rollout engine); the GTPO
# settings below are checked against verl's own default config by tests/test_verl.py.
#
# Before: pip install torch (CUDA) vllm, then in this repository
#   pip install --no-build-isolation -e ".[verl]" && pip install --no-deps "verl>=0.9,<0.10"
# (or `pip install verl[vllm]` with its own pins, then `pip install --no-deps -e .`), and prepare GSM8K with
#   python -m verl.examples.data_preprocess.gsm8k --local_save_dir ~/data/gsm8k   (verl's repository)
# gtpo_kernels registers itself in every verl process through the `verl.plugins` entry point.
#
# Presets: paper (below); official: algorithm.gtpo.preset=official and
# actor_rollout_ref.actor.policy_loss.loss_mode=gtpo_sum; grpo: algorithm.gtpo.preset=grpo.
set -euo pipefail
DATA=${DATA:-$HOME/data/gsm8k}
MODEL=${MODEL:-Qwen/Qwen2.5-3B-Instruct}

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=gtpo \
    +algorithm.gtpo.preset=paper \
    actor_rollout_ref.actor.policy_loss.loss_mode=gtpo \
    actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.ppo_epochs=1 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    data.train_files="$DATA/train.parquet" \
    data.val_files="$DATA/test.parquet" \
    data.train_batch_size=64 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.total_epochs=3 \
    trainer.project_name=gtpo \
    trainer.experiment_name=qwen2.5-3b-gsm8k-gtpo-paper \
    trainer.logger='["console"]' \
    "$@"
