"""The sampler families, one module each: its frozen spec, its per-step plan and its update.

Each module registers its family on import (`mdjax.sampling.base.register`); importing
`mdjax.sampling` imports them all. A new family is one module here and one import line in
`mdjax/sampling/__init__.py`.
"""
