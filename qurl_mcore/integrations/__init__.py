"""Adapters that put QuRL's and MoEResQ's numerics inside other RL loops (verl, slime).

Each adapter is thin: it translates the host framework's arguments and calls the same functions our own loop
calls (`qurl_mcore.rl.losses`, `qurl_mcore.megatron.spec`, the SGLang plugin). docs/integrations.md says how a
run of each framework loads them.
"""
