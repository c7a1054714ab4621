"""The Tinker wire, checked against the `tinker` SDK's own client-side converters.

Requests are built the way a user program builds them (the SDK's `Datum`, `ModelInput`,
`TensorData`, `SampleRequest`) and turned into bytes or JSON by the SDK's own
`request_conv` and `model_dump`; answers are read back by the SDK's `response_conv` and
pydantic types. So a test passes only if the SDK and this server agree on every byte.
Every bad input must come back as a `TinkerUserError` naming the field at fault, and the
limits must refuse before the big arrays are built.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")

from tinker import types  # noqa: E402
from tinker._compat import model_dump  # noqa: E402
from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import (  # noqa: E402
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from asyncgrpo.tinker.errors import TinkerUserError, as_error_body  # noqa: E402
from asyncgrpo.tinker.json_wire import (  # noqa: E402
    decode_adam_params,
    decode_create_model,
    decode_optim_step,
)
from asyncgrpo.tinker.limits import TinkerLimits  # noqa: E402
from asyncgrpo.tinker.sample_wire import (  # noqa: E402
    SampledSequence,
    check_sample,
    decode_sample_request,
    encode_sample_response,
)
from asyncgrpo.tinker.wire import (  # noqa: E402
    REQUIRED_INPUTS,
    check_datums,
    check_loss_config,
    decode_forward_backward,
    encode_forward_backward_output,
    tinker_protobuf,
)

LIMITS = TinkerLimits()
DATA = "forward_backward_input.data"


def rl_datum(tokens=(5, 6, 7, 8), advantage=0.5) -> types.Datum:
    """A datum as an RL loop builds it: two text chunks, numpy and list inputs mixed."""
    n = len(tokens)
    model_input = types.ModelInput(
        chunks=[
            types.EncodedTextChunk(tokens=list(tokens[:2])),
            types.EncodedTextChunk(tokens=list(tokens[2:])),
        ]
    )
    return types.Datum(
        model_input=model_input,
        loss_fn_inputs={
            "target_tokens": np.array([*tokens[1:], 3]),
            "logprobs": np.linspace(-2.0, -0.5, n).astype(np.float32),
            "advantages": [advantage] * n,
        },
    )


def fb_message(datums, loss_fn="ppo", config=None, forward_only=False):
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=datums, loss_fn=loss_fn, loss_fn_config=config
        ),
        model_id="sess:train:0",
        seq_id=5,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg


def fb_body(datums, **kwargs) -> bytes:
    return fb_message(datums, **kwargs).SerializeToString()


def refused(body, field: str, limits=LIMITS) -> str:
    with pytest.raises(TinkerUserError) as caught:
        decode_forward_backward(body, limits)
    assert caught.value.field == field
    assert str(caught.value).startswith(field)
    return caught.value.problem


# -- forward_backward requests --------------------------------------------------------------


def test_a_forward_backward_request_decodes_to_what_the_user_built():
    datums = [rl_datum(), rl_datum(tokens=(1, 2, 3), advantage=-1.0)]
    body = fb_body(datums, config={"clip_low_threshold": 0.7, "clip_high_threshold": 1.3})
    call = decode_forward_backward(body, LIMITS)
    assert (call.model_id, call.seq_id, call.loss_fn) == ("sess:train:0", 5, "ppo")
    assert call.loss_fn_config == pytest.approx(
        {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}
    )
    assert call.forward_only is False
    assert [d.tokens.tolist() for d in call.datums] == [[5, 6, 7, 8], [1, 2, 3]]
    for sent, got in zip(datums, call.datums):
        assert got.tokens.dtype == np.int64 and got.length == len(got.tokens)
        assert set(got.inputs) == {"target_tokens", "logprobs", "advantages"}
        assert got.inputs["target_tokens"].dtype == np.int64
        assert got.inputs["logprobs"].dtype == got.inputs["advantages"].dtype == np.float32
        for name, tensor in sent.loss_fn_inputs.items():
            np.testing.assert_array_equal(got.inputs[name], tensor.to_numpy())
    assert decode_forward_backward(fb_body(datums, forward_only=True), LIMITS).forward_only


def test_text_config_values_arrive_and_the_legacy_float_map_is_read_too():
    msg = fb_message([rl_datum()], config={"mode": "fast", "beta": 0.25})
    assert decode_forward_backward(msg.SerializeToString(), LIMITS).loss_fn_config == {
        "mode": "fast",
        "beta": 0.25,
    }
    msg.ClearField("loss_fn_config_v2")  # an older SDK sends the float-only map alone
    assert decode_forward_backward(msg.SerializeToString(), LIMITS).loss_fn_config == {"beta": 0.25}


def test_an_empty_shape_means_one_dimension_and_int_weights_widen_to_float():
    msg = fb_message(
        [
            types.Datum(
                model_input=types.ModelInput.from_ints([4, 5, 6]),
                loss_fn_inputs={"target_tokens": [5, 6, 7], "weights": np.array([1, 0, 2])},
            )
        ],
        loss_fn="cross_entropy",
    )
    for tensor in msg.data[0].loss_fn_inputs.values():
        tensor.ClearField("shape")  # rLLM sends no shape
    assert msg.data[0].loss_fn_inputs["weights"].dtype == pb.DTYPE_INT64
    got = decode_forward_backward(msg.SerializeToString(), LIMITS).datums[0]
    assert got.inputs["target_tokens"].tolist() == [5, 6, 7]
    assert got.inputs["weights"].dtype == np.float32
    assert got.inputs["weights"].tolist() == [1.0, 0.0, 2.0]


def sparse_column(values, rows, dtype="float32"):
    """A [rows, 1] CSR tensor holding `values` ({row: value}), built as the SDK's TensorData."""
    crow = np.zeros(rows + 1, dtype=np.int64)
    for row in values:
        crow[row + 1 :] += 1
    return types.TensorData(
        data=np.array([values[r] for r in sorted(values)], dtype=dtype),
        dtype=dtype,
        shape=[rows, 1],
        sparse_crow_indices=crow.tolist(),
        sparse_col_indices=[0] * len(values),
    )


