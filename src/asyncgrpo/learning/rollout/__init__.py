"""The rollout side: prompt rows in, scored and version-stamped groups out."""
