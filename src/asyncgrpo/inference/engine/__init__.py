"""The embedded inference engine: continuous batching that reports exact behaviour log-probs."""