def test_a_sparse_csr_column_densifies_with_zeros_elsewhere():
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={
            "target_tokens": [2, 3, 4, 5],
            "weights": sparse_column({1: 0.5, 3: 2.0}, 4),
        },
    )
    got = decode_forward_backward(fb_body([datum], loss_fn="cross_entropy"), LIMITS).datums[0]
    assert got.inputs["weights"].tolist() == [0.0, 0.5, 0.0, 2.0]


def tampered(edit) -> bytes:
    msg = fb_message([rl_datum(), rl_datum()])
    edit(msg.data[1])
    return msg.SerializeToString()


ADV = f"{DATA}[1].loss_fn_inputs.advantages"


def set_shape(datum, shape):
    datum.loss_fn_inputs["advantages"].shape[:] = shape


@pytest.mark.parametrize(
    ("edit", "field", "words"),
    [
        (
            lambda d: setattr(
                d.loss_fn_inputs["advantages"], "dense", np.zeros(3, "<f4").tobytes()
            ),
            ADV,
            "3 values",
        ),
        (lambda d: set_shape(d, [4, 1, 1]), ADV, "shape [4, 1, 1]"),
        (lambda d: set_shape(d, [4, 2]), ADV, "shape [4, 2]"),
        (
            lambda d: setattr(d.loss_fn_inputs["advantages"], "dtype", pb.DTYPE_INT32),
            ADV,
            "DTYPE_INT32",
        ),
        (lambda d: setattr(d.loss_fn_inputs["advantages"], "dense", b"\0" * 15), ADV, "bytes"),
        (
            lambda d: setattr(
                d.loss_fn_inputs["advantages"],
                "dense",
                np.array([0, np.nan, 0, 0], "<f4").tobytes(),
            ),
            ADV,
            "finite",
        ),
        (
            lambda d: d.loss_fn_inputs["target_tokens"].CopyFrom(
                pb.Tensor(dense=np.zeros(4, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32)
            ),
            f"{DATA}[1].loss_fn_inputs.target_tokens",
            "int64",
        ),
        (
            lambda d: setattr(d.model_input[1].encoded_text, "tokens", b"\1\0\0"),
            f"{DATA}[1].model_input.chunks[1]",
            "int32",
        ),
        (
            lambda d: d.model_input.add().image.CopyFrom(pb.ImageChunk(data=b"png", format="png")),
            f"{DATA}[1].model_input.chunks[2]",
            "not supported",
        ),
        (lambda d: d.ClearField("model_input"), f"{DATA}[1].model_input", "no tokens"),
    ],
    ids=[
        "length",
        "3-d",
        "two-columns",
        "int32",
        "ragged-bytes",
        "nan",
        "float-ids",
        "token-bytes",
        "image",
        "empty-input",
    ],
)
def test_a_bad_tensor_or_model_input_is_refused_naming_its_field(edit, field, words):
    assert words in refused(tampered(edit), field)


def test_a_refusal_names_the_operation_so_its_future_can_fail_in_turn():
    with pytest.raises(TinkerUserError) as caught:
        decode_forward_backward(tampered(lambda d: set_shape(d, [4, 2])), LIMITS)
    assert caught.value.request_key == ("sess:train:0", 5)
    with pytest.raises(TinkerUserError) as caught:
        decode_forward_backward(fb_body([rl_datum()], loss_fn=""), LIMITS)
    assert caught.value.request_key == ("sess:train:0", 5)
    with pytest.raises(TinkerUserError) as caught:
        decode_forward_backward(b"\xff\xff", LIMITS)
    assert caught.value.request_key is None


def csr_edit(crow, col, values=(1.0,)):
    def edit(d):
        d.loss_fn_inputs["advantages"].CopyFrom(
            pb.Tensor(
                dtype=pb.DTYPE_FLOAT32,
                shape=[4, 1],
                sparse_csr=pb.SparseCsr(
                    values=np.array(values, "<f4").tobytes(),
                    crow_indices=np.array(crow, "<i8").tobytes(),
                    col_indices=np.array(col, "<i8").tobytes(),
                ),
            )
        )

    return edit


@pytest.mark.parametrize(
    ("crow", "col", "part"),
    [
        ([0, 1, 1, 1, 1], [1], "col_indices"),  # column 1 of a one-column tensor
        ([0, 1, 0, 1, 1], [0], "crow_indices"),  # falls back
        ([0, 1, 1, 1], [0], "crow_indices"),  # one row short
        ([0, 1, 1, 1, 2], [0, 0], "values"),  # two indices, one value
        ([0, 2, 2, 2, 2], [0, 0], "col_indices"),  # row 0 listed twice
    ],
)
def test_sparse_indices_are_checked_before_any_write(crow, col, part):
    values = [1.0] * max(len(col), 1) if part == "col_indices" else [1.0]
    assert refused(tampered(csr_edit(crow, col, values)), f"{ADV}.{part}")


def test_a_body_that_is_not_protobuf_is_a_user_error():
    assert "not a ForwardBackwardRequest" in refused(b"\xff\xff\xff\xff", "")


# -- limits, refused before the arrays are built ----------------------------------------------


def no_array_building(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("an array was built before the limits were checked")

    for name in ("concatenate", "frombuffer", "zeros"):
        monkeypatch.setattr(np, name, forbidden)


def test_a_body_over_the_byte_limit_is_refused_unparsed():
    junk = b"\xff" * 2048  # parsing it would say "not a ForwardBackwardRequest"
    assert "2048 bytes" in refused(junk, "", TinkerLimits(max_request_bytes=1024))


def test_counts_over_the_limits_are_refused_from_byte_sizes_alone(monkeypatch):
    body = fb_body([rl_datum(), rl_datum(tokens=tuple(range(1, 41)))])
    no_array_building(monkeypatch)
    assert "2 datums" in refused(body, DATA, TinkerLimits(max_datums_per_request=1))
    assert "40 tokens" in refused(
        body, f"{DATA}[1].model_input", TinkerLimits(max_tokens_per_datum=39)
    )
    assert "44 tokens" in refused(body, DATA, TinkerLimits(max_total_tokens_per_request=43))


def test_a_huge_declared_sparse_shape_is_refused_before_densifying(monkeypatch):
    def edit(d):
        csr_edit([0, 1, 1, 1, 1], [0])(d)
        d.loss_fn_inputs["advantages"].shape[:] = [10**12, 1]

    body = tampered(edit)
    monkeypatch.setattr(np, "zeros", lambda *a, **k: pytest.fail("densified"))
    assert "shape [1000000000000, 1]" in refused(body, ADV)


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="max_num_samples"):
        TinkerLimits(max_num_samples=0)


# -- what each loss takes ------------------------------------------------------------------


def test_the_required_inputs_are_those_the_tinker_docs_list():
    rl = ["target_tokens", "logprobs", "advantages"]
    assert {k: sorted(v) for k, v in REQUIRED_INPUTS.items()} == {
        "cross_entropy": ["target_tokens", "weights"],
        "importance_sampling": sorted(rl),
        "ppo": sorted(rl),
        "cispo": sorted(rl),
        "dro": sorted(rl),
        "gspo": sorted([*rl, "sequence_ratio_mask"]),
    }


def decoded(datums, loss_fn="ppo"):
    return decode_forward_backward(fb_body(datums, loss_fn=loss_fn), LIMITS).datums


def check_refused(datums, loss_fn, field, vocab=100, max_length=64) -> str:
    with pytest.raises(TinkerUserError) as caught:
        check_datums(datums, loss_fn, vocab, max_length)
    assert caught.value.field == field
    return caught.value.problem


@pytest.mark.parametrize("loss_fn", sorted(REQUIRED_INPUTS))
def test_each_missing_input_is_named(loss_fn):
    full = {
        "target_tokens": [1, 2, 3],
        "weights": [1.0] * 3,
        "logprobs": [-1.0] * 3,
        "advantages": [1.0] * 3,
        "sequence_ratio_mask": [1.0] * 3,
    }
    inputs = {k: full[k] for k in REQUIRED_INPUTS[loss_fn]}
    model_input = types.ModelInput.from_ints([7, 8, 9])
    check_datums(
        decoded([types.Datum(model_input=model_input, loss_fn_inputs=inputs)]), loss_fn, 100, 64
    )
    for name in inputs:
        partial = {k: v for k, v in inputs.items() if k != name}
        datums = decoded([types.Datum(model_input=model_input, loss_fn_inputs=partial)])
        assert "is missing" in check_refused(datums, loss_fn, f"{DATA}[0].loss_fn_inputs.{name}")


def test_an_input_the_loss_does_not_take_is_refused():
    datum = rl_datum()
    datum.loss_fn_inputs["weights"] = types.TensorData(data=[1.0] * 4, dtype="float32")
    assert "not an input of loss_fn 'ppo'" in check_refused(
        decoded([datum]), "ppo", f"{DATA}[0].loss_fn_inputs.weights"
    )


def test_token_ids_outside_the_vocabulary_and_overlong_datums_are_refused():
    datums = decoded([rl_datum(), rl_datum(tokens=(1, 2, 300))])
    assert "token id 300 at position 2" in check_refused(
        datums, "ppo", f"{DATA}[1].model_input", vocab=300
    )
    datums = decoded([rl_datum(tokens=(1, 2, 299))])  # target_tokens end with ...299, 3
    datums[0].inputs["target_tokens"][1] = -4
    assert "token id -4 at position 1" in check_refused(
        datums, "ppo", f"{DATA}[0].loss_fn_inputs.target_tokens", vocab=300
    )
    assert "context of 3" in check_refused(
        decoded([rl_datum()]), "ppo", f"{DATA}[0].model_input", max_length=3
    )


@pytest.mark.parametrize(
    ("loss_fn", "words"),
    [
        ("stable_reinforce", ["importance_sampling", "ppo"]),
        ("reinforce", ["cispo, cross_entropy, dro, gspo, importance_sampling, ppo"]),
        ("custom", ["client"]),
    ],
)
def test_a_loss_not_served_is_refused_with_the_alternatives(loss_fn, words):
    problem = check_refused(decoded([rl_datum()]), loss_fn, "forward_backward_input.loss_fn")
    assert all(word in problem for word in words)


@pytest.mark.parametrize(
    ("loss_fn", "config", "field"),
    [
        ("importance_sampling", {"beta": 0.1}, "forward_backward_input.loss_fn_config.beta"),
        (
            "ppo",
            {"clip_low_threshold": "low"},
            "forward_backward_input.loss_fn_config.clip_low_threshold",
        ),
        ("ppo", {"clip_low_threshold": 1.1}, "forward_backward_input.loss_fn_config"),
        ("dro", {"beta": -1.0}, "forward_backward_input.loss_fn_config.beta"),
        ("dro", {"beta": float("nan")}, "forward_backward_input.loss_fn_config.beta"),
    ],
)
def test_loss_config_is_checked_per_loss(loss_fn, config, field):
    with pytest.raises(TinkerUserError) as caught:
        check_loss_config(loss_fn, config)
    assert caught.value.field == field


def test_served_loss_configs_pass():
    check_loss_config("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28})
    check_loss_config("cispo", {"clip_high_threshold": 4.0})
    check_loss_config("dro", {"beta": 0.05})
    check_loss_config("cross_entropy", {})


# -- forward_backward results --------------------------------------------------------------


def test_the_sdk_reads_back_each_datums_logprobs_and_the_metrics():
    logprobs = [np.array([-1.0, -2.5, -0.125]), np.array([-0.5], dtype=np.float32)]
    out = deserialize_forward_backward_output(
        encode_forward_backward_output(logprobs, {"loss:sum": 4.25, "clipped:mean": 0.5})
    )
    assert out.metrics == {"loss:sum": 4.25, "clipped:mean": 0.5}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.5, -0.125], [-0.5]]
    assert [o["logprobs"].shape for o in out.loss_fn_outputs] == [[3], [1]]
    assert out.loss_fn_outputs[0]["logprobs"].dtype == "float32"


