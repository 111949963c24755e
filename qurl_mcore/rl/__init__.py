"""Policy losses, advantages and mismatch metrics for RL whose rollouts come from another policy.

The names each table accepts live here, without torch, so that the config's field checks (and `qurl --help`,
which imports the config) read them without loading torch; losses.py and metrics.py compute them.
"""

LOSSES = ("ppo", "naive", "decoupled", "tis", "mis", "acr", "acr_symmetric", "acr_trunc")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
KL_ESTIMATORS = ("k1", "k3")
