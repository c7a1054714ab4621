"""At the default precision (bf16 engine weights, bf16-autocast trainer) the trainer's
`forward` of a sampled sequence agrees with the sampler's log-probs within bf16's
rounding; test_tinker_api.py checks the fp32 case to 1e-4."""

import numpy as np
import pytest
from tinker_server import API_KEY, datum, serve_tinker

pytest.importorskip("peft")
tinker = pytest.importorskip("tinker")


@pytest.mark.heavy  # its own server and engine process, in bf16
def test_the_trainer_scores_a_sample_as_the_bf16_sampler_did(tiny_model_dir, tmp_path):
    with (
        serve_tinker(tiny_model_dir, tmp_path, dtype="bfloat16") as url,
        tinker.ServiceClient(base_url=url, api_key=API_KEY) as service,
    ):
        trainer = service.create_lora_training_client(
            base_model=str(tiny_model_dir), rank=8, seed=1
        ).result()
        sampler = trainer.save_weights_and_get_sampling_client().result()
        prompt = tinker.types.ModelInput.from_ints([3, 14, 15, 92, 65])
        params = tinker.types.SamplingParams(max_tokens=16, seed=7, stop=[])
        result = sampler.sample(prompt, num_samples=4, sampling_params=params).result()
        errors = []
        for seq in result.sequences:
            tokens = prompt.to_ints() + list(seq.tokens)
            scored = trainer.forward(
                [datum(tokens, weights=np.ones(len(tokens) - 1))], "cross_entropy"
            )
            learner = scored.result().loss_fn_outputs[0]["logprobs"].to_numpy()
            errors.extend(np.abs(learner[-len(seq.tokens) :] - np.array(seq.logprobs)))
    print(f"bf16 |trainer - sampler| mean {np.mean(errors):.4f} max {np.max(errors):.4f}")
    # measured on the tiny model: mean 0.004, max 0.013 (bf16 has 8 bits of mantissa)
    assert np.mean(errors) < 0.01 and np.max(errors) < 0.05, (np.mean(errors), np.max(errors))