def test_the_sdks_chunk_merge_sums_loss_and_weights_means_by_datums():
    first = deserialize_forward_backward_output(
        encode_forward_backward_output([np.zeros(2)] * 3, {"loss:sum": 1.0, "ratio:mean": 1.0})
    )
    second = deserialize_forward_backward_output(
        encode_forward_backward_output([np.zeros(2)], {"loss:sum": 2.0, "ratio:mean": 3.0})
    )
    merged = combine_fwd_bwd_output_results([first, second])
    assert merged.metrics == {"loss:sum": 3.0, "ratio:mean": pytest.approx((3 * 1 + 3) / 4)}
    assert len(merged.loss_fn_outputs) == 4


def test_no_datums_encode_to_an_empty_output():
    out = deserialize_forward_backward_output(encode_forward_backward_output([], {"loss:sum": 0.0}))
    assert out.loss_fn_outputs == [] and out.metrics == {"loss:sum": 0.0}


@pytest.mark.parametrize("key", ["loss", "loss:sum:x", "loss:median", ":sum"])
def test_a_metric_key_without_one_known_reduction_is_a_server_bug(key):
    with pytest.raises(AssertionError, match="name:reduction"):
        encode_forward_backward_output([np.zeros(1)], {key: 1.0})


# -- errors and the optional dependency ----------------------------------------------------


