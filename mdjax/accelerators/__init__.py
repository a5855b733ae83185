"""Trained decoding accelerators: models fitted on a frozen teacher's rollouts that let a
sampler take fewer steps. `learn2pd`: Learn2PD's commit filter and its objective
(`python -m mdjax.accelerators.learn2pd`), sampled by the `learned_commit` family;
`distill`: the training objectives 'dparallel' (`dparallel`, certainty-forcing distillation)
and 'd3llm' (`d3llm`, pseudo-trajectory distillation), registered on import (train.py
imports it); `frontier`: trained points against the training-free frontier of their teacher
(equal calls, equal accuracy, AUP)."""
