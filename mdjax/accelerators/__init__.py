"""Trained decoding accelerators: small models fitted on a frozen denoiser's rollouts that
let a sampler take fewer steps. `learn2pd`: Learn2PD's commit filter and its objective
(`python -m mdjax.accelerators.learn2pd`), sampled by the `learned_commit` family."""
