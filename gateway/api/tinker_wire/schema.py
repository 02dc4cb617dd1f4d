"""The protobuf messages of the tinker wire format, declared in Python (no ``.proto`` file, no generated code).

The field table below is the one source of truth; ``docs/internals/wire-types.md`` gives it in prose and says
why it is declared this way. The messages live in a private descriptor pool under ``livelora.tinker_wire``.
Field declarations are ``(name, number, type, flags)``: ``type`` a scalar, a message or enum name of this schema,
or ``"map<K,V>"``; ``flags`` ``"repeated"``, ``"optional"`` or ``"oneof:<name>"``.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "livelora.tinker_wire"

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    "string": _F.TYPE_STRING,
    "bytes": _F.TYPE_BYTES,
    "int32": _F.TYPE_INT32,
    "int64": _F.TYPE_INT64,
    "uint32": _F.TYPE_UINT32,
    "uint64": _F.TYPE_UINT64,
    "bool": _F.TYPE_BOOL,
    "float": _F.TYPE_FLOAT,
    "double": _F.TYPE_DOUBLE,
}

#: enum name → [(value name, number)]
ENUMS: dict[str, list[tuple[str, int]]] = {
    "StopReason": [("STOP_REASON_STOP", 0), ("STOP_REASON_LENGTH", 1)],
    "DType": [
        ("DTYPE_UNSPECIFIED", 0),
        ("DTYPE_FLOAT32", 1),
        ("DTYPE_INT64", 2),
        ("DTYPE_INT32", 3),
        ("DTYPE_BFLOAT16", 4),
    ],
}

#: message name → fields (see the module docstring)
MESSAGES: dict[str, list[tuple[str, int, str, str]]] = {
    # ---------------------------------------------------------------- tensors
    "Tensor": [
        ("dense", 1, "bytes", "oneof:encoding"),
        ("sparse_csr", 2, "SparseCsr", "oneof:encoding"),
        ("dtype", 3, "DType", ""),
        ("shape", 4, "int64", "repeated"),
    ],
    "SparseCsr": [("values", 1, "bytes", ""), ("crow_indices", 2, "bytes", ""), ("col_indices", 3, "bytes", "")],
    "BatchedTensor": [
        ("data", 1, "bytes", ""),
        ("offsets", 2, "bytes", ""),
        ("dtype", 3, "DType", ""),
        ("trailing_shape", 4, "int64", "repeated"),
    ],
    "TopkLogprobs": [
        ("token_ids", 1, "bytes", ""),
        ("logprobs", 2, "bytes", ""),
        ("k", 3, "uint32", ""),
        ("length", 4, "uint32", ""),
    ],
    # ---------------------------------------------------------------- forward_backward request
    "ForwardBackwardRequest": [
        ("model_id", 1, "string", ""),
        ("seq_id", 2, "int32", ""),
        ("data", 3, "Datum", "repeated"),
        ("loss_fn", 4, "string", ""),
        ("loss_fn_config", 5, "map<string,double>", ""),
        ("forward_only", 6, "bool", ""),
        ("loss_fn_config_v2", 7, "map<string,LossConfigValue>", ""),
    ],
    "LossConfigValue": [("number", 1, "double", "oneof:value"), ("text", 2, "string", "oneof:value")],
    "Datum": [
        ("model_input", 1, "Chunk", "repeated"),
        ("loss_fn_inputs", 2, "map<string,Tensor>", ""),
        ("model_input_spans", 3, "ProvenanceSpan", "repeated"),
        ("loss_fn_input_spans", 4, "ProvenanceSpan", "repeated"),
    ],
    "ProvenanceSpan": [
        ("prompt_tokens", 1, "PromptProvenanceSpan", "oneof:span"),
        ("sampled_tokens", 2, "SampledProvenanceSpan", "oneof:span"),
    ],
    "PromptProvenanceSpan": [("sequence_id", 1, "string", ""), ("offset", 2, "int64", ""), ("length", 3, "int64", "")],
    "SampledProvenanceSpan": [("sequence_id", 1, "string", ""), ("offset", 2, "int64", ""), ("length", 3, "int64", "")],
    "Chunk": [
        ("encoded_text", 1, "EncodedTextChunk", "oneof:chunk"),
        ("image", 2, "ImageChunk", "oneof:chunk"),
        ("dmel", 3, "DmelChunk", "oneof:chunk"),
    ],
    "EncodedTextChunk": [("tokens", 1, "bytes", "")],
    "ImageChunk": [
        ("data", 1, "bytes", ""),
        ("format", 2, "string", ""),
        ("expected_tokens", 3, "int32", "optional"),
        ("override_dimensions", 4, "ImageDimensions", "optional"),
    ],
    "ImageDimensions": [("width", 1, "uint32", ""), ("height", 2, "uint32", "")],
    "DmelChunk": [("dmel", 1, "bytes", "")],
    # ---------------------------------------------------------------- forward_backward result
    "ForwardBackwardOutput": [
        ("loss_fn_output_type", 1, "string", ""),
        ("loss_fn_outputs", 2, "ArrayRecord", "repeated"),
        ("metrics", 3, "map<string,double>", ""),
    ],
    "ArrayRecord": [
        ("type_tag", 1, "string", ""),
        ("fields", 2, "map<string,BatchedTensor>", ""),
        ("num_datums", 3, "int64", ""),
    ],
    # ---------------------------------------------------------------- sample result
    "SampleResponse": [
        ("sequences", 1, "SampledSequence", "repeated"),
        ("prompt_logprobs", 2, "bytes", "optional"),
        ("topk_prompt_logprobs", 3, "TopkLogprobs", "optional"),
        ("prompt_cache_hit_tokens", 4, "int32", ""),
        ("target_prompt_logprobs", 5, "Tensor", "optional"),
        ("prompt_alt_tokens", 6, "PromptAltTokens", "optional"),
    ],
    "SampledSequence": [
        ("stop_reason", 1, "StopReason", ""),
        ("tokens", 2, "bytes", ""),
        ("logprobs", 3, "bytes", "optional"),
        ("topk_sampled_logprobs", 4, "TopkLogprobs", "optional"),
    ],
    "PromptAltTokens": [("tokens", 1, "Tensor", ""), ("logprobs", 2, "Tensor", "")],
    # ---------------------------------------------------------------- declared by the SDK, not sent by it yet
    "SamplingParams": [
        ("max_tokens", 1, "int32", "optional"),
        ("seed", 2, "uint64", "optional"),
        ("temperature", 3, "float", "optional"),
        ("top_k", 4, "int32", "optional"),
        ("top_p", 5, "float", "optional"),
        ("stop_strs", 6, "StopStrings", "oneof:stop"),
        ("stop_tokens", 7, "StopTokens", "oneof:stop"),
    ],
    "StopStrings": [("values", 1, "string", "repeated")],
    "StopTokens": [("values", 1, "int32", "repeated")],
}


def _field(msg: descriptor_pb2.DescriptorProto, name: str, number: int, ftype: str, flags: str) -> None:
    f = msg.field.add(name=name, number=number, json_name=_camel(name))
    if ftype.startswith("map<"):
        key, value = ftype[4:-1].split(",")
        entry = msg.nested_type.add(name=_camel(name, upper=True) + "Entry")
        entry.options.map_entry = True
        _field(entry, "key", 1, key, "")
        _field(entry, "value", 2, value, "")
        f.label = _F.LABEL_REPEATED
        f.type = _F.TYPE_MESSAGE
        f.type_name = f".{PACKAGE}.{msg.name}.{entry.name}"
        return
    f.label = _F.LABEL_REPEATED if flags == "repeated" else _F.LABEL_OPTIONAL
    if ftype in _SCALARS:
        f.type = _SCALARS[ftype]
    elif ftype in ENUMS:
        f.type = _F.TYPE_ENUM
        f.type_name = f".{PACKAGE}.{ftype}"
    else:
        f.type = _F.TYPE_MESSAGE
        f.type_name = f".{PACKAGE}.{ftype}"
    if flags.startswith("oneof:"):
        f.oneof_index = _oneof_index(msg, flags[len("oneof:") :])
    elif flags == "optional":  # proto3 explicit presence = a synthetic one-field oneof named _<field>
        f.proto3_optional = True
        f.oneof_index = _oneof_index(msg, f"_{name}")


def _oneof_index(msg: descriptor_pb2.DescriptorProto, name: str) -> int:
    for i, decl in enumerate(msg.oneof_decl):
        if decl.name == name:
            return i
    msg.oneof_decl.add(name=name)
    return len(msg.oneof_decl) - 1


def _camel(name: str, upper: bool = False) -> str:
    parts = name.split("_")
    head = parts[0].capitalize() if upper else parts[0]
    return head + "".join(p.capitalize() for p in parts[1:])


def _file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto(name="livelora_tinker_wire.proto", package=PACKAGE, syntax="proto3")
    for name, values in ENUMS.items():
        enum = fdp.enum_type.add(name=name)
        for value_name, number in values:
            enum.value.add(name=value_name, number=number)
    for name, fields in MESSAGES.items():
        msg = fdp.message_type.add(name=name)
        plain = [f for f in fields if not f[3].startswith("optional")]
        # synthetic oneofs must come after real ones in the declaration order
        for spec in plain + [f for f in fields if f[3] == "optional"]:
            _field(msg, *spec)
        order = {spec[0]: i for i, spec in enumerate(fields)}
        msg.field.sort(key=lambda fd: order[fd.name])
    return fdp


def _build() -> dict[str, Any]:
    pool = descriptor_pool.DescriptorPool()
    pool.Add(_file_descriptor())
    get_class = getattr(message_factory, "GetMessageClass", None)  # protobuf >= 4.22
    if get_class is None:
        get_class = message_factory.MessageFactory(pool).GetPrototype
    return {name: get_class(pool.FindMessageTypeByName(f"{PACKAGE}.{name}")) for name in MESSAGES}


_CLASSES = _build()

Tensor = _CLASSES["Tensor"]
BatchedTensor = _CLASSES["BatchedTensor"]
TopkLogprobs = _CLASSES["TopkLogprobs"]
ForwardBackwardRequest = _CLASSES["ForwardBackwardRequest"]
Datum = _CLASSES["Datum"]
ForwardBackwardOutput = _CLASSES["ForwardBackwardOutput"]
ArrayRecord = _CLASSES["ArrayRecord"]
SampleResponse = _CLASSES["SampleResponse"]
SampledSequence = _CLASSES["SampledSequence"]
PromptAltTokens = _CLASSES["PromptAltTokens"]

#: enum numbers
STOP_REASON = {"stop": 0, "length": 1}
DTYPE_UNSPECIFIED, DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32, DTYPE_BFLOAT16 = 0, 1, 2, 3, 4

__all__ = [
    "DTYPE_BFLOAT16",
    "DTYPE_FLOAT32",
    "DTYPE_INT32",
    "DTYPE_INT64",
    "DTYPE_UNSPECIFIED",
    "ENUMS",
    "MESSAGES",
    "STOP_REASON",
    "ArrayRecord",
    "BatchedTensor",
    "Datum",
    "ForwardBackwardOutput",
    "ForwardBackwardRequest",
    "PromptAltTokens",
    "SampleResponse",
    "SampledSequence",
    "Tensor",
    "TopkLogprobs",
]
