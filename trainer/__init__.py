"""A lean GTPO trainer: rollouts, rewards, advantages, the fused GTPO loss, AdamW, evaluation,
checkpoints and plots, in a loop you can read top to bottom (`train.py`)."""
