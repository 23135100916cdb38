"""The environment of examples/grpo_environment/rl_lookup.yaml (rl.environment: lookup_env:RowLookup), TRL's
environment_factory contract: reset(**row) before each rollout, public methods as the policy's tools."""

# A table the model never sees: the answer to "find k3" needs the tool.
TABLE = {"k0": "3", "k1": "0", "k2": "7", "k3": "4", "k4": "1", "k5": "8", "k6": "5", "k7": "2", "k8": "9", "k9": "6"}


class RowLookup:
    def reset(self, key=None, **row):
        self.key = key  # the row's `key` column
        return None  # nothing appended to the prompt

    def lookup(self) -> str:
        """Looks up the value of the key asked for.
        """
        return TABLE[self.key]
