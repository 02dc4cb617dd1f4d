"""Loss specifications and the one batch validation: the same specs and the same function at the gateway's door
and at the trainer's entry (``livelora.core.losses``), and one tensor function per spec."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness.server import MODEL

from livelora.clients.errors import BadRequestError, UnsupportedParameterError
from livelora.clients.types.tinker import Datum, ForwardBackwardInput, ForwardBackwardRequest, ModelInput, TensorData
from livelora.core.losses import LOSS_SPECS, REFUSED_LOSSES, LossSpec, get_spec, validate_batch, validate_loss_inputs
from livelora.trainer.logprobs import grad_positions
from livelora.trainer.losses import LOSS_FUNCTIONS, register
from livelora.trainer.model import TRAINER_FILLED_INPUTS, TrainingModel

REPO = Path(__file__).resolve().parent.parent
VOCAB, MAX_LEN = 49152, 64
TOKENS = [1, 504, 3458, 314, 4301]  # model_input (N = 5) of every generated datum


def client_inputs(spec: LossSpec, n: int = len(TOKENS)) -> dict[str, TensorData]:
    """A valid datum's ``loss_fn_inputs`` for ``spec``, built from the spec alone (every client input)."""
    out = {}
    for x in spec.inputs:
        if x.source != "client":
            continue
        if x.name == "target_tokens":
            out[x.name] = TensorData.from_list(TOKENS[1:] + [2], "int64")
        elif x.shape == "datum":
            out[x.name] = TensorData.from_list([x.allowed_values[0] if x.allowed_values else 0.5], "float32")
        else:
            out[x.name] = TensorData.from_list([0.0] + [1.0] * (n - 1), "float32")
    return out


def batch(spec: LossSpec, n_datums: int | None = None, **drop_or_replace) -> list[Datum]:
    data = []
    for i in range(n_datums if n_datums is not None else spec.min_batch):
        inputs = client_inputs(spec)
        if i == 0:
            for key, value in drop_or_replace.items():
                inputs.pop(key) if value is None else inputs.__setitem__(key, value)
        data.append(Datum(model_input=ModelInput.from_ints(TOKENS), loss_fn_inputs=inputs))
    return data


def check(data, loss_fn, config=None):
    return validate_batch(data, loss_fn, config, vocab_size=VOCAB, max_seq_len=MAX_LEN)


REQUIRED = [
    (name, x.name) for name, spec in LOSS_SPECS.items() for x in spec.inputs if x.required and x.source == "client"
]
CONFIG_BOUNDS = [(name, c) for name, spec in LOSS_SPECS.items() for c in spec.config]


# ------------------------------------------------------------------------------------------------ registries
def test_the_spec_registry_and_the_tensor_function_registry_hold_exactly_the_same_names():
    assert set(LOSS_SPECS) == set(LOSS_FUNCTIONS)
    assert all(spec.name == name for name, spec in LOSS_SPECS.items())
    assert not set(REFUSED_LOSSES) & set(LOSS_SPECS)
    with pytest.raises(KeyError, match="no LossSpec named 'hinge'"):
        register("hinge")


def test_every_trainer_filled_input_of_a_spec_is_one_the_trainer_computes():
    for spec in LOSS_SPECS.values():
        assert set(spec.trainer_inputs) <= TRAINER_FILLED_INPUTS, spec.name
        assert spec.needs_reference == ("ref_logprobs" in spec.trainer_inputs)


def test_every_spec_names_its_paper_or_docs_and_a_formula():
    for spec in LOSS_SPECS.values():
        assert "losses.md §" in spec.reference and spec.summary.startswith("L = "), spec.name


def test_the_sdk_loss_type_documents_every_built_in_and_refused_loss():
    """``LossFnType`` is a plain ``str`` (the server owns the list); its docstring must still name them all."""
    tree = ast.parse((REPO / "clients/types/tinker_training.py").read_text())
    body = tree.body
    at = next(
        i
        for i, node in enumerate(body)
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "LossFnType" for t in node.targets)
    )
    doc = body[at + 1].value.value
    for name in [*LOSS_SPECS, *REFUSED_LOSSES]:
        assert f"``{name}``" in doc, name
    assert ForwardBackwardInput.model_fields["loss_fn"].annotation is str


