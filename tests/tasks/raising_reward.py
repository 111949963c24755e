"""A reward module that fails as it is imported (`data.reward: tests.tasks.raising_reward:score`)."""
raise RuntimeError("this module needs a GPU to import")