def test_a_user_error_body_is_what_the_sdk_raises_on_without_retrying():
    error = TinkerUserError(ADV, "holds 3 values")
    body = as_error_body(error)
    parsed = types.RequestFailedResponse.model_validate(json.loads(json.dumps(body)))
    assert parsed.category is types.RequestErrorCategory.User
    assert parsed.error == f"{ADV}: holds 3 values"
    server = as_error_body(RuntimeError("out of memory"))
    assert server == {"error": "RuntimeError: out of memory", "category": "server"}
    assert types.RequestErrorCategory(server["category"]) is types.RequestErrorCategory.Server
    with pytest.raises(ValueError):
        as_error_body(error, "unknown")


def test_without_the_sdk_the_error_says_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tinker.proto", None)
    with pytest.raises(ImportError, match=r"pip install 'asyncgrpo\[tinker\]'"):
        tinker_protobuf()


# -- sampling requests -----------------------------------------------------------------------


def sample_body(prompt=(3, 4, 5), **overrides) -> dict:
    """A SampleRequest as `SamplingClient.sample` posts it (the SDK's own JSON dump)."""
    params = overrides.pop("sampling_params", types.SamplingParams(max_tokens=16))
    request = types.SampleRequest(
        sampling_session_id="sess:sample:0",
        seq_id=2,
        num_samples=overrides.pop("num_samples", 4),
        prompt=overrides.pop("model_input", types.ModelInput.from_ints(list(prompt))),
        sampling_params=params,
        prompt_logprobs=overrides.pop("prompt_logprobs", False),
        record_stability_info=False,
        **overrides,
    )
    dumped = model_dump(request, exclude_unset=False, exclude_none=True, mode="json")
    return json.loads(json.dumps(dumped))


