"""The trainer side: losses, advantages and optimizer steps on the policy, on one or many ranks."""
