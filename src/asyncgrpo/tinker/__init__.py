"""A Tinker-compatible training service: the `tinker` SDK (0.38) as a second front door.

Programs written against Thinking Machines' Tinker API (tinker-cookbook recipes, rLLM's
tinker backend) own the RL loop and call `forward_backward`, `optim_step`,
`save_weights_for_sampler` and `sample` on a remote LoRA model. This package serves that
API on asyncgrpo's trainer and engine, so such a program runs unmodified against a local
server. The wire format is the SDK's own (its protobuf classes are imported from the
`tinker` package, the optional extra `asyncgrpo[tinker]`); `wire.py` tabulates what each
route sends and what the SDK expects back.
"""