def test_a_sample_request_decodes_to_what_the_user_asked():
    params = types.SamplingParams(
        max_tokens=16, seed=2**64 + 5, stop=["\n\n", "END"], temperature=0.7, top_k=40, top_p=0.9
    )
    call = decode_sample_request(
        sample_body(sampling_params=params, prompt_logprobs=True, topk_prompt_logprobs=3), LIMITS
    )
    assert (call.sampling_session_id, call.seq_id, call.num_samples) == ("sess:sample:0", 2, 4)
    assert call.prompt.tolist() == [3, 4, 5] and call.prompt.dtype == np.int64
    assert (call.max_tokens, call.temperature, call.top_k, call.top_p) == (16, 0.7, 40, 0.9)
    assert call.seed == (2**64 + 5) % (2**63 - 1)
    assert call.stop == ("\n\n", "END") and call.stop_strings == ("\n\n", "END")
    assert call.stop_at_eos and call.stop_token_ids == ()
    assert (call.prompt_logprobs, call.topk_prompt_logprobs) == (True, 3)
    assert call.prompt_logprobs_last_n is None


@pytest.mark.parametrize(
    ("stop", "expected", "eos"),
    [
        (None, None, True),
        ("###", ("###",), True),
        ([128009, 128001], (128009, 128001), True),
        ([], (), False),  # the SDK: [] disables every stop, EOS included
    ],
)
def test_stop_keeps_its_four_meanings(stop, expected, eos):
    params = types.SamplingParams(max_tokens=8, stop=stop)
    call = decode_sample_request(sample_body(sampling_params=params), LIMITS)
    assert call.stop == expected and call.stop_at_eos is eos