def test_the_shared_specs_and_validation_import_no_torch():
    code = (
        "import sys, livelora.core.losses, livelora.gateway.services.sessions; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('livelora.trainer')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# ------------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("name", sorted(LOSS_SPECS))
def test_a_batch_built_from_the_spec_passes_and_gets_the_default_config(name):
    resolved = check(batch(LOSS_SPECS[name]), name)
    assert resolved.spec is LOSS_SPECS[name]
    assert resolved.config == LOSS_SPECS[name].config_defaults


@pytest.mark.parametrize("name,key", REQUIRED)
def test_a_missing_required_input_is_a_400_naming_it(name, key):
    with pytest.raises(BadRequestError) as err:
        check(batch(LOSS_SPECS[name], **{key: None}), name)
    assert (err.value.status, err.value.param) == (400, f"data[0].loss_fn_inputs.{key}")
    assert key in err.value.message and name in err.value.message


@pytest.mark.parametrize("name", ["kto", "dpo"])
def test_inputs_the_trainer_computes_are_refused_from_clients_and_required_at_the_trainer(name):
    spec = LOSS_SPECS[name]
    ref = TensorData.from_list([-1.0] * len(TOKENS), "float32")
    with pytest.raises(BadRequestError, match=r"ref_logprobs: computed by the trainer") as err:
        check(batch(spec, ref_logprobs=ref), name)
    assert err.value.param == "data[0].loss_fn_inputs.ref_logprobs"
    inputs_D = [d.loss_fn_inputs for d in batch(spec)]
    with pytest.raises(BadRequestError) as err:
        validate_loss_inputs(name, inputs_D, stage="trainer")
    assert err.value.param == "data[0].loss_fn_inputs.ref_logprobs"
    assert validate_loss_inputs(name, inputs_D, stage="client").config == spec.config_defaults


@pytest.mark.parametrize("loss_fn", ["hinge", "", "PPO", None, 3])
def test_an_unknown_loss_is_a_400_naming_loss_fn_and_listing_the_built_in_ones(loss_fn):
    with pytest.raises(BadRequestError) as err:
        check(batch(LOSS_SPECS["cross_entropy"]), loss_fn)
    assert (err.value.status, err.value.param) == (400, "loss_fn")
    assert "unknown loss_fn" in err.value.message and all(n in err.value.message for n in LOSS_SPECS)


@pytest.mark.parametrize("loss_fn", sorted(REFUSED_LOSSES))
def test_tinker_losses_livelora_refuses_are_400_unsupported_parameter(loss_fn):
    with pytest.raises(UnsupportedParameterError) as err:
        get_spec(loss_fn)
    assert (err.value.status, err.value.param, err.value.code) == (400, "loss_fn", "unsupported_parameter")
    assert loss_fn in err.value.message


@pytest.mark.parametrize(
    "name,n,needle",
    [
        ("kto", 1, "kto needs at least 2 datums"),
        ("dpo", 1, "odd number of datums (1)"),
        ("dpo", 3, "odd number of datums (3)"),
        ("cross_entropy", 0, "the batch is empty"),
    ],
)
def test_too_small_or_unpaired_batches_are_a_400_naming_data(name, n, needle):
    with pytest.raises(BadRequestError, match=needle.replace("(", r"\(").replace(")", r"\)")) as err:
        check(batch(LOSS_SPECS[name], n), name)
    assert err.value.param == "data"


def test_dpo_takes_datums_as_chosen_rejected_pairs_and_min_batch_is_the_spec_s():
    assert LOSS_SPECS["dpo"].pairing == "chosen_rejected" and LOSS_SPECS["dpo"].min_batch == 2
    assert LOSS_SPECS["kto"].min_batch == 2 and LOSS_SPECS["kto"].pairing == "none"
    assert all(s.min_batch == 1 for n, s in LOSS_SPECS.items() if n not in ("kto", "dpo"))
    for n in (2, 4, 6):
        check(batch(LOSS_SPECS["dpo"], n), "dpo")
    check(batch(LOSS_SPECS["kto"], 3), "kto")  # KTO has no pairing: odd batches are fine


def test_preference_losses_need_a_completion_token_in_every_datum():
    spec = LOSS_SPECS["dpo"]
    zeros = TensorData.from_list([0.0] * len(TOKENS), "float32")
    with pytest.raises(BadRequestError, match="dpo needs at least one completion token") as err:
        check(batch(spec, weights=zeros), "dpo")
    assert err.value.param == "data[0].loss_fn_inputs.weights"
    check(batch(LOSS_SPECS["cross_entropy"], weights=zeros), "cross_entropy")  # SFT pass 1 of a custom loss


@pytest.mark.parametrize("name,key", [(n, c.name) for n, c in CONFIG_BOUNDS])
def test_each_config_key_has_its_range_checked_and_wrong_types_refused(name, key):
    ck = next(c for c in LOSS_SPECS[name].config if c.name == key)
    bad = []
    if ck.minimum is not None:
        bad.append(ck.minimum if ck.exclusive_minimum else ck.minimum - 0.5)
    if ck.maximum is not None:
        bad.append(ck.maximum + 0.5)
    bad += [True, "0.5", float("nan")]
    for value in bad:
        with pytest.raises(BadRequestError) as err:
            check(batch(LOSS_SPECS[name]), name, {key: value})
        assert err.value.param == f"loss_fn_config.{key}", value
    assert check(batch(LOSS_SPECS[name]), name, {key: ck.default}).config[key] == ck.default


def test_validate_loss_inputs_reads_n_from_target_tokens_and_checks_tensors_like_the_gateway():
    spec = LOSS_SPECS["ppo"]
    inputs = client_inputs(spec)
    inputs["advantages"] = TensorData.from_list([1.0, float("inf"), 0.0, 0.0, 0.0], "float32")
    with pytest.raises(BadRequestError, match=r"data\[0\]\.loss_fn_inputs\.advantages: non-finite") as err:
        validate_loss_inputs("ppo", [inputs], datum_params=False)
    assert err.value.param == "loss_fn_inputs.advantages"


# ------------------------------------------------------------------------------------------------ gradient positions
def test_the_trainer_takes_gradient_positions_from_the_spec():
    t = torch.tensor
    ce = {"target_tokens": t([1, 2, 3, 4]), "weights": t([0.0, 1.0, 0.0, -0.5])}
    assert grad_positions(LOSS_SPECS["cross_entropy"], ce).tolist() == [False, True, False, True]
    top_k = {"target_tokens": t([[1, 2], [3, 4], [5, 6]]), "weights": t([[0.0, 0.0], [0.3, 0.0], [0.0, 0.2]])}
    assert grad_positions(LOSS_SPECS["cross_entropy"], top_k).tolist() == [False, True, True]
    rl = {
        "target_tokens": t([1, 2, 3, 4]),
        "logprobs": t([0.0, -1.0, -1.0, -1.0]),
        "advantages": t([0.0, 0.5, 0.5, 0.0]),
        "mask": t([1.0, 1.0, 0.0, 1.0]),
    }
    for name in ("importance_sampling", "ppo", "cispo"):
        assert grad_positions(LOSS_SPECS[name], rl).tolist() == [False, True, False, False]
    # dro's quadratic term reaches positions with A = 0; only the mask removes them
    assert grad_positions(LOSS_SPECS["dro"], rl).tolist() == [True, True, False, True]
    no_mask = {k: v for k, v in rl.items() if k != "mask"}
    assert grad_positions(LOSS_SPECS["dro"], no_mask).tolist() == [True] * 4
    assert grad_positions(LOSS_SPECS["ppo"], no_mask).tolist() == [False, True, True, False]


# ------------------------------------------------------------------------------------------------ trainer entry
@pytest.fixture(scope="module")
def trainer_model(base_ref):
    from livelora.clients.types import LoraConfig

    return TrainingModel(base_ref, LoraConfig(rank=2, seed=0))


@pytest.mark.parametrize(
    "name,data,param,needle",
    [
        ("hinge", None, "loss_fn", "unknown loss_fn 'hinge'"),
        ("kto", 1, "data", "at least 2 datums"),
        ("dpo", 3, "data", "odd number"),
        ("kto", {"label": None}, "data[0].loss_fn_inputs.label", "missing label"),
        ("ppo", {"advantages": None}, "data[0].loss_fn_inputs.advantages", "missing advantages"),
    ],
)
def test_the_trainer_refuses_the_same_batches_with_the_same_400_and_changes_nothing(
    trainer_model, name, data, param, needle
):
    spec = LOSS_SPECS.get(name, LOSS_SPECS["cross_entropy"])
    datums = batch(spec, data) if isinstance(data, int) or data is None else batch(spec, **data)
    for run in (trainer_model.forward_backward, trainer_model.forward):
        with pytest.raises(BadRequestError, match=needle) as err:
            run(datums, name)
        assert (err.value.status, err.value.param) == (400, param)
    assert not trainer_model.has_gradients() and trainer_model.step == 0


def test_the_trainer_trains_every_spec_on_a_batch_built_from_the_spec(trainer_model):
    for name, spec in LOSS_SPECS.items():
        out = trainer_model.forward_backward(batch(spec), name)
        assert torch.isfinite(torch.tensor(out.metrics["loss:sum"])), name
        assert out.metrics["num_sequences:sum"] == spec.min_batch
    assert trainer_model.has_gradients()
    trainer_model.zero_grad()


# ------------------------------------------------------------------------------------------------ gateway door
def test_the_gateway_refuses_a_bad_loss_at_the_door_with_the_shared_validation(sessions_server):
    checks = sessions_server.services.sessions.ops.checks  # the training ops validate at the door

    def request(loss_fn, data):
        return ForwardBackwardRequest(
            model_id="m:train:0", seq_id=1, forward_backward_input=ForwardBackwardInput(data=data, loss_fn=loss_fn)
        )

    assert checks.validate("forward_backward", request("ppo", batch(LOSS_SPECS["ppo"])))["input"]["loss_fn"] == "ppo"
    cases = [
        ("hinge", batch(LOSS_SPECS["ppo"]), "loss_fn"),
        ("kto", batch(LOSS_SPECS["kto"], 1), "data"),
        ("dpo", batch(LOSS_SPECS["dpo"], 3), "data"),
        ("kto", batch(LOSS_SPECS["kto"], label=None), "data[0].loss_fn_inputs.label"),
    ]
    for loss_fn, data, param in cases:
        with pytest.raises(BadRequestError) as err:
            checks.validate("forward_backward", request(loss_fn, data))
        assert (err.value.status, err.value.param) == (400, param), loss_fn


def test_an_unknown_loss_through_the_sdk_fails_its_future_with_a_400_naming_loss_fn(sessions_server):
    from livelora.clients import ServiceClient

    with ServiceClient(sessions_server.base_url) as service:
        tc = service.create_lora_training_client(MODEL, rank=2, seed=0)
        for loss_fn, data, param in [
            ("hinge", batch(LOSS_SPECS["cross_entropy"]), "loss_fn"),
            ("dpo", batch(LOSS_SPECS["dpo"], 1), "data"),
        ]:
            with pytest.raises(BadRequestError) as err:
                tc.forward_backward(data, loss_fn).result(timeout=60)
            assert err.value.param == param
        assert tc.forward(batch(LOSS_SPECS["cross_entropy"])).result(timeout=60).metrics["loss:sum"] >= 0
