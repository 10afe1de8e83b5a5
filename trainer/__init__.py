"""A lean GTPO trainer: rollouts, rewards, advantages, the fused GTPO loss, AdamW, evaluation,
checkpoints and plots, in a loop you can read top to bottom (`train.py`).

One job per module: `config` (the settings, one dataclass, and the command line), `data` and `rewards` (the
problems and how answers are scored), `model` (loading), `sampling` (rollouts, each prompt run once),
`distributed` (DDP / FSDP2 under torchrun), `adapters` (LoRA and --beta's reference), `optimizer` (AdamW, float32
master weights), `checkpoint` (checkpoint-STEP folders and the run's state), `metrics_log`
(metrics.jsonl), `stopping` (stop requests and why a run stopped), `seeding` (a step's random draws),
`plots`, `compare` (runs side by side), `answers` (a saved model's wrong held-out answers), `quantisation`."""