def test_the_sdk_defaults_arrive_as_defaults():
    # compute_logprobs: one token, prompt log-probs, nothing else set
    call = decode_sample_request(
        sample_body(
            sampling_params=types.SamplingParams(max_tokens=1),
            num_samples=1,
            prompt_logprobs=True,
            prompt_logprobs_last_n=2,
        ),
        LIMITS,
    )
    assert (call.temperature, call.top_k, call.top_p, call.seed) == (1.0, -1, 1.0, None)
    assert (call.max_tokens, call.prompt_logprobs_last_n) == (1, 2)
    call = decode_sample_request(sample_body(sampling_params=types.SamplingParams()), LIMITS)
    assert call.max_tokens is None


def image_prompt():
    image = types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=2)
    return types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1]), image])


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        ({"num_samples": 0}, "num_samples", "[1, 128]"),
        ({"num_samples": 129}, "num_samples", "[1, 128]"),
        ({"sampling_params": types.SamplingParams(max_tokens=0)}, "sampling_params.max_tokens", ""),
        (
            {"sampling_params": types.SamplingParams(max_tokens=40000)},
            "sampling_params.max_tokens",
            "32768",
        ),
        (
            {"sampling_params": types.SamplingParams(max_tokens=4, temperature=-0.5)},
            "sampling_params.temperature",
            ">= 0",
        ),
        (
            {"sampling_params": types.SamplingParams(max_tokens=4, top_k=0)},
            "sampling_params.top_k",
            "-1",
        ),
        (
            {"sampling_params": types.SamplingParams(max_tokens=4, top_p=0.0)},
            "sampling_params.top_p",
            "(0, 1]",
        ),
        (
            {"sampling_params": types.SamplingParams(max_tokens=4, stop=["a", ""])},
            "sampling_params.stop",
            "non-empty",
        ),
        ({"model_input": image_prompt()}, "prompt.chunks[1]", "not supported"),
        ({"topk_sample_logprobs": 2}, "topk_sample_logprobs", "not supported"),
        ({"prompt_alt_tokens_k": 2}, "prompt_alt_tokens_k", "not supported"),
        ({"topk_prompt_logprobs": 21}, "topk_prompt_logprobs", "[0, 20]"),
        ({"prompt_logprobs_last_n": 1}, "prompt_logprobs_last_n", "needs prompt_logprobs"),
        (
            {"prompt_logprobs": True, "prompt_logprobs_last_n": 3},
            "prompt_logprobs_last_n",
            "len(prompt) - 1 = 2",
        ),
    ],
)
def test_a_bad_sample_request_is_refused_naming_its_field(overrides, field, words):
    with pytest.raises(TinkerUserError) as caught:
        decode_sample_request(sample_body(**overrides), LIMITS)
    assert caught.value.field == field and words in caught.value.problem


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda b: b.pop("sampling_session_id"), "sampling_session_id"),
        (lambda b: b.pop("seq_id"), "seq_id"),
        (lambda b: b.__setitem__("seq_id", True), "seq_id"),
        (
            lambda b: b["prompt"]["chunks"][0].__setitem__("tokens", [1, 2.5]),
            "prompt.chunks[0].tokens",
        ),
        (lambda b: b["prompt"]["chunks"][0].__setitem__("tokens", [-1]), "prompt.chunks[0].tokens"),
        (lambda b: b["prompt"].__setitem__("chunks", []), "prompt.chunks"),
        (lambda b: b["sampling_params"].__setitem__("stop", ["a", 3]), "sampling_params.stop"),
        (
            lambda b: b["sampling_params"].__setitem__("temperture", 0.5),
            "sampling_params.temperture",
        ),
        (lambda b: b["sampling_params"].__setitem__("top_p", "high"), "sampling_params.top_p"),
    ],
)
def test_hand_written_json_is_refused_naming_its_field(edit, field):
    body = sample_body()
    edit(body)
    with pytest.raises(TinkerUserError) as caught:
        decode_sample_request(body, LIMITS)
    assert caught.value.field == field
    if field not in ("sampling_session_id", "seq_id"):
        assert caught.value.request_key == ("sess:sample:0", 2)


