"""mdjax.rl: d1 parity, the RL objectives, the reward functions and tasks."""
