"""What is run beside or after training runs, not inside a training step: a study of many runs
(`study`), the comparison of finished runs (`compare`), a run's wrong held-out answers (`answers`), the quantised
model's check (`quantisation`) and a run's figure (`plots`, which the trainer also calls once, at the end of a run).
"""