def test_a_long_prompt_is_refused_before_its_ids_are_read(monkeypatch):
    body = sample_body(prompt=range(1, 41))
    monkeypatch.setattr(np, "array", lambda *a, **k: pytest.fail("converted"))
    with pytest.raises(TinkerUserError) as caught:
        decode_sample_request(body, TinkerLimits(max_tokens_per_datum=39))
    assert caught.value.field == "prompt" and "39" in caught.value.problem


def test_check_sample_resolves_max_tokens_and_refuses_what_the_model_cannot_do():
    call = decode_sample_request(sample_body(sampling_params=types.SamplingParams()), LIMITS)
    assert check_sample(call, vocab_size=10, max_length=8).max_tokens == 5  # 8 - 3 prompt
    call = decode_sample_request(sample_body(), LIMITS)  # max_tokens=16
    assert check_sample(call, 10, 19).max_tokens == 16
    for vocab, length, field in (
        (10, 18, "sampling_params.max_tokens"),
        (5, 64, "prompt"),
        (10, 3, "prompt"),
    ):
        with pytest.raises(TinkerUserError) as caught:
            check_sample(call, vocab, length)
        assert caught.value.field == field
    stops = decode_sample_request(
        sample_body(sampling_params=types.SamplingParams(max_tokens=2, stop=[7, 10])), LIMITS
    )
    with pytest.raises(TinkerUserError, match="token id 10"):
        check_sample(stops, 10, 64)


# -- sampling responses ----------------------------------------------------------------------


def test_the_sdk_reads_back_sequences_prompt_logprobs_and_topk():
    sequences = [
        SampledSequence(tokens=[5, 6, 2], logprobs=[-0.5, -1.25, -0.125], stop_reason="stop"),
        SampledSequence(
            tokens=np.array([7, 7]), logprobs=np.array([-2.0, -3.0]), stop_reason="length"
        ),
    ]
    topk = [None, [(4, -0.25), (9, -1.5)], [(5, -0.75)]]
    response = deserialize_sample_response(
        encode_sample_response(sequences, [None, -0.25, -2.5], topk)
    )
    assert [s.tokens for s in response.sequences] == [[5, 6, 2], [7, 7]]
    assert [s.logprobs for s in response.sequences] == [[-0.5, -1.25, -0.125], [-2.0, -3.0]]
    assert [s.stop_reason for s in response.sequences] == ["stop", "length"]
    assert response.prompt_logprobs == [None, -0.25, -2.5]
    assert response.topk_prompt_logprobs == [None, [(4, -0.25), (9, -1.5)], [(5, -0.75)]]


def test_the_sdk_attaches_one_sequence_id_per_sequence():
    from tinker.lib.public_interfaces.sampling_client import _attach_sequence_ids

    sequences = [SampledSequence(tokens=[1], logprobs=[-1.0], stop_reason="length")] * 3
    response = deserialize_sample_response(encode_sample_response(sequences))
    stamped = _attach_sequence_ids(response, ["a", "b", "c"])
    assert [s.sequence_id for s in stamped.sequences] == ["a", "b", "c"]
    assert response.prompt_logprobs is None and response.topk_prompt_logprobs is None


def test_prompt_logprobs_last_n_hides_the_earlier_positions():
    response = deserialize_sample_response(
        encode_sample_response(
            [SampledSequence(tokens=[1], logprobs=[-1.0], stop_reason="length")],
            [None, -1.0, -2.0, -3.0],
            [None, [(1, -1.0)], [(2, -2.0)], [(3, -3.0)]],
            prompt_logprobs_last_n=2,
        )
    )
    assert response.prompt_logprobs == [None, None, -2.0, -3.0]
    assert response.topk_prompt_logprobs == [None, None, [(2, -2.0)], [(3, -3.0)]]


# -- the other JSON routes -------------------------------------------------------------------


def test_adam_params_default_as_the_sdks_and_round_trip():
    assert vars(decode_adam_params({})) == types.AdamParams().model_dump()
    request = types.OptimStepRequest(
        adam_params=types.AdamParams(learning_rate=3e-5, eps=1e-8, grad_clip_norm=1.0),
        model_id="sess:train:0",
        seq_id=4,
    )
    call = decode_optim_step(
        json.loads(
            json.dumps(model_dump(request, exclude_unset=False, exclude_none=True, mode="json"))
        )
    )
    assert (call.model_id, call.seq_id) == ("sess:train:0", 4)
    assert (call.adam.learning_rate, call.adam.eps, call.adam.grad_clip_norm) == (3e-5, 1e-8, 1.0)
    assert (call.adam.beta1, call.adam.beta2, call.adam.weight_decay) == (0.9, 0.95, 0.0)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"beta1": 1.0}, "adam_params.beta1"),
        ({"learning_rate": -1e-4}, "adam_params.learning_rate"),
        ({"eps": 0}, "adam_params.eps"),
        ({"learning_rate": "1e-4"}, "adam_params.learning_rate"),
        ({"weight_decay": True}, "adam_params.weight_decay"),
        ({"lr": 1e-4}, "adam_params.lr"),
        ({"type": "dimuon", "learning_rate": 0.1}, "adam_params.type"),
    ],
)
def test_bad_adam_params_are_refused_naming_the_field(params, field):
    with pytest.raises(TinkerUserError) as caught:
        decode_optim_step({"model_id": "m", "seq_id": 1, "adam_params": params})
    assert caught.value.field == field


def create_model_body(**lora) -> dict:
    request = types.CreateModelRequest(
        session_id="sess",
        model_seq_id=2,
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        lora_config=types.LoraConfig(**{"rank": 8, **lora}),
    )
    return json.loads(
        json.dumps(model_dump(request, exclude_unset=False, exclude_none=True, mode="json"))
    )


def test_create_model_reads_the_lora_config_and_the_model_id_the_sdk_assumes():
    call = decode_create_model(create_model_body(seed=3, train_unembed=False), LIMITS)
    assert (call.rank, call.seed, call.base_model) == (8, 3, "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert (call.train_mlp, call.train_attn, call.train_unembed) == (True, True, False)
    assert call.model_id == "sess:train:2"
    assert decode_create_model(create_model_body(), LIMITS).seed is None


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda b: b["lora_config"].__setitem__("rank", 0), "lora_config.rank"),
        (lambda b: b["lora_config"].__setitem__("rank", 512), "lora_config.rank"),
        (lambda b: b.pop("lora_config"), "lora_config"),
        (
            lambda b: b["lora_config"].update(
                train_mlp=False, train_attn=False, train_unembed=False
            ),
            "lora_config",
        ),
        (
            lambda b: b.__setitem__("optimizer_config", {"type": "dimuon", "version": 1}),
            "optimizer_config.type",
        ),
        (lambda b: b.pop("session_id"), "session_id"),
    ],
)
def test_a_bad_create_model_is_refused_naming_the_field(edit, field):
    body = create_model_body()
    edit(body)
    with pytest.raises(TinkerUserError) as caught:
        decode_create_model(body, LIMITS)
    assert caught.value.field == field
